"""Evidence recall/precision (pure) and placing retrieved nodes in their documents."""

from __future__ import annotations

import pytest
from llama_index.core.schema import NodeWithScore, TextNode

from llama_index.packs.self_rag_rse.evaluation.contexts import retrieved_contexts
from llama_index.packs.self_rag_rse.evaluation.evidence import (
    evidence_scores,
    find_span,
    merge_spans,
)

DOC = "Alpha beta gamma.\n\nDelta epsilon zeta. Eta theta.\nIota kappa."


def test_find_span_exact_nearest_and_whitespace_tolerant():
    assert find_span(DOC, "Delta epsilon") == (19, 32)
    text = "ab ab ab"
    assert find_span(text, "ab", near=5) == (6, 8)
    # Re-wrapped evidence (newline where the file has a space, spaces collapsed) is found.
    start, end = find_span(DOC, "zeta.   Eta\ntheta. Iota")
    assert DOC[start:end] == "zeta. Eta theta.\nIota"
    assert find_span(DOC, "omega") is None
    assert find_span(DOC, "   ") is None


def test_merge_spans_joins_overlaps_per_document():
    spans = [("a", 5, 10), ("a", 0, 6), ("b", 0, 3), ("a", 10, 12), ("a", 20, 20)]
    assert merge_spans(spans) == [("a", 0, 12), ("b", 0, 3)]


def test_evidence_scores_known_values():
    gold = ("a", 10, 20)
    # Half the gold span returned, inside 20 returned characters.
    assert evidence_scores(gold, [("a", 0, 15), ("a", 30, 35)]) == (0.5, 0.25)
    # Overlapping chunks count once.
    assert evidence_scores(gold, [("a", 10, 20), ("a", 12, 18)]) == (1.0, 1.0)
    # The right offsets in the wrong document do not count.
    assert evidence_scores(gold, [("b", 10, 20)]) == (0.0, 0.0)
    # Unplaced text counts against precision only; nothing returned: precision undefined.
    assert evidence_scores(gold, [("a", 10, 20)], unplaced_chars=10) == (1.0, 0.5)
    assert evidence_scores(gold, []) == (0.0, None)
    with pytest.raises(ValueError, match="empty"):
        evidence_scores(("a", 5, 5), [])


def node(text, **kwargs):
    metadata = kwargs.pop("metadata", {"file_name": "doc.txt"})
    return NodeWithScore(node=TextNode(text=text, metadata=metadata, **kwargs), score=1.0)


def test_nodes_are_placed_by_offsets_segment_range_or_search():
    documents = {"doc.txt": DOC, "sub/other.txt": "Nothing here."}
    chunk = node("Delta epsilon zeta.", start_char_idx=19, end_char_idx=38)
    wrong_offsets = node("Iota kappa.", start_char_idx=0, end_char_idx=11)
    segment = node(
        "Alpha beta gamma.\n\nDelta",
        metadata={"segment_document_id": "doc.txt", "segment_char_range": [0, 24]},
    )
    by_path = node("Nothing", metadata={"file_path": "/data/docs/sub/other.txt"})
    stranger = node("Not in any document.", metadata={"file_name": "missing.txt"})
    found = retrieved_contexts([chunk, wrong_offsets, segment, by_path, stranger], documents)
    assert found.texts[0] == "Delta epsilon zeta." and len(found.texts) == 5
    assert found.spans == [
        ("doc.txt", 19, 38),
        ("doc.txt", DOC.index("Iota"), len(DOC)),
        ("doc.txt", 0, 24),
        ("sub/other.txt", 0, 7),
    ]
    assert found.unplaced_chars == len("Not in any document.")
    assert retrieved_contexts([chunk]).spans == []  # no documents: texts only
