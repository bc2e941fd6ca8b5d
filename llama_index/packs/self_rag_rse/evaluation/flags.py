"""``self-rag-rse evaluate``'s flags, and what runs before llama-index-core loads.

Parsing, ``--help`` and argparse's errors need none of the evaluation's machinery, so this
module imports none of it: the command answers them at once. :func:`run` then imports the
command (:mod:`.command`: seconds) and turns Ctrl-C, at any moment, into one line and exit 130.
"""

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from llama_index.packs.self_rag_rse.evaluation.names import (
    BUNDLED,
    BUNDLED_JUDGE_TOKENS,
    CACHE_FILE,
    ENGINE_NAMES,
    EVIDENCE_METRICS,
    JUDGE_TOKENS,
    LLAMAINDEX_METRICS,
    MODEL_FORMS,
    RAGAS_METRICS,
    RSE_CHUNKS,
)
from llama_index.packs.self_rag_rse.rse.values import MAX_BUDGET

METRICS = (*RAGAS_METRICS, *LLAMAINDEX_METRICS, *EVIDENCE_METRICS)
EPILOG = """--qa lines: {"question": ..., "document": FILE, "evidence": TEXT, "reference": ANSWER}.
Writes OUTDIR/report.md, report.png, records.json, cache.jsonl. Details: docs/evaluate.md."""


def run(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    """Run ``evaluate`` on parsed ``args``; 0 on success, 1 on a reported error, 130 on Ctrl-C.

    Ctrl-C while llama-index-core imports, the models load or the index builds ends as it does
    during the run: one line, with the resume hint, and exit status 130.
    """
    try:
        # Imported here, not above: --help and argparse's errors need none of it.
        from llama_index.packs.self_rag_rse.evaluation.command import run_evaluate

        return run_evaluate(args, argv)
    except KeyboardInterrupt:
        print(
            f"\ninterrupted: {args.out / CACHE_FILE} holds every finished answer and judgement; "
            "run the same command again to resume",
            file=sys.stderr,
        )
        return 130


def _number(kind: type, low: float, wants: str, high: float = math.inf) -> Callable[[str], Any]:
    """An argparse ``type=``: a finite ``kind`` in ``[low, high]`` (above ``low``: a float)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = math.nan
        in_range = math.isfinite(value) and low <= value <= high
        # A float must lie above ``low``: a timeout of 0 s would fail every judgement.
        on_open_bound = kind is float and value == low
        if not in_range or on_open_bound:
            raise argparse.ArgumentTypeError(f"must be {wants}, got {text!r}")
        return value

    return parse


def _names(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse ``type=``: a comma-separated subset of ``choices``."""

    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",") if name.strip()]
        # Nothing given is refused as the name "(none)", which no choice is.
        if unknown := [name for name in names or ["(none)"] if name not in choices]:
            raise argparse.ArgumentTypeError(
                f"unknown {unknown}; choose from {','.join(choices)} (comma-separated)"
            )
        return names

    return parse


def add_evaluate_parser(commands: Any) -> argparse.ArgumentParser:
    """Register the ``evaluate`` subcommand on the ``self-rag-rse`` parser's subparsers."""
    parser: argparse.ArgumentParser = commands.add_parser(
        "evaluate",
        help="compare top-k, RSE and Self-RAG engines on your documents and questions",
        description="Run query engines over one question set, judge the answers, measure "
        "evidence recall/precision, latency and model calls, and write a report.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    at_least_one = _number(int, low=1, wants="a whole number of at least 1")
    parser.add_argument("--docs", required=True, type=Path, metavar="DIR", help=".txt/.md files")
    parser.add_argument("--qa", required=True, type=Path, metavar="FILE", help="questions")
    parser.add_argument("--out", required=True, type=Path, metavar="OUTDIR", help="report folder")
    parser.add_argument(
        "--llm", default=BUNDLED, metavar="MODEL", help=f"answering LLM: {MODEL_FORMS}"
    )
    parser.add_argument(
        "--judge", default=BUNDLED, metavar="MODEL", help=f"judge LLM: {MODEL_FORMS}"
    )
    parser.add_argument(
        "--judge-backend",
        choices=("auto", "ragas", "llamaindex", "none"),
        default="auto",
        help="auto: RAGAS if installed",
    )
    parser.add_argument(
        "--engines",
        type=_names(ENGINE_NAMES),
        default=list(ENGINE_NAMES),
        help=f"any of {','.join(ENGINE_NAMES)}",
    )
    parser.add_argument(
        "--metrics", type=_names(METRICS), help="comma-separated (default: all that apply)"
    )
    parser.add_argument("--limit", type=at_least_one, metavar="N", help="first N questions only")
    parser.add_argument(
        "--top-k", type=at_least_one, default=8, help="chunks retrieved (%(default)s)"
    )
    parser.add_argument(
        "--ndocs", type=at_least_one, default=3, help="paragraphs Self-RAG judges (%(default)s)"
    )
    parser.add_argument(
        "--max-new-tokens", type=at_least_one, default=64, help="answer length (%(default)s)"
    )
    parser.add_argument(
        "--rse-max-length",
        type=at_least_one,
        default=6,
        help="chunks per RSE segment (%(default)s)",
    )
    parser.add_argument(
        "--context-window",
        type=at_least_one,
        default=4096,
        help="llama.cpp context (%(default)s)",
    )
    parser.add_argument(
        "--workers", type=at_least_one, default=4, help="judgements in flight (%(default)s)"
    )
    parser.add_argument(
        "--self-rag-mode",
        choices=("adaptive_retrieval", "always_retrieve", "no_retrieval"),
        default="always_retrieve",
    )
    parser.add_argument(
        "--rse-overall-max-length",
        type=at_least_one,
        help=f"chunks in all segments ({RSE_CHUNKS})",
    )
    parser.add_argument(
        "--rse-context-chars",
        type=_number(
            int,
            low=1,
            wants=f"a whole number from 1 to {MAX_BUDGET:,} (characters)",
            high=MAX_BUDGET,
        ),
        help="RSE's budget in characters (max_context_chars)",
    )
    parser.add_argument(
        "--judge-max-tokens",
        type=at_least_one,
        help=f"judge reply ({JUDGE_TOKENS}; bundled: {BUNDLED_JUDGE_TOKENS})",
    )
    parser.add_argument(
        "--timeout",
        type=_number(float, low=0, wants="a number of seconds above 0"),
        default=600.0,
        help="seconds per judgement attempt (600)",
    )
    parser.add_argument(
        "--retries",
        type=_number(int, low=0, wants="0 or more"),
        default=1,
        help="extra attempts (%(default)s)",
    )
    parser.add_argument("--fresh", action="store_true", help="ignore and replace the cache")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser
