"""The human-readable trace of a query (``verbose=True``): per-paragraph and per-depth tables."""

from __future__ import annotations

from typing import Any

from llama_index.packs.self_rag_rse.common.notes import print_escaped


def print_table(meta: dict[str, Any]) -> None:
    """Print the per-paragraph scores (or, in long form, the paths of each depth) and the
    trace, from the response's ``metadata["self_rag"]``.
    """
    prob = meta["retrieve_prob"]
    print_escaped(
        f"Self-RAG [{meta['critic']}] retrieve={meta['retrieve']}"
        + (f" p={prob:.3f}" if prob is not None else "")
    )
    if meta.get("long_form"):
        _print_depths(meta)
    if meta["paragraphs"]:
        print_escaped(
            f"  {'#':>2} {'node':<10} {'rel':>5} {'sup':>5} {'use':>5} {'seq':>5} "
            f"{'score':>6}  answer"
        )
    for i, row in enumerate(meta["paragraphs"]):
        seq = f"{row['seq_score']:.2f}" if row["seq_score"] is not None else "  -"
        score = f"{row['score']:6.2f}" if row["score"] is not None else f"{'-':>6}"
        mark = "*" if meta["best"] == i else " "
        answer = (row.get("error") or row["answer"]).replace("\n", " ")[:60]
        print_escaped(
            f"{mark}{i:>2} {row['node_id'][:10]:<10} {row['relevance']:5.2f} "
            f"{row['support']:5.2f} {row['utility']:+5.2f} {seq:>5} {score}  {answer}"
        )
    for entry in meta["trace"]:
        print_escaped("  trace:", entry)


def _print_depths(meta: dict[str, Any]) -> None:
    """Long form: one table per depth, every candidate path (kept ones starred)."""
    for entry in meta["trace"]:
        if entry.get("step") != "depth":
            continue
        print_escaped(f"  depth {entry['depth']}:")
        print_escaped(
            f"  {'#':>3} {'path':<24} {'rel':>5} {'sup':>5} {'use':>5} {'seg':>6} "
            f"{'path':>6}  segment"
        )
        for row in entry["candidates"]:
            mark = "*" if row["kept"] else " "
            path = ">".join(n[:6] for n in row["node_ids"])[-24:] or "-"
            scores = (
                f"{row['relevance']:5.2f} {row['support']:5.2f} {row['utility']:+5.2f} "
                f"{row['score']:6.2f}"
                if row["score"] is not None
                else f"{'-':>5} {'-':>5} {'-':>5} {'-':>6}"
            )
            done = " (done)" if row["finished"] else ""
            text = row["segment"].replace("\n", " ")[:50]
            total = f"{row['path_score']:6.2f}"
            print_escaped(f" {mark}{row['rank']:>3} {path:<24} {scores} {total}  {text}{done}")
