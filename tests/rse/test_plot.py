"""plot_segments: a PNG of an extraction, drawn without touching the caller's matplotlib state."""

from __future__ import annotations

import sys
from dataclasses import replace

import numpy as np
import pytest

from llama_index.packs.self_rag_rse import (
    RelevantSegmentPostprocessor,
    SegmentExtraction,
    plot_segments,
)
from llama_index.packs.self_rag_rse.rse.types import DocumentRegion, Segment

QUERY = 'The "while" statement: loop while an expression is true, else clause, break, continue'
PNG = b"\x89PNG\r\n\x1a\n"


def test_plot_of_a_real_extraction(indexed, tmp_path):
    from matplotlib.image import imread

    retrieved = indexed.as_retriever(similarity_top_k=10).retrieve(QUERY)
    extraction = RelevantSegmentPostprocessor(index=indexed).extract(retrieved)
    assert extraction.segments
    path = plot_segments(extraction, tmp_path / "rse.png")
    assert path.read_bytes()[:8] == PNG
    assert path.stat().st_size > 5_000
    # The segments are drawn: the same extraction without them gives another picture.
    bare = plot_segments(replace(extraction, segments=[]), tmp_path / "bare.png")
    shaded, unshaded = imread(path), imread(bare)
    assert shaded.shape == unshaded.shape and not np.array_equal(shaded, unshaded)


def test_caller_backend_and_figures_are_left_alone(tmp_path):
    import matplotlib

    before = matplotlib.get_backend()
    matplotlib.use("svg")  # a caller's choice that must survive the call
    try:
        extraction = SegmentExtraction(
            [DocumentRegion("doc", [3, 4, 5], np.array([0.5, -0.1, 0.4]))],
            [Segment("doc", 3, 6, 0.8)],
            [],
        )
        plot_segments(extraction, tmp_path / "one.png")
        plot_segments(None, tmp_path / "raw.png", values=[0.3, -0.2], segments=[(0, 1)])
        assert matplotlib.get_backend() == "svg"
        pyplot = sys.modules.get("matplotlib.pyplot")
        assert pyplot is None or pyplot.get_fignums() == []
        assert (tmp_path / "raw.png").read_bytes()[:8] == PNG
    finally:
        matplotlib.use(before)


def test_missing_matplotlib_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"\[plot\]"):
        plot_segments(None, tmp_path / "x.png", values=[0.1])


def test_values_are_required(tmp_path):
    with pytest.raises(ValueError, match="SegmentExtraction or values"):
        plot_segments(None, tmp_path / "x.png")
