"""The evidence on nodes about their order in a document, and the holes it shows."""

from __future__ import annotations

import random

from corpus import unlinked
from llama_index.core.schema import NodeRelationship, RelatedNodeInfo

from llama_index.packs.self_rag_rse.rse.ordering import (
    adjacent,
    by_version,
    document_order,
    orderable,
    positions_from_links,
    run_breaks,
    with_missing_slots,
)


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


def versioned(nodes, version):
    nodes = [n.model_copy(deep=True) for n in nodes]
    for node in nodes:
        node.metadata["chunk_version"] = version
    return nodes


def test_chunks_of_two_versions_are_never_adjacent(split):
    nodes = split(64, 0)
    old, new = versioned(nodes[:6], "v1"), versioned(nodes[:6], "v2")
    new[3].relationships[NodeRelationship.NEXT].node_id = old[4].node_id  # links say neighbours
    old[4].relationships[NodeRelationship.PREVIOUS].node_id = new[3].node_id
    assert adjacent(old[2], old[3]) and not adjacent(new[3], old[4])
    found, _ = run_breaks([new[2], new[3], old[4]])
    assert list(found) == [1] and "different versions" in found[1]
    positions = positions_from_links([new[3], old[4]])
    assert positions[old[4].node_id] == positions[new[3].node_id] + 2
    # Unknown versions (no stamp, no document hash) are no evidence either way; unstamped
    # chunks are of the version their SOURCE relationship's document hash names.
    assert not adjacent(nodes[2], old[3])
    unknown = nodes[2].model_copy(deep=True)
    unknown.relationships[NodeRelationship.SOURCE] = RelatedNodeInfo(node_id="execmodel")
    assert adjacent(unknown, old[3])


def test_by_version_groups_a_documents_nodes_by_the_hits_versions(split):
    nodes = split(64, 0)
    old, new = versioned(nodes[:5], "v1"), versioned(nodes[:4], "v2")
    interleaved = document_order(old + new)  # sorted by offset: both copies at every offset
    assert {n.metadata["chunk_version"] for n in interleaved[:2]} == {"v1", "v2"}
    grouped = by_version(interleaved, [new[1]])
    assert grouped == new  # only the hits' version, in order
    both = by_version(interleaved, [new[1], old[0]])
    assert both == new + old


def test_missing_first_chunk_leaves_position_zero_empty(split, docstore_with):
    nodes = split(64, 0)
    store = docstore_with(nodes)
    store.delete_document(nodes[0].node_id)
    ids = store.get_ref_doc_info("execmodel").node_ids
    slots, inserted = with_missing_slots(ids, [nodes[1]])
    assert slots[:2] == [None, nodes[1].node_id]  # chunk 1 keeps its true index
    assert [p for p, _ in inserted] == [0] and "PREVIOUS" in inserted[0][1]
