"""RelevantSegmentPostprocessor latency over Qdrant local mode with a 10k-chunk collection.

Builds a collection of ``--chunks`` chunks over ``--documents`` documents (synthetic text and
random unit vectors, so the figure is the postprocessor's own cost, not an embedder's), retrieves
the top-k for random query vectors and times the postprocessing alone. Three ingestion styles:
``ChunkIndexer(stable_ids=True)`` (gaps read by id), a stamped chunk index alone (gaps read by
one filtered call, which Qdrant local mode answers by scanning every point) and neither (the hit
documents are read back to learn the order); then ``docstore``: stable ids with the chunks read
from an in-memory docstore, the postprocessor's own cost with no store in the way. Each style
runs without a budget and with ``max_context_chars=--budget`` (6,000 by default; with
``--tokens``, ``max_context_tokens=--budget`` counted by the default tokenizer). Wall-clock
percentiles, then the 99th percentile of process CPU time (what the call costs on an idle core,
whatever else runs on the machine); the garbage collector is paused during each timed call,
as ``timeit`` does. Last, the peak memory of one call (tracemalloc) at the
budget and at the largest budget accepted (10,000,000 characters, or 2,500,000 tokens).

Run: python benchmarks/bench_rse_latency.py [--chunks 10000 --queries 200 --budget 6000]
[--budget 1500 --tokens]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import statistics
import sys
import time
import tracemalloc
from typing import Any

import numpy as np


def build(n_chunks: int, n_docs: int, dim: int, style: str, seed: int = 0):
    from llama_index.core.schema import NodeRelationship, RelatedNodeInfo, TextNode
    from llama_index.vector_stores.qdrant import QdrantVectorStore
    from qdrant_client import QdrantClient

    from llama_index.packs.self_rag_rse import ChunkIndexer

    rng = np.random.default_rng(seed)
    per_doc = n_chunks // n_docs
    nodes = []
    # Neighbouring chunks get similar vectors, as real text does, so hits cluster.
    for d in range(n_docs):
        walk = np.cumsum(rng.normal(size=(per_doc, dim)), axis=0)
        walk /= np.linalg.norm(walk, axis=1, keepdims=True)
        for i in range(per_doc):
            # Fixed-width numbers: every chunk has the same length, so the offsets are true.
            text = f"document {d:03d} chunk {i:06d} " + "lorem ipsum " * 40
            node = TextNode(
                text=text,
                embedding=walk[i].tolist(),
                start_char_idx=i * len(text),
                end_char_idx=(i + 1) * len(text),
                relationships={NodeRelationship.SOURCE: RelatedNodeInfo(node_id=f"doc-{d}")},
            )
            nodes.append(node)
    if style != "no chunk_index":
        ChunkIndexer(stable_ids=style == "stable ids")(nodes)
    store = QdrantVectorStore(
        client=QdrantClient(location=":memory:"), collection_name="latency", index_doc_id=False
    )
    for start in range(0, len(nodes), 1000):
        store.add(nodes[start : start + 1000])
    return store, nodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=10_000)
    parser.add_argument("--documents", type=int, default=20)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--top-k", type=int, default=30)
    parser.add_argument("--budget", type=int, default=6000, help="max_context_chars")
    parser.add_argument(
        "--tokens",
        action="store_true",
        help="the budget is max_context_tokens (the default tokenizer: a token per 4 characters)",
    )
    parser.add_argument("--dim", type=int, default=384)
    args = parser.parse_args()

    from llama_index.core.schema import NodeWithScore
    from llama_index.core.vector_stores.types import VectorStoreQuery

    from llama_index.packs.self_rag_rse import RelevantSegmentPostprocessor
    from llama_index.packs.self_rag_rse.rse.values import CHARS_PER_TOKEN, MAX_BUDGET

    unit = "max_context_tokens" if args.tokens else "max_context_chars"
    largest_budget = MAX_BUDGET // CHARS_PER_TOKEN if args.tokens else MAX_BUDGET

    print(
        f"Qdrant local mode (in memory), {args.chunks:,} chunks in {args.documents} documents, "
        f"top-{args.top_k}, {args.queries} queries"
    )
    print(
        f"{'ingestion':<22}{'budget':>7}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'p99 cpu':>9}"
        f"{'store calls/query':>19}{'segments':>10}{'ms when reading':>17}"
    )
    from llama_index.core.storage.docstore import SimpleDocumentStore

    for style, budget in itertools.product(
        ("stable ids", "chunk_index stamped", "no chunk_index", "docstore"), (None, args.budget)
    ):
        store, nodes = build(
            args.chunks, args.documents, args.dim, "stable ids" if style == "docstore" else style
        )
        stores: dict = {"vector_store": store}
        if style == "docstore":
            stores = {"docstore": SimpleDocumentStore()}
            stores["docstore"].add_documents(nodes)
        rse = RelevantSegmentPostprocessor(**stores, **{unit: budget})
        rse.extract([])  # imports and first-call set-up out of the timings
        rng = np.random.default_rng(1)
        times, cpu, calls, segments = [], [], [], []
        queries = []
        for _ in range(args.queries):
            anchor = nodes[int(rng.integers(len(nodes)))].embedding
            query = np.asarray(anchor) + 0.3 * rng.normal(size=args.dim) / np.sqrt(args.dim)
            found = store.query(
                VectorStoreQuery(query_embedding=query.tolist(), similarity_top_k=args.top_k)
            )
            hits = [
                NodeWithScore(node=n, score=s)
                for n, s in zip(found.nodes, found.similarities, strict=True)
            ]
            queries.append(hits)
            gc.collect()
            gc.disable()  # as timeit does: a collection of the whole heap is not this call's
            t, c = time.perf_counter(), time.process_time()
            extraction = rse.extract(hits)
            rse._to_nodes(extraction)
            times.append(1000 * (time.perf_counter() - t))
            cpu.append(1000 * (time.process_time() - c))
            gc.enable()
            calls.append(extraction.store_calls)
            segments.append(len(extraction.segments))
        p90, p99 = (float(np.percentile(times, q)) for q in (90, 99))
        reading = [t for t, c in zip(times, calls, strict=True) if c]
        when = f"{statistics.mean(reading):17.1f}" if reading else f"{'-':>17}"
        shown = f"{budget:,}{'t' if args.tokens else ''}" if budget else "-"
        print(
            f"{style:<22}{shown:>7}{statistics.median(times):9.2f}{p90:9.2f}{p99:9.2f}"
            f"{float(np.percentile(cpu, 99)):9.2f}"
            f"{statistics.mean(calls):19.2f}{statistics.mean(segments):10.1f}{when}"
        )
        if style == "docstore" and budget:
            largest = RelevantSegmentPostprocessor(**stores, **{unit: largest_budget})
            print(
                f"\npeak memory of one call (docstore, tracemalloc, {len(queries[:20])} queries): "
                f"{peak_memory(rse, queries[:20]) / 1e6:.2f} MB at budget {budget:,}, "
                f"{peak_memory(largest, queries[:20]) / 1e6:.2f} MB at {largest_budget:,}"
                f"{' tokens' if args.tokens else ''}"
            )


def peak_memory(rse: Any, queries: list[Any]) -> int:
    """The most memory one call of ``rse`` allocated (tracemalloc), over ``queries``."""
    peaks = []
    for hits in queries:
        tracemalloc.start()
        rse._to_nodes(rse.extract(hits))
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    return max(peaks)


if __name__ == "__main__":
    sys.exit(main())
