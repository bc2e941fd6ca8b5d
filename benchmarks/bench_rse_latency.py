"""RelevantSegmentPostprocessor latency over Qdrant local mode with a 10k-chunk collection.

Builds a collection of ``--chunks`` chunks over ``--documents`` documents (synthetic text and
random unit vectors, so the figure is the postprocessor's own cost, not an embedder's), retrieves
the top-k for random query vectors and times the postprocessing alone. Three ingestion styles:
``ChunkIndexer(stable_ids=True)`` (gaps read by id), a stamped chunk index alone (gaps read by
one filtered call, which Qdrant local mode answers by scanning every point) and neither (the hit
documents are read back to learn the order).

Run: python benchmarks/bench_rse_latency.py [--chunks 10000 --queries 50]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

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
    store = QdrantVectorStore(client=QdrantClient(location=":memory:"), collection_name="latency")
    for start in range(0, len(nodes), 1000):
        store.add(nodes[start : start + 1000])
    return store, nodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=10_000)
    parser.add_argument("--documents", type=int, default=20)
    parser.add_argument("--queries", type=int, default=50)
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--dim", type=int, default=384)
    args = parser.parse_args()

    from llama_index.core.schema import NodeWithScore
    from llama_index.core.vector_stores.types import VectorStoreQuery

    from llama_index.packs.self_rag_rse import RelevantSegmentPostprocessor

    print(
        f"Qdrant local mode (in memory), {args.chunks:,} chunks in {args.documents} documents, "
        f"top-{args.top_k}, {args.queries} queries"
    )
    print(
        f"{'ingestion':<22}{'p50 ms':>9}{'p90 ms':>9}{'store calls/query':>19}{'segments':>10}"
        f"{'ms when reading':>17}"
    )
    for style in ("stable ids", "chunk_index stamped", "no chunk_index"):
        store, nodes = build(args.chunks, args.documents, args.dim, style)
        rse = RelevantSegmentPostprocessor(vector_store=store)
        rng = np.random.default_rng(1)
        times, calls, segments = [], [], []
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
            t = time.perf_counter()
            extraction = rse.extract(hits)
            rse._to_nodes(extraction)
            times.append(1000 * (time.perf_counter() - t))
            calls.append(extraction.store_calls)
            segments.append(len(extraction.segments))
        label = style
        p90 = float(np.percentile(times, 90))
        reading = [t for t, c in zip(times, calls, strict=True) if c]
        when = f"{statistics.mean(reading):17.1f}" if reading else f"{'-':>17}"
        print(
            f"{label:<22}{statistics.median(times):9.1f}{p90:9.1f}"
            f"{statistics.mean(calls):19.2f}{statistics.mean(segments):10.1f}{when}"
        )


if __name__ == "__main__":
    sys.exit(main())
