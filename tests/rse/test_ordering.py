"""Placing chunks in their document, and finding the holes in a document's order."""

from __future__ import annotations

import random

from llama_index.core.schema import NodeRelationship

from llama_index.packs.self_rag_rse.rse.chunk_sources import ChunkSource
from llama_index.packs.self_rag_rse.rse.ordering import (
    DocumentLayout,
    adjacent,
    document_order,
    lay_out,
    orderable,
    positions_from_links,
    run_breaks,
    with_missing_slots,
)


def drive(plan, source: ChunkSource):
    """Run a request generator against ``source`` (what the postprocessor does)."""
    try:
        request = next(plan)
        while True:
            request = plan.send(source.run(request))
    except StopIteration as done:
        return done.value


def unlinked(nodes):
    nodes = [n.model_copy(deep=True) for n in nodes]
    for node in nodes:
        node.relationships.pop(NodeRelationship.NEXT, None)
        node.relationships.pop(NodeRelationship.PREVIOUS, None)
    return nodes


def test_document_order_by_offsets_or_by_links(split):
    nodes = split(64, 0)[:8]
    shuffled = random.Random(0).sample(nodes, len(nodes))
    assert document_order(shuffled) == nodes
    no_offsets = [n.model_copy(update={"start_char_idx": None}) for n in shuffled]
    assert [n.node_id for n in document_order(no_offsets)] == [n.node_id for n in nodes]
    assert orderable(no_offsets) and not orderable(unlinked(no_offsets))


def test_positions_from_links_join_only_known_neighbours(split):
    nodes = split(64, 0)
    positions = positions_from_links([nodes[2], nodes[3], nodes[7]])
    assert positions[nodes[3].node_id] == positions[nodes[2].node_id] + 1
    assert positions[nodes[7].node_id] >= positions[nodes[3].node_id] + 2
    assert adjacent(nodes[2], nodes[3]) and not adjacent(nodes[3], nodes[7])


def test_missing_slot_for_a_chunk_the_docstore_no_longer_lists(split, docstore_with):
    nodes = split(64, 0)
    store = docstore_with(nodes)
    store.delete_document(nodes[3].node_id)
    ids = store.get_ref_doc_info("execmodel").node_ids
    slots, inserted = with_missing_slots(ids, [nodes[2], nodes[4]])
    assert slots[:5] == [n.node_id for n in nodes[:3]] + [None, nodes[4].node_id]
    assert [p for p, _ in inserted] == [3]
    assert nodes[3].node_id in inserted[0][1]
    # Without the links of the chunks next to it, the hole is invisible here.
    assert with_missing_slots(ids, unlinked([nodes[0]]))[1] == []


def test_run_breaks_on_links_offsets_and_contradicted_texts(split):
    nodes = split(64, 0)
    found, suspect = run_breaks([nodes[2], nodes[4]])
    assert list(found) == [0] and "NEXT" in found[0]
    found, _ = run_breaks(unlinked([nodes[2], nodes[4]]))
    assert "gap" in found[0]
    assert run_breaks(nodes[2:6]) == ({}, [False] * 4)
    shifted = [n.model_copy(deep=True) for n in nodes[2:5]]
    shifted[1].start_char_idx -= 20
    shifted[1].end_char_idx -= 20
    found, suspect = run_breaks(shifted)
    # The texts do not overlap where the offsets say: linked neighbours still join (the
    # splitter made them so), but their offsets are distrusted; unlinked ones break.
    assert suspect[1] and not found
    found, suspect = run_breaks(unlinked(shifted))
    assert suspect[1] and found


def test_layout_regions_stop_at_breaks_and_unreadable_chunks(doc_nodes):
    nodes = doc_nodes("doc", 8)
    layout = DocumentLayout("doc", {n.node_id: i for i, n in enumerate(nodes)}, "chunk_index")
    layout.fetchable = True
    layout.hold([nodes[1], nodes[6]])
    values = {nodes[1].node_id: 0.7, nodes[6].node_id: 0.6}
    (region,) = layout.regions(values, 0.1)
    assert region.positions == list(range(1, 7))
    assert list(region.values) == [0.7, -0.1, -0.1, -0.1, -0.1, 0.6]
    layout.breaks[3] = "test"
    layout.mark_unreadable([5], "test")
    assert [r.positions for r in layout.regions(values, 0.1)] == [[1, 2, 3], [4], [6]]
    assert [(h.left, h.right) for h in layout.holes] == [(4, 6)]


def test_lay_out_from_a_docstore_record(split, docstore_with):
    nodes = split(64, 0)
    store = docstore_with(nodes)
    store.delete_document(nodes[3].node_id)
    source = ChunkSource(docstore=store)
    layouts = drive(
        lay_out({"execmodel": [nodes[2], nodes[4]]}, source, "chunk_index", 100), source
    )
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
    layouts = drive(lay_out(docs, source, "chunk_index", 100), source)
    assert set(layouts) == {"execmodel"} and layouts["execmodel"].renumbered
    assert not layouts["execmodel"].fetchable and source.calls == 0
