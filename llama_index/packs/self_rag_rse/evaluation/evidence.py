"""Evidence recall and precision: character overlap with a gold passage, no model involved.

The measure of the retrieval-quality benchmark (``benchmarks/bench_rse_quality.py``), per
question: recall = gold characters among the characters the engine returned / gold characters;
precision = gold characters returned / characters returned. Returned spans are merged first, so
overlapping chunks (a splitter's ``chunk_overlap``) count once, as the text does in a prompt.
Pure Python: spans are ``(document, start, end)`` triples with ``end`` exclusive.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

#: ``(document name, start, end)``, end exclusive.
Span = tuple[str, int, int]


def find_span(text: str, fragment: str, near: int | None = None) -> tuple[int, int] | None:
    """Where ``fragment`` occurs in ``text``: ``(start, end)``, or ``None``.

    An exact occurrence wins (the one starting closest to ``near`` when it occurs more than once);
    otherwise runs of whitespace are matched loosely, so a passage re-wrapped or with its
    blank lines collapsed is still found. Empty fragments are never found.
    """
    words = fragment.split()
    if not words:
        return None
    starts = []
    at = text.find(fragment)
    while at != -1:
        starts.append(at)
        if near is None:
            break
        at = text.find(fragment, at + 1)
    if starts:
        best = min(starts, key=lambda s: abs(s - near)) if near is not None else starts[0]
        return best, best + len(fragment)
    pattern = re.compile(r"\s+".join(re.escape(w) for w in words))
    matches = list(pattern.finditer(text))
    if not matches:
        return None
    match = min(matches, key=lambda m: abs(m.start() - near)) if near is not None else matches[0]
    return match.start(), match.end()


def merge_spans(spans: Iterable[Span]) -> list[Span]:
    """The union of ``spans`` as sorted, disjoint spans (touching spans are joined)."""
    merged: list[Span] = []
    for doc, start, end in sorted(s for s in spans if s[2] > s[1]):
        if merged and merged[-1][0] == doc and start <= merged[-1][2]:
            last = merged[-1]
            merged[-1] = (doc, last[1], max(last[2], end))
        else:
            merged.append((doc, start, end))
    return merged


def evidence_scores(
    gold: Span, returned: Sequence[Span], unplaced_chars: int = 0
) -> tuple[float, float | None]:
    """``(recall, precision)`` of the returned text against the gold span.

    ``unplaced_chars`` is returned text that could not be placed in any document (it counts
    against precision, never for recall). Precision is ``None`` when nothing was returned.
    """
    gold_doc, gold_start, gold_end = gold
    if gold_end <= gold_start:
        raise ValueError(f"the gold span {gold} is empty")
    union = merge_spans(returned)
    hit = sum(
        max(0, min(end, gold_end) - max(start, gold_start))
        for doc, start, end in union
        if doc == gold_doc
    )
    total = sum(end - start for _, start, end in union) + max(0, unplaced_chars)
    recall = hit / (gold_end - gold_start)
    return recall, (hit / total if total else None)
