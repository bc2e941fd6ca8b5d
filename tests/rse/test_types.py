"""SegmentExtraction: where a segment lies among the values the search saw."""

from __future__ import annotations

import numpy as np
import pytest

from llama_index.packs.self_rag_rse import SegmentExtraction
from llama_index.packs.self_rag_rse.rse.types import DocumentRegion, Segment


@pytest.fixture
def extraction() -> SegmentExtraction:
    regions = [
        DocumentRegion("a", [4, 5, 6], np.array([0.5, -0.1, 0.4])),
        DocumentRegion("b", [0, 1], np.array([0.9, 0.2])),
        DocumentRegion("a", [9, 10], np.array([0.3, 0.3])),  # the same document past a hole
    ]
    return SegmentExtraction(regions, [], [])


def test_offsets_and_segment_at_are_inverse(extraction):
    assert list(extraction.values) == [0.5, -0.1, 0.4, 0.9, 0.2, 0.3, 0.3]
    assert extraction.document_splits == [3, 5, 7]
    for start, end in [(0, 3), (1, 2), (3, 5), (5, 7), (6, 7)]:
        segment = extraction.segment_at(start, end, 1.0)
        assert extraction.offsets(segment) == (start, end)
    assert extraction.segment_at(5, 7, 0.6) == Segment("a", 9, 11, 0.6)


def test_offsets_of_a_foreign_segment_and_bad_spans(extraction):
    assert extraction.offsets(Segment("a", 7, 8, 0.1)) is None
    assert extraction.offsets(Segment("c", 0, 1, 0.1)) is None
    with pytest.raises(ValueError, match="crosses"):
        extraction.segment_at(2, 4, 0.0)
    with pytest.raises(ValueError, match="beyond"):
        extraction.segment_at(7, 8, 0.0)


def test_describe_and_empty(extraction):
    extraction.note = "why nothing"
    text = extraction.describe()
    assert "3 segment" not in text and "why nothing" in text
    assert "  doc a chunks 4-6: +0.50 -0.10 +0.40" in text.splitlines()
    extraction.segments.append(extraction.segment_at(5, 7, 0.6))
    text = extraction.describe()
    assert "1 segment(s)" in text.splitlines()[0]
    assert "  segment doc a chunks [9, 11) value 0.600" in text.splitlines()
    empty = SegmentExtraction([], [], [])
    assert empty.values.shape == (0,) and empty.document_splits == []
