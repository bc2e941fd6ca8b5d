"""The evidence on nodes about their order in a document, and where it shows a hole.

LlamaIndex nodes carry no chunk index. Order comes from a stamped ``chunk_index``
(:class:`~llama_index.packs.self_rag_rse.ChunkIndexer`), from a store's record of a document's
nodes, from ``start_char_idx``, or from NEXT/PREVIOUS links. None of these is proof that two
chunks placed side by side are neighbours in the text: a chunk deleted from a docstore vanishes
from its record, offsets can be wrong, a re-ingest can leave chunks of an older version of the
document. The functions here read that evidence; :mod:`~.layout` places chunks with it and keeps
*breaks* (positions the segment search must not join across) wherever it disagrees.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

from llama_index.core.schema import BaseNode, NodeRelationship

from llama_index.packs.self_rag_rse.rse.chunk_index import CHUNK_VERSION_KEY
from llama_index.packs.self_rag_rse.rse.node_fields import (
    char_span,
    link,
    node_version,
    offsets_checked,
)
from llama_index.packs.self_rag_rse.rse.stitching import find_breaks, suspect_offsets


def group_by_document(nodes: Sequence[BaseNode]) -> dict[str, list[BaseNode]]:
    """Nodes grouped by source document (``ref_doc_id``), duplicates and orphans dropped."""
    groups: dict[str, list[BaseNode]] = {}
    for node in {node.node_id: node for node in nodes}.values():  # repeated ids: the last wins
        if node.ref_doc_id is not None:
            groups.setdefault(node.ref_doc_id, []).append(node)
    return groups


def document_order(members: Sequence[BaseNode]) -> list[BaseNode]:
    """Order one document's nodes: by ``start_char_idx`` when all have one, else by NEXT chains.

    Nodes no chain reaches from another member start their own chain, in the order given.
    """
    starts = {n.node_id: char_span(n)[0] for n in members}
    if all(start is not None for start in starts.values()):
        return sorted(members, key=lambda n: starts[n.node_id] or 0)
    by_id = {n.node_id: n for n in members}
    previous = {n.node_id for n in members if link(n, NodeRelationship.PREVIOUS) in by_id}
    heads = [n for n in members if n.node_id not in previous]
    ordered: list[BaseNode] = []
    placed: set[str] = set()
    for head in heads:
        node: BaseNode | None = head
        while node is not None and node.node_id not in placed:
            ordered.append(node)
            placed.add(node.node_id)
            nxt = link(node, NodeRelationship.NEXT)
            node = by_id.get(nxt) if nxt else None
    return ordered


def orderable(members: Sequence[BaseNode]) -> bool:
    """Whether anything on the nodes themselves says where they sit in their document."""
    return all(char_span(n)[0] is not None for n in members) or any(
        link(n, r) is not None
        for n in members
        for r in (NodeRelationship.NEXT, NodeRelationship.PREVIOUS)
    )


def by_version(ordered: Sequence[BaseNode], hits: Sequence[BaseNode]) -> list[BaseNode]:
    """A document's nodes (in order) regrouped by version: the hits' versions in their order,
    each version's nodes together; nodes of versions no hit has are left out.

    Sorting two versions by offset interleaves them (both have a chunk at every offset); no
    segment may mix versions, and the chunks between two hits are of the hits' version.
    """
    if len({node_version(n, CHUNK_VERSION_KEY) for n in ordered}) <= 1:  # one version
        return list(ordered)
    wanted = list(dict.fromkeys(node_version(h, CHUNK_VERSION_KEY) for h in hits))
    grouped: dict[str | None, list[BaseNode]] = {v: [] for v in wanted}
    for node in ordered:
        version = node_version(node, CHUNK_VERSION_KEY)
        if version in grouped:
            grouped[version].append(node)
    return [node for version in wanted for node in grouped[version]]


def adjacent(left: BaseNode, right: BaseNode) -> bool:
    """Whether ``right`` is known to follow ``left`` directly (a link, or touching offsets),
    and both come from the same version of their document.
    """
    if version_conflict(left, right) is not None:
        return False
    if linked(left, right):
        return True
    # Overlapping or touching character spans: the splitter put these chunks side by side.
    left_start, left_end = char_span(left)
    right_start, _ = char_span(right)
    if left_start is None or left_end is None or right_start is None:
        return False
    return bool(left_start <= right_start <= left_end)


def positions_from_links(members: Sequence[BaseNode]) -> dict[str, int]:
    """Positions for a document no store can describe: adjacent only where known adjacent.

    Nodes linked by NEXT/PREVIOUS (or with touching offsets) get consecutive positions;
    unrelated runs are placed two apart, so a position with no chunk lies between them and the
    search cannot join them. The numbers are not chunk indices.
    """
    ordered = document_order(members)
    positions: dict[str, int] = {}
    position = 0
    for i, node in enumerate(ordered):
        if i and not adjacent(ordered[i - 1], node):
            position += 1
        positions[node.node_id] = position
        position += 1
    return positions


def linked(left: BaseNode, right: BaseNode) -> bool:
    """Whether ``left`` and ``right`` link to each other as neighbours (NEXT or PREVIOUS).

    Splitters link consecutive chunks of a document, so linked chunks had nothing between them
    but the whitespace the splitter stripped.
    """
    return (
        link(left, NodeRelationship.NEXT) == right.node_id
        or link(right, NodeRelationship.PREVIOUS) == left.node_id
    )


def link_conflict(left: BaseNode, right: BaseNode) -> str | None:
    """Why links forbid joining ``left`` and ``right`` (one names another node), or ``None``.

    The store's order put them side by side, so the reason names a cause of a wrong order: a
    docstore lists a chunk deleted and inserted again (``delete_nodes``, ``insert_nodes``)
    last, wherever it stands in the text.
    """
    after = link(left, NodeRelationship.NEXT)
    if after is not None and after != right.node_id:
        return (
            f"{left.node_id} links NEXT to {after}, not to {right.node_id}, which the store's "
            "order puts after it (e.g. a docstore lists a chunk deleted and inserted again last)"
        )
    before = link(right, NodeRelationship.PREVIOUS)
    if before is not None and before != left.node_id:
        return (
            f"{right.node_id} links PREVIOUS to {before}, not to {left.node_id}, which the "
            "store's order puts before it (e.g. a docstore lists a chunk deleted and inserted "
            "again last)"
        )
    return None


def version_conflict(left: BaseNode, right: BaseNode) -> str | None:
    """Why ``left`` and ``right`` are of different versions of their document, or ``None``
    (also when either version is unknown).
    """
    left_version = node_version(left, CHUNK_VERSION_KEY)
    right_version = node_version(right, CHUNK_VERSION_KEY)
    if left_version is None or right_version is None or left_version == right_version:
        return None
    return (
        f"{left.node_id} and {right.node_id} come from different versions of the document "
        f"({left_version[:12]} and {right_version[:12]}): a re-ingest left chunks of an older "
        "version in the store"
    )


def join_conflict(left: BaseNode, right: BaseNode) -> str | None:
    """Why ``left`` and ``right`` must not be joined whatever their texts say, or ``None``:
    different versions of the document, a link that names another node, or a start offset that
    runs backwards (chunks of two chunkings: an unchanged document re-ingested with another
    splitter keeps its version and its first chunks' stable ids, not the rest).
    """
    if (conflict := version_conflict(left, right) or link_conflict(left, right)) is not None:
        return conflict
    left_start, _ = char_span(left)
    right_start, _ = char_span(right)
    if left_start is None or right_start is None or right_start > left_start:
        return None
    return (
        f"{right.node_id} starts at character {right_start}, not after {left.node_id} "
        f"({left_start})"
    )


def run_breaks(nodes: Sequence[BaseNode]) -> tuple[dict[int, str], list[bool]]:
    """Where consecutive ``nodes`` (placed side by side) must not be joined, and whose offsets
    the texts contradict.

    Returns ``{i: reason}`` for each boundary between ``nodes[i]`` and ``nodes[i + 1]`` that
    breaks: chunks of two versions of the document, a NEXT/PREVIOUS link naming another node,
    or offsets the stitch cannot trust and texts that do not overlap (see
    :func:`~llama_index.packs.self_rag_rse.rse.stitching.find_breaks`); and one flag per node
    saying whether its offsets were contradicted.
    """
    texts = [n.get_content() for n in nodes]
    spans = [char_span(n) for n in nodes]
    checked = [offsets_checked(n) for n in nodes]
    suspect = suspect_offsets(texts, spans, checked)
    found: dict[int, str] = {}
    start = 0
    for i in range(1, len(nodes) + 1):
        conflict = join_conflict(nodes[i - 1], nodes[i]) if i < len(nodes) else None
        if conflict is None and i < len(nodes):
            continue
        # Stitch the stretch the links allow; the suspects come from the whole window.
        piece = slice(start, i)
        links = [False] + [linked(a, b) for a, b in itertools.pairwise(nodes[piece])]
        found_breaks = find_breaks(
            texts[piece],
            spans[piece],
            links,
            distrust=suspect[piece],
            checked=checked[piece],
        )
        for found_break in found_breaks:
            found[start + found_break.index - 1] = found_break.reason
        if conflict is not None:
            found[i - 1] = conflict
        start = i
    return found, suspect


def listed_in_order(ids: Sequence[str], hits: Iterable[BaseNode]) -> bool:
    """Whether a store's list of a document's node ids agrees with what the ``hits`` say of
    their order: each hit's NEXT/PREVIOUS neighbour, where listed, right after/before it, and
    the hits listed in the order of their offsets.

    A docstore lists a document's nodes in the order they were added: one deleted and inserted
    again (``delete_nodes`` + ``insert_nodes``) comes last, wherever it stands in the text.
    """
    where = {node_id: i for i, node_id in enumerate(ids)}
    listed = sorted([hit for hit in hits if hit.node_id in where], key=lambda h: where[h.node_id])
    starts = [start for start in (char_span(hit)[0] for hit in listed) if start is not None]
    for hit in listed:
        i = where[hit.node_id]
        after = where.get(link(hit, NodeRelationship.NEXT) or "", i + 1)
        before = where.get(link(hit, NodeRelationship.PREVIOUS) or "", i - 1)
        if (after, before) != (i + 1, i - 1):
            return False
    return starts == sorted(starts)


def with_missing_slots(
    ids: Sequence[str], at_hand: Iterable[BaseNode]
) -> tuple[list[str | None], list[tuple[int, str]]]:
    """A store's ordered node ids with an empty slot (``None``) wherever a chunk is missing.

    A node at hand whose NEXT (PREVIOUS) link names an id the list does not hold had a
    neighbour that was deleted from the store: an empty slot goes after (before) it, so
    positions after the hole keep their true chunk index and the search cannot join across it.
    That holds for the first listed node too: the list then lacks the document's first chunk(s),
    and position 0 is empty rather than given to a chunk that is not the first. Returns the
    slots and ``(slot, reason)`` for each slot inserted.
    """
    where = {node_id: i for i, node_id in enumerate(ids)}
    cuts: dict[int, str] = {}  # list index b: a chunk is missing between ids[b - 1] and ids[b]
    for node in at_hand:
        i = where.get(node.node_id)
        if i is None:
            continue
        after = link(node, NodeRelationship.NEXT)
        if after is not None and after not in where:
            cuts.setdefault(i + 1, f"{node.node_id} links NEXT to {after}, which the store lacks")
        before = link(node, NodeRelationship.PREVIOUS)
        if before is not None and before not in where:
            cuts.setdefault(i, f"{node.node_id} links PREVIOUS to {before}, which the store lacks")
    slots: list[str | None] = []
    inserted: list[tuple[int, str]] = []
    for i, node_id in enumerate(ids):
        if i in cuts:
            inserted.append((len(slots), cuts[i]))
            slots.append(None)
        slots.append(node_id)
    return slots, inserted
