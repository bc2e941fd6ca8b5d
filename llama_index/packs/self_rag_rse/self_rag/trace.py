"""What the engine reports about a query: per-paragraph rows and the human-readable table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llama_index.core.schema import NodeWithScore

from llama_index.packs.self_rag_rse.self_rag.contract import ParagraphJudgement


@dataclass
class Candidate:
    """One judged paragraph: its node, the critic's judgement and the final score."""

    node: NodeWithScore
    judgement: ParagraphJudgement
    score: float


def paragraph_meta(c: Candidate) -> dict[str, Any]:
    """The row of ``metadata["self_rag"]["paragraphs"]`` for one candidate."""
    j = c.judgement
    row: dict[str, Any] = {
        "node_id": c.node.node.node_id,
        "answer": j.answer,
        "relevance": j.relevance,
        "support": j.support,
        "utility": j.utility,
        "seq_score": j.seq_score,
        "score": c.score if j.error is None else None,
    }
    if j.error is not None:
        row["error"] = j.error
    if j.details:
        row["details"] = j.details
    return row


def print_table(candidates: list[Candidate], meta: dict[str, Any]) -> None:
    """Print the per-paragraph scores and the trace (``verbose=True``)."""
    prob = meta["retrieve_prob"]
    print(
        f"Self-RAG [{meta['critic']}] retrieve={meta['retrieve']}"
        + (f" p={prob:.3f}" if prob is not None else "")
    )
    if meta.get("long_form"):
        _print_depths(meta)
    if candidates:
        print(
            f"  {'#':>2} {'node':<10} {'rel':>5} {'sup':>5} {'use':>5} {'seq':>5} "
            f"{'score':>6}  answer"
        )
    for i, c in enumerate(candidates):
        j = c.judgement
        seq = f"{j.seq_score:.2f}" if j.seq_score is not None else "  -"
        mark = "*" if meta["best"] == i else " "
        answer = (j.error or j.answer).replace("\n", " ")[:60]
        print(
            f"{mark}{i:>2} {c.node.node.node_id[:10]:<10} {j.relevance:5.2f} {j.support:5.2f} "
            f"{j.utility:+5.2f} {seq:>5} {c.score:6.2f}  {answer}"
        )
    for entry in meta["trace"]:
        print("  trace:", entry)


def _print_depths(meta: dict[str, Any]) -> None:
    """Long form: one table per depth, every candidate path (kept ones starred)."""
    for entry in meta["trace"]:
        if entry.get("step") != "depth":
            continue
        print(f"  depth {entry['depth']}:")
        print(
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
            print(f" {mark}{row['rank']:>3} {path:<24} {scores} {total}  {text}{done}")
