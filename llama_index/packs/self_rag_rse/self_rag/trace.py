"""The human-readable trace of a query (``verbose=True``): per-paragraph and per-depth tables,
printed from the query's :class:`~.record.QueryRecord`.
"""

from __future__ import annotations

from llama_index.packs.self_rag_rse.common.notes import print_escaped
from llama_index.packs.self_rag_rse.self_rag.record import Depth, Paragraph, QueryRecord


def print_table(record: QueryRecord) -> None:
    """Print the per-paragraph scores (or, in long form, the paths of each depth), then every
    step of the trace.
    """
    probability = record.retrieve_probability
    shown = f" p={probability:.3f}" if probability is not None else ""
    print_escaped(f"Self-RAG [{record.critic}] retrieve={record.retrieved}{shown}")
    if record.long_form:
        for step in record.steps(Depth):
            _print_depth(step)
    if record.paragraphs:
        print_escaped(
            f"  {'#':>2} {'node':<10} {'rel':>5} {'sup':>5} {'use':>5} {'seq':>5} "
            f"{'score':>6}  answer"
        )
    for i, paragraph in enumerate(record.paragraphs):
        _print_paragraph(paragraph, number=i, best=record.best == i)
    for entry in record.trace:
        print_escaped("  trace:", entry.as_dict())


def _print_paragraph(paragraph: Paragraph, number: int, best: bool) -> None:
    """A paragraph's row: its number (the chosen one starred), node, scores, then its answer
    (or its error).
    """
    mark = "*" if best else " "
    judgement = paragraph.judgement
    seq = f"{judgement.seq_score:.2f}" if judgement.seq_score is not None else "  -"
    reported = paragraph.reported_score
    score = f"{reported:6.2f}" if reported is not None else f"{'-':>6}"
    answer = (judgement.error or judgement.answer).replace("\n", " ")[:60]
    scores = f"{judgement.relevance:5.2f} {judgement.support:5.2f} {judgement.utility:+5.2f}"
    print_escaped(
        f"{mark}{number:>2} {paragraph.node_id[:10]:<10} {scores} {seq:>5} {score}  {answer}"
    )


def _print_depth(step: Depth) -> None:
    """Long form: one depth's table, a row per candidate path (kept ones starred): its
    passages, its last segment's scores, the path's score and the last segment's text.
    """
    print_escaped(f"  depth {step.depth}:")
    print_escaped(
        f"  {'#':>3} {'path':<24} {'rel':>5} {'sup':>5} {'use':>5} {'seg':>6} {'path':>6}  segment"
    )
    for row in step.candidates:
        mark = "*" if row.kept else " "
        path = ">".join(node_id[:6] for node_id in row.node_ids)[-24:] or "-"
        scores = f"{'-':>5} {'-':>5} {'-':>5} {'-':>6}"
        if row.score is not None:
            scores = f"{row.relevance:5.2f} {row.support:5.2f} {row.utility:+5.2f} {row.score:6.2f}"
        done = " (done)" if row.finished else ""
        text = row.segment.replace("\n", " ")[:50]
        print_escaped(
            f" {mark}{row.rank:>3} {path:<24} {scores} {row.path_score:6.2f}  {text}{done}"
        )
