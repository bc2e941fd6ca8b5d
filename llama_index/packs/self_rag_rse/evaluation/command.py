"""``self-rag-rse evaluate``: index a folder, run the five engines over a question set, report.

Offline by default: the bundled MiniLM embeds, the bundled SmolLM2-135M answers and judges. The
index is Qdrant local mode in memory (SentenceSplitter 128/16 tokens and ``ChunkIndexer``, as the
demo), rebuilt each run; answers and judgements are cached in ``OUTDIR/cache.jsonl``, so a rerun
after a crash resumes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shlex
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llama_index.packs.self_rag_rse.evaluation.models import SPEC_HELP, ModelSpec, parse_spec

logger = logging.getLogger(__name__)

CHUNK_SIZE, CHUNK_OVERLAP = 128, 16
CACHE_FILE = "cache.jsonl"
#: Judge reply lengths: room for RAGAS's JSON lists; the bundled judge's replies are unusable
#: at any length, so it is kept short.
JUDGE_TOKENS, BUNDLED_JUDGE_TOKENS = 512, 128

PLACEHOLDER_JUDGE = (
    "The judge is the bundled SmolLM2-135M, a 135M-parameter model. It cannot reliably follow "
    "judging prompts (RAGAS asks for JSON, LlamaIndex's evaluators for rubric scores; many "
    "judgements fail, the rest are close to noise), so these "
    "scores show that the evaluation runs end to end, not which engine answers better. For "
    "numbers that mean something, judge with a capable served model: "
    "--judge openai-like-chat:MODEL --judge-url http://HOST:PORT/v1."
)
PLACEHOLDER_ANSWERER = (
    "The answering model is the bundled SmolLM2-135M: its relevance judgements measured at "
    "chance (AUC 0.28 on 40 hand-built pairs), so Self-RAG's critic cannot rank paragraphs "
    "with it. Answer quality and engine differences here are not representative; use --llm "
    "with a Self-RAG GGUF or a served instruct model."
)

EPILOG = f"""\
Each line of --qa is a JSON object: {{"question": ..., "document": FILE, "evidence": TEXT,
"reference": ANSWER}}; only "question" is required. "document" is a file in --docs,
"evidence" text copied verbatim from it (gold passage: evidence recall/precision, no LLM
needed), "reference" a reference answer (RAGAS context precision/recall, LlamaIndex
correctness).

Model specifications (--llm, --judge): {SPEC_HELP}.

Writes OUTDIR/report.md (table: engines x metrics, mean +- sd), OUTDIR/report.png (the same
per question), OUTDIR/records.json (one record per question and engine) and
OUTDIR/cache.jsonl (finished answers and judgements: run again to resume; --fresh to start over).

Judged metrics: RAGAS (faithfulness, answer_relevancy, context_precision / context_utilization,
context_recall) when ragas is installed (pip install "llama-index-packs-self-rag-rse[eval]"),
else LlamaIndex's evaluators (li_*). The bundled judge gets LlamaIndex's evaluators unless
--judge-backend ragas: a 135M model cannot write RAGAS's JSON replies. Examples:

  self-rag-rse evaluate --docs examples/data/python_reference \\
      --qa benchmarks/data/python_reference_qa.jsonl --out eval-out --limit 10
  self-rag-rse evaluate --docs DIR --qa QA.jsonl --out OUT \\
      --judge openai-like-chat:qwen2.5-7b-instruct --judge-url http://127.0.0.1:8000/v1
"""


def add_evaluate_parser(commands: Any) -> argparse.ArgumentParser:
    """Register the ``evaluate`` subcommand on the ``self-rag-rse`` parser's subparsers."""
    from llama_index.packs.self_rag_rse.evaluation.engines import ENGINE_NAMES

    parser: argparse.ArgumentParser = commands.add_parser(
        "evaluate",
        help="compare top-k, RSE and Self-RAG engines on your documents and questions",
        description="Run several query engines over one question set on one index and one "
        "LLM, judge the answers (RAGAS or LlamaIndex evaluators), measure evidence "
        "recall/precision, latency and model calls, and write a report.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    need = parser.add_argument_group("inputs and output")
    need.add_argument("--docs", required=True, type=Path, metavar="DIR", help=".txt/.md files")
    need.add_argument("--qa", required=True, type=Path, metavar="FILE", help="questions, .jsonl")
    need.add_argument("--out", required=True, type=Path, metavar="OUTDIR", help="report folder")
    models = parser.add_argument_group("models")
    models.add_argument("--llm", default="bundled", metavar="SPEC", help="answering LLM")
    models.add_argument("--llm-url", metavar="URL", help="base URL for --llm openai-like")
    models.add_argument("--judge", default="bundled", metavar="SPEC", help="judge LLM")
    models.add_argument("--judge-url", metavar="URL", help="base URL for --judge openai-like")
    models.add_argument(
        "--judge-backend",
        choices=("auto", "ragas", "llamaindex", "none"),
        default="auto",
        help="auto: RAGAS when installed, else LlamaIndex evaluators (and always with the "
        "bundled judge, which cannot write RAGAS's JSON; --judge-backend ragas forces it); "
        "none: no judge (evidence, latency and model calls only)",
    )
    run = parser.add_argument_group("what to run")
    run.add_argument(
        "--engines",
        default=",".join(ENGINE_NAMES),
        metavar="NAMES",
        help=f"comma-separated subset of {','.join(ENGINE_NAMES)} (default: all)",
    )
    run.add_argument(
        "--metrics", metavar="NAMES", help="comma-separated metrics (default: all that apply)"
    )
    run.add_argument("--limit", type=int, metavar="N", help="first N questions only")
    knobs = parser.add_argument_group("engine settings (same for every engine)")
    knobs.add_argument("--top-k", type=int, default=8, help="chunks retrieved (default 8)")
    knobs.add_argument("--ndocs", type=int, default=3, help="paragraphs Self-RAG judges")
    knobs.add_argument("--max-new-tokens", type=int, default=64, help="answer length (default 64)")
    knobs.add_argument(
        "--self-rag-mode",
        choices=("adaptive_retrieval", "always_retrieve", "no_retrieval"),
        default="always_retrieve",
        help="always_retrieve (default: questions about the documents need them) or "
        "adaptive_retrieval (the critic decides, as in the paper)",
    )
    knobs.add_argument(
        "--rse-max-length", type=int, default=6, help="chunks per RSE segment (default 6)"
    )
    knobs.add_argument(
        "--rse-overall-max-length", type=int, default=12, help="chunks in all segments (12)"
    )
    knobs.add_argument(
        "--context-window", type=int, default=4096, help="llama.cpp context (default 4096)"
    )
    judging = parser.add_argument_group("judging")
    judging.add_argument(
        "--judge-max-tokens",
        type=int,
        default=None,
        help="judge reply length (default 512, room for RAGAS's JSON lists; 128 for the "
        "bundled judge, whose long replies are not usable anyway and cost minutes)",
    )
    judging.add_argument("--workers", type=int, default=4, help="judgements in flight (4)")
    judging.add_argument(
        "--timeout", type=float, default=600.0, help="seconds per judgement attempt (600)"
    )
    judging.add_argument("--retries", type=int, default=1, help="extra attempts (default 1)")
    parser.add_argument("--fresh", action="store_true", help="ignore and replace the cache")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def run_evaluate(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    """Run the ``evaluate`` subcommand; 0 on success, 1 on a reported error."""
    from llama_index.packs.self_rag_rse.evaluation.questions import (
        load_questions,
        read_documents,
    )

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Failed judgements are recorded in the report; RAGAS also logs each at ERROR level.
    logging.getLogger("ragas").setLevel(logging.CRITICAL)
    try:
        _check_args(args)
        # Model specifications are checked before anything slow is loaded.
        llm_spec = parse_spec(args.llm, args.llm_url)
        judge_spec = (
            parse_spec(args.judge, args.judge_url, url_flag="--judge-url")
            if args.judge_backend != "none"
            else None
        )
        documents = read_documents(args.docs)
        questions = load_questions(args.qa, documents, limit=args.limit)
    except ValueError as error:
        print(f"self-rag-rse evaluate: error: {error}", file=sys.stderr)
        return 1
    command = shlex.join(["self-rag-rse", *(sys.argv[1:] if argv is None else argv)])
    try:
        return _run(args, llm_spec, judge_spec, documents, questions, command)
    except (ValueError, ImportError, OSError, TypeError) as error:
        print(f"self-rag-rse evaluate: error: {error}", file=sys.stderr)
        return 1


def _check_args(args: argparse.Namespace) -> None:
    from llama_index.packs.self_rag_rse.evaluation.engines import ENGINE_NAMES
    from llama_index.packs.self_rag_rse.evaluation.llamaindex_judge import LLAMAINDEX_METRICS
    from llama_index.packs.self_rag_rse.evaluation.ragas_judge import RAGAS_METRICS
    from llama_index.packs.self_rag_rse.evaluation.runner import EVIDENCE_METRICS

    engines = [n.strip() for n in args.engines.split(",") if n.strip()]
    unknown = [n for n in engines if n not in ENGINE_NAMES] or ([] if engines else ["(none)"])
    if unknown:
        raise ValueError(f"--engines: unknown {unknown}; choose from {','.join(ENGINE_NAMES)}")
    known = (*RAGAS_METRICS, *LLAMAINDEX_METRICS, *EVIDENCE_METRICS)
    metrics = [m.strip() for m in (args.metrics or "").split(",") if m.strip()]
    unknown = [m for m in metrics if m not in known]
    if unknown:
        raise ValueError(f"--metrics: unknown {unknown}; choose from {','.join(known)}")
    for name in ("top_k", "ndocs", "max_new_tokens", "judge_max_tokens", "workers"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.retries < 0:
        raise ValueError("--retries must be 0 or more")
    if args.limit is not None and args.limit < 1:
        raise ValueError("--limit must be at least 1")


def _run(
    args: argparse.Namespace,
    llm_spec: ModelSpec,
    judge_spec: ModelSpec | None,
    documents: dict[str, str],
    questions: list[Any],
    command: str,
) -> int:
    from llama_index.packs.self_rag_rse.evaluation.engines import (
        ENGINE_DESCRIPTIONS,
        close_engines,
        default_engines,
    )
    from llama_index.packs.self_rag_rse.evaluation.llamaindex_judge import make_judge
    from llama_index.packs.self_rag_rse.evaluation.models import bundled_embedding, load_llm
    from llama_index.packs.self_rag_rse.evaluation.protocol import embed_label
    from llama_index.packs.self_rag_rse.evaluation.report import markdown_table
    from llama_index.packs.self_rag_rse.evaluation.runner import evaluate

    names = [n.strip() for n in args.engines.split(",") if n.strip()]
    metrics = [m.strip() for m in args.metrics.split(",") if m.strip()] if args.metrics else None
    args.out.mkdir(parents=True, exist_ok=True)
    cache = args.out / CACHE_FILE
    if args.fresh and cache.exists():
        cache.unlink()

    embed = bundled_embedding()
    print(f"Indexing {len(documents)} document(s) from {args.docs} ...", flush=True)
    index = build_index(documents, embed)
    loaded = []
    engines: dict[str, Any] = {}
    try:
        answerer = load_llm(
            llm_spec, max_new_tokens=args.max_new_tokens, context_window=args.context_window
        )
        loaded.append(answerer)
        judge = None
        notes = []
        if answerer.bundled:
            notes.append(PLACEHOLDER_ANSWERER)
        if judge_spec is not None:
            judge_tokens = args.judge_max_tokens or (
                BUNDLED_JUDGE_TOKENS if judge_spec.bundled else JUDGE_TOKENS
            )
            judge_llm = load_llm(
                judge_spec, max_new_tokens=judge_tokens, context_window=args.context_window
            )
            loaded.append(judge_llm)
            backend = args.judge_backend
            if backend == "auto" and judge_spec.bundled:
                # A 135M model cannot write RAGAS's JSON: each RAGAS judgement would fail after
                # four long calls (RAGAS retries with a format-fixing prompt), hours on a real
                # question set. LlamaIndex's evaluators ask one short question each.
                backend = "llamaindex"
            judge = make_judge(judge_llm.llm, embed, backend=backend)
            if judge_llm.bundled:
                notes.insert(0, PLACEHOLDER_JUDGE)
        engine_options = {
            "similarity_top_k": args.top_k,
            "ndocs": args.ndocs,
            "max_new_tokens": args.max_new_tokens,
            "mode": args.self_rag_mode,
            "rse_max_length": args.rse_max_length,
            "rse_overall_max_length": args.rse_overall_max_length,
            "context_window": args.context_window,
        }
        engines = default_engines(
            index,
            answerer.llm,
            similarity_top_k=args.top_k,
            engines=names,
            rse_options={
                "max_length": args.rse_max_length,
                "overall_max_length": args.rse_overall_max_length,
            },
            self_rag_options={
                "ndocs": args.ndocs,
                "max_new_tokens": args.max_new_tokens,
                "mode": args.self_rag_mode,
            },
        )
        settings = {
            "command": command,
            "questions_file": str(args.qa),
            "documents": f"{args.docs} ({len(documents)} file(s))",
            "llm": answerer.label,
            "embed_model": embed_label(embed),
            "index": f"Qdrant local mode, SentenceSplitter({CHUNK_SIZE}, {CHUNK_OVERLAP})",
            "engine_options": engine_options,
            "engines": {n: ENGINE_DESCRIPTIONS[n] for n in engines},
        }
        key = settings_key(documents, answerer.label, embed_label(embed), engine_options)
        result = evaluate(
            engines,
            questions,
            judge,
            documents=documents,
            metrics=metrics,
            cache=cache,
            settings_key=key,
            workers=args.workers,
            timeout_s=args.timeout,
            retries=args.retries,
            progress=not args.no_progress,
            settings=settings,
            notes=notes,
        )
        paths = result.save(args.out)
    finally:
        close_engines(engines)
        for model in reversed(loaded):
            model.close()
    print()
    print(markdown_table(result))
    print()
    for note in result.notes:
        print(f"Caveat: {note}\n")
    for kind in ("report", "chart", "records"):
        if kind in paths:
            print(f"{kind}: {paths[kind]}")
    return 0


def build_index(documents: dict[str, str], embed: Any) -> Any:
    """A ``VectorStoreIndex`` over Qdrant local mode (in memory) with chunk indexes stamped."""
    from llama_index.core import Document, StorageContext, VectorStoreIndex
    from llama_index.core.ingestion import IngestionPipeline
    from llama_index.core.node_parser import SentenceSplitter

    from llama_index.packs.self_rag_rse.common.optional import optional_import
    from llama_index.packs.self_rag_rse.rse.chunk_index import ChunkIndexer

    qdrant = optional_import("llama_index.vector_stores.qdrant", "the evaluation index")
    client = optional_import("qdrant_client", "the evaluation index")
    docs = [
        Document(text=text, id_=name, metadata={"file_name": name})
        for name, text in documents.items()
    ]
    nodes = IngestionPipeline(
        transformations=[
            SentenceSplitter(chunk_size=CHUNK_SIZE, chunk_overlap=CHUNK_OVERLAP),
            ChunkIndexer(stable_ids=True),
            embed,
        ]
    ).run(documents=docs)
    store = qdrant.QdrantVectorStore(
        client=client.QdrantClient(location=":memory:"), collection_name="evaluation"
    )
    storage = StorageContext.from_defaults(vector_store=store)
    with warnings.catch_warnings():
        # ChunkIndexer's payload index: Qdrant local mode warns that it scans instead.
        warnings.filterwarnings("ignore", message="Payload indexes have no effect")
        return VectorStoreIndex(nodes, storage_context=storage, embed_model=embed)


def settings_key(documents: dict[str, str], llm: str, embed: str, options: dict[str, Any]) -> str:
    """A digest of everything that changes the answers: documents, models, engine options."""
    digest = hashlib.sha256()
    for name in sorted(documents):
        digest.update(name.encode())
        digest.update(documents[name].encode())
    setup = [llm, embed, CHUNK_SIZE, CHUNK_OVERLAP, options]
    digest.update(json.dumps(setup, sort_keys=True).encode())
    return digest.hexdigest()[:16]
