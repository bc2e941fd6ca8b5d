"""Placing chunks in their document: positions, breaks, conflicts, bounded regions, reads."""

from __future__ import annotations

import numpy as np
from corpus import unlinked
from hypothesis import given, settings
from hypothesis import strategies as st

from llama_index.packs.self_rag_rse import SegmentExtraction, find_best_segments
from llama_index.packs.self_rag_rse.common.bridge import drive
from llama_index.packs.self_rag_rse.rse.chunk_sources import ChunkSource
from llama_index.packs.self_rag_rse.rse.layout import DocumentLayout, lay_out
from llama_index.packs.self_rag_rse.rse.types import DocumentRegion


def test_layout_regions_stop_at_breaks_and_unreadable_chunks(doc_nodes):
    nodes = doc_nodes("doc", 8)
    layout = DocumentLayout("doc", {n.node_id: i for i, n in enumerate(nodes)}, "chunk_index")
    layout.fetchable = True
    layout.hold([nodes[1], nodes[6]])
    values = {nodes[1].node_id: 0.7, nodes[6].node_id: 0.6}
    (region,) = layout.regions(values, 0.1, 15)
    assert region.positions == list(range(1, 7))
    assert list(region.values) == [0.7, -0.1, -0.1, -0.1, -0.1, 0.6]
    layout.breaks[3] = "test"
    layout.mark_unreadable([5], "test")
    assert [r.positions for r in layout.regions(values, 0.1, 15)] == [[1, 2, 3], [4], [6]]
    assert [(h.left, h.right) for h in layout.holes] == [(4, 6)]


def test_lay_out_from_a_docstore_record(split, docstore_with):
    nodes = split(64, 0)
    store = docstore_with(nodes)
    store.delete_document(nodes[3].node_id)
    source = ChunkSource(docstore=store)
    layouts = drive(lay_out({"execmodel": [nodes[2], nodes[4]]}, source, 100), source.run)
    layout = layouts["execmodel"]
    assert layout.order == "docstore" and layout.fetchable
    assert layout.positions[nodes[2].node_id] == 2
    assert layout.positions[nodes[4].node_id] == 4  # its true index, past the empty slot
    assert not layout.available(3) and layout.available(1)
    assert source.calls == 1


def test_lay_out_without_store_uses_links_and_skips_the_unorderable(split):
    nodes = split(64, 0)
    bare = unlinked([nodes[5]])[0].model_copy(update={"start_char_idx": None})
    bare.id_ = "bare"
    source = ChunkSource()
    docs = {"execmodel": [nodes[2], nodes[3]], "other": [bare]}
    layouts = drive(lay_out(docs, source, 100), source.run)
    assert set(layouts) == {"execmodel"} and layouts["execmodel"].renumbered
    assert not layouts["execmodel"].fetchable and source.calls == 0


def _every_position(layout, values, penalty):
    """The regions as laid out before they were bounded: every position from hit to hit."""
    hits = {p: values[n] for n, p in layout.positions.items() if n in values}
    runs, run = [], []
    for p in range(min(hits), max(hits) + 1):
        if layout.available(p) and (not run or layout.joinable(p - 1)):
            run.append(p)
            continue
        if run:
            runs.append(run)
        run = [p] if layout.available(p) else []
    if run:
        runs.append(run)
    return runs, hits


def _segments(runs, hits, penalty, max_length):
    regions = [
        DocumentRegion("doc", r, np.array([hits.get(p, -penalty) for p in r], dtype=float))
        for r in runs
    ]
    laid = SegmentExtraction(regions, [], [])
    spans, scores = find_best_segments(
        laid.values[None, :], laid.document_splits, max_length, 10 * max_length, 0.1
    )
    found = [laid.segment_at(a, b, v) for (a, b), v in zip(spans, scores, strict=True)]
    return sorted((s.start, s.end, round(s.value, 9)) for s in found)


@settings(max_examples=150, deadline=None)
@given(
    positions=st.lists(st.integers(0, 120), min_size=1, max_size=12, unique=True),
    scores=st.lists(st.floats(0.0, 1.0), min_size=12, max_size=12),
    max_length=st.integers(1, 12),
    penalty=st.sampled_from([0.05, 0.18, 0.5]),
    breaks=st.lists(st.integers(0, 120), max_size=4),
)
def test_bounded_regions_find_the_segments_every_position_finds(
    positions, scores, max_length, penalty, breaks
):
    layout = DocumentLayout("doc", {f"n{p}": p for p in positions}, "chunk_index")
    layout.fetchable = True
    for b in breaks:
        layout.breaks[b] = "test"
    values = {f"n{p}": s for p, s in zip(positions, scores, strict=False)}
    bounded = layout.regions(values, penalty, max_length)
    runs, hits = _every_position(layout, values, penalty)
    expected = _segments(runs, hits, penalty, max_length)
    assert _segments([r.positions for r in bounded], hits, penalty, max_length) == expected
    assert sum(len(r.positions) for r in bounded) <= len(hits) * (2 * max_length - 1)


def test_hits_far_apart_cost_positions_near_the_hits_only():
    layout = DocumentLayout("doc", {"a": 3, "b": 10**12, "c": 10**12 + 2}, "chunk_index")
    layout.fetchable = True
    regions = layout.regions({"a": 0.9, "b": 0.8, "c": 0.7}, 0.18, 15)
    assert [r.positions[0] for r in regions] == [3, 10**12 - 14]
    assert [len(r.positions) for r in regions] == [15, 17]


def test_two_hits_with_one_index_the_better_ranked_is_placed(doc_nodes):
    nodes = doc_nodes("doc", 4)
    stale = nodes[2].model_copy(deep=True)
    stale.id_ = "stale-2"
    source = ChunkSource()
    docs = {"doc": [nodes[2], stale, nodes[3]]}  # best first
    layout = drive(lay_out(docs, source, 100), source.run)["doc"]
    assert layout.held[2] is nodes[2] and layout.conflicts == [stale]
    (hole,) = layout.holes
    assert (hole.left, hole.right) == (2, 2) and "both claim chunk index 2" in hole.reason
