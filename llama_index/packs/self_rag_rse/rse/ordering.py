"""Where each chunk sits in its document, and where the order has holes.

LlamaIndex nodes carry no chunk index. Order comes from a stamped ``chunk_index``
(:class:`~llama_index.packs.self_rag_rse.ChunkIndexer`), from a store's record of a document's
nodes, from ``start_char_idx``, or from NEXT/PREVIOUS links. None of these is proof that two
chunks placed side by side are neighbours in the text: a chunk deleted from a docstore vanishes
from its record, offsets can be wrong. So the evidence on the nodes is checked, and a
:class:`DocumentLayout` keeps *breaks* (positions the segment search must not join across) and
*empty positions* (a chunk the record lacks) wherever it disagrees.
"""

from __future__ import annotations

import itertools
from collections.abc import Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from llama_index.core.schema import BaseNode, NodeRelationship

from llama_index.packs.self_rag_rse.rse.chunk_index import stable_chunk_id
from llama_index.packs.self_rag_rse.rse.chunk_sources import ChunkRequest, ChunkSource, nodes_by_id
from llama_index.packs.self_rag_rse.rse.stitching import find_breaks, suspect_offsets
from llama_index.packs.self_rag_rse.rse.types import DocumentRegion, Hole, Segment

__all__ = [
    "DocumentLayout",
    "adjacent",
    "chunk_index",
    "document_order",
    "group_by_document",
    "lay_out",
    "link",
    "link_conflict",
    "linked",
    "missing_positions",
    "orderable",
    "place_read",
    "positions_from_links",
    "read_missing",
    "run_breaks",
    "with_missing_slots",
]


def chunk_index(node: BaseNode, key: str) -> int | None:
    """The chunk index in ``node.metadata[key]``, or ``None`` when absent or not a number."""
    value = node.metadata.get(key)
    if isinstance(value, bool) or value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def link(node: BaseNode, relation: NodeRelationship) -> str | None:
    """Id of the node that ``relation`` (NEXT, PREVIOUS, ...) points at, if any."""
    info = node.relationships.get(relation)
    return getattr(info, "node_id", None)


def group_by_document(nodes: Sequence[BaseNode]) -> dict[str, list[BaseNode]]:
    """Nodes grouped by source document (``ref_doc_id``), duplicates and orphans dropped."""
    groups: dict[str, list[BaseNode]] = {}
    for node in nodes_by_id(nodes).values():
        if node.ref_doc_id is not None:
            groups.setdefault(node.ref_doc_id, []).append(node)
    return groups


def document_order(members: Sequence[BaseNode]) -> list[BaseNode]:
    """Order one document's nodes: by ``start_char_idx`` when all have one, else by NEXT chains.

    Nodes no chain reaches from another member start their own chain, in the order given.
    """
    if all(getattr(n, "start_char_idx", None) is not None for n in members):
        return sorted(members, key=lambda n: int(getattr(n, "start_char_idx", 0)))
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
    return all(getattr(n, "start_char_idx", None) is not None for n in members) or any(
        link(n, r) is not None
        for n in members
        for r in (NodeRelationship.NEXT, NodeRelationship.PREVIOUS)
    )


def adjacent(left: BaseNode, right: BaseNode) -> bool:
    """Whether ``right`` is known to follow ``left`` directly (a link, or touching offsets)."""
    if link(left, NodeRelationship.NEXT) == right.node_id:
        return True
    if link(right, NodeRelationship.PREVIOUS) == left.node_id:
        return True
    # Overlapping or touching character spans: the splitter put these chunks side by side.
    first = getattr(left, "start_char_idx", None)
    end, start = getattr(left, "end_char_idx", None), getattr(right, "start_char_idx", None)
    if first is None or end is None or start is None:
        return False
    return bool(first <= start <= end)


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
    """Why links forbid joining ``left`` and ``right`` (one names another node), or ``None``."""
    after = link(left, NodeRelationship.NEXT)
    if after is not None and after != right.node_id:
        return f"{left.node_id} links NEXT to {after}, not to {right.node_id}"
    before = link(right, NodeRelationship.PREVIOUS)
    if before is not None and before != left.node_id:
        return f"{right.node_id} links PREVIOUS to {before}, not to {left.node_id}"
    return None


def run_breaks(nodes: Sequence[BaseNode]) -> tuple[dict[int, str], list[bool]]:
    """Where consecutive ``nodes`` (placed side by side) must not be joined, and whose offsets
    the texts contradict.

    Returns ``{i: reason}`` for each boundary between ``nodes[i]`` and ``nodes[i + 1]`` that
    breaks: a NEXT/PREVIOUS link naming another node, or offsets the stitch cannot trust and
    texts that do not overlap (see
    :func:`~llama_index.packs.self_rag_rse.rse.stitching.find_breaks`); and one flag per node
    saying whether its offsets were contradicted.
    """
    texts = [n.get_content() for n in nodes]
    spans = [_span(n) for n in nodes]
    suspect = suspect_offsets(texts, spans)
    found: dict[int, str] = {}
    start = 0
    for i in range(1, len(nodes) + 1):
        conflict = link_conflict(nodes[i - 1], nodes[i]) if i < len(nodes) else None
        if conflict is None and i < len(nodes):
            continue
        # Stitch the stretch the links allow; the suspects come from the whole window.
        piece = slice(start, i)
        links = [False] + [linked(a, b) for a, b in itertools.pairwise(nodes[piece])]
        for found_break in find_breaks(texts[piece], spans[piece], links, suspect[piece]):
            found[start + found_break.index - 1] = found_break.reason
        if conflict is not None:
            found[i - 1] = conflict
        start = i
    return found, suspect


def with_missing_slots(
    ids: Sequence[str], at_hand: Iterable[BaseNode]
) -> tuple[list[str | None], list[tuple[int, str]]]:
    """A store's ordered node ids with an empty slot (``None``) wherever a chunk is missing.

    A node at hand whose NEXT (PREVIOUS) link names an id the list does not hold had a
    neighbour that was deleted from the store: an empty slot goes after (before) it, so
    positions after the hole keep their true chunk index and the search cannot join across it.
    Returns the slots and ``(slot, reason)`` for each slot inserted.
    """
    listed = set(ids)
    where = {node_id: i for i, node_id in enumerate(ids)}
    cuts: dict[int, str] = {}  # list index b: a chunk is missing between ids[b - 1] and ids[b]
    for node in at_hand:
        i = where.get(node.node_id)
        if i is None:
            continue
        after = link(node, NodeRelationship.NEXT)
        if after is not None and after not in listed:
            cuts.setdefault(i + 1, f"{node.node_id} links NEXT to {after}, which the store lacks")
        before = link(node, NodeRelationship.PREVIOUS)
        if before is not None and before not in listed and i > 0:
            cuts.setdefault(i, f"{node.node_id} links PREVIOUS to {before}, which the store lacks")
    slots: list[str | None] = []
    inserted: list[tuple[int, str]] = []
    for i, node_id in enumerate(ids):
        if i in cuts:
            inserted.append((len(slots), cuts[i]))
            slots.append(None)
        slots.append(node_id)
    return slots, inserted


@dataclass
class DocumentLayout:
    """One document as the segment search sees it: which chunk is at which position.

    - ``positions``: node id -> position, for every node placed;
    - ``held``: position -> node at hand (retrieved, or read back);
    - ``slots``: node id at each position when a store listed the document (``None`` marks a
      chunk the list lacks); ``None`` when positions come from chunk indices or links;
    - ``order``: where the order came from: ``"chunk_index"``, ``"docstore"``,
      ``"vector_store"`` or ``"links"``;
    - ``fetchable``: whether chunks not at hand can still be read from a store;
    - ``stable_ids``: whether the hits carry :func:`~.chunk_index.stable_chunk_id` ids, so the
      chunks between them can be read by id;
    - ``breaks``: position ``p`` -> why ``p`` and ``p + 1`` must not be joined;
    - ``unreadable``: positions a store was asked for and did not return;
    - ``suspect``: positions whose offsets the texts contradict (ignored when stitching);
    - ``holes``: every break and missing chunk found, for the extraction's record.
    """

    doc_id: str
    positions: dict[str, int]
    order: str
    held: dict[int, BaseNode] = field(default_factory=dict)
    slots: list[str | None] | None = None
    fetchable: bool = False
    stable_ids: bool = False
    breaks: dict[int, str] = field(default_factory=dict)
    unreadable: set[int] = field(default_factory=set)
    suspect: set[int] = field(default_factory=set)
    holes: list[Hole] = field(default_factory=list)

    @classmethod
    def from_slots(
        cls, doc_id: str, ids: Sequence[str], at_hand: Sequence[BaseNode], order: str
    ) -> DocumentLayout:
        """Layout from a store's ordered ids, with empty slots where links show a missing chunk."""
        slots, inserted = with_missing_slots(ids, at_hand)
        positions = {node_id: p for p, node_id in enumerate(slots) if node_id is not None}
        layout = cls(doc_id, positions, order, slots=slots, fetchable=True)
        layout.holes = [Hole(doc_id, p - 1, p + 1, why) for p, why in inserted]
        return layout

    @property
    def renumbered(self) -> bool:
        """Whether positions are only relative (inferred from links), not chunk indices."""
        return self.order == "links"

    def hold(self, nodes: Iterable[BaseNode]) -> None:
        """Keep ``nodes`` (already placed in :attr:`positions`) at hand."""
        for node in nodes:
            position = self.positions.get(node.node_id)
            if position is not None:
                self.held[position] = node

    def available(self, position: int) -> bool:
        """Whether the chunk at ``position`` is at hand or can still be read."""
        if position in self.held:
            return True
        if not self.fetchable or position in self.unreadable:
            return False
        return self.slots is None or (
            0 <= position < len(self.slots) and self.slots[position] is not None
        )

    def joinable(self, position: int) -> bool:
        """Whether positions ``position`` and ``position + 1`` may be in one segment."""
        return position not in self.breaks

    def regions(self, values_of: Mapping[str, float], penalty: float) -> list[DocumentRegion]:
        """Runs of positions the search may join, valued: hits by ``values_of`` (node id ->
        value), chunks between them ``-penalty``; a break or an unavailable chunk ends a run."""
        hit_positions = {p: values_of[n] for n, p in self.positions.items() if n in values_of}
        if not hit_positions:
            return []
        # Chunks before the first hit or after the last are worth -penalty and can never end a
        # segment, so runs span first..last hit only.
        runs: list[list[int]] = []
        run: list[int] = []
        for p in range(min(hit_positions), max(hit_positions) + 1):
            if self.available(p) and (not run or self.joinable(p - 1)):
                run.append(p)
                continue
            if run:
                runs.append(run)
            run = [p] if self.available(p) else []
        if run:
            runs.append(run)
        return [
            DocumentRegion(
                self.doc_id, r, np.array([hit_positions.get(p, -penalty) for p in r], dtype=float)
            )
            for r in runs
        ]

    def check(self, start: int, end: int) -> int:
        """Check the held chunks of ``[start, end)`` and their held neighbours for holes.

        Records a break wherever the evidence forbids a join and marks chunks whose offsets the
        texts contradict (see :func:`run_breaks`); returns how many new breaks were found.
        """
        before = len(self.breaks)
        p = start - 1 if start - 1 in self.held else start
        while p < end:
            if p not in self.held:
                p += 1
                continue
            run = [p]
            while run[-1] + 1 in self.held and run[-1] < end and self.joinable(run[-1]):
                run.append(run[-1] + 1)
            found, suspect = run_breaks([self.held[q] for q in run])
            self.suspect.update(q for q, doubt in zip(run, suspect, strict=True) if doubt)
            for i, reason in found.items():
                if run[i] not in self.breaks:
                    self.breaks[run[i]] = reason
                    self.holes.append(Hole(self.doc_id, run[i], run[i] + 1, reason))
            p = run[-1] + 1
        return len(self.breaks) - before

    def mark_unreadable(self, positions: Iterable[int], reason: str) -> None:
        """Positions a store did not return: the search must not join across them."""
        for p in sorted(set(positions) - self.unreadable):
            self.unreadable.add(p)
            self.holes.append(Hole(self.doc_id, p - 1, p + 1, reason))


def lay_out(
    docs: Mapping[str, Sequence[BaseNode]],
    source: ChunkSource,
    index_key: str,
    max_document_chunks: int,
) -> Generator[ChunkRequest, Any, dict[str, DocumentLayout]]:
    """Place every retrieved node (``docs``: document id -> its hits) in its document.

    A generator that yields the reads it needs (answer each with the store's reply) and
    returns the layouts, asking the stores only what the nodes do not say: stamped chunk
    indices first, then the docstore's record of each document, then the vector store's nodes
    of the documents still unplaced, then links between the hits. A document nothing orders is
    absent from the result.
    """
    layouts: dict[str, DocumentLayout] = {}
    for doc_id, members in docs.items():
        indices = {n.node_id: chunk_index(n, index_key) for n in members}
        if all(i is not None for i in indices.values()):
            positions = {n: i for n, i in indices.items() if i is not None}
            stable = all(n == stable_chunk_id(doc_id, i) for n, i in positions.items())
            fetchable = source.supports("chunk_indices") or (stable and source.can_read)
            layouts[doc_id] = DocumentLayout(
                doc_id, positions, "chunk_index", fetchable=fetchable, stable_ids=stable
            )
    if source.supports("ref_doc_ids"):
        # Asked for indexed documents too: the docstore then serves their gap reads by id.
        answer: dict[str, list[str]] = yield ChunkRequest("ref_doc_ids", doc_ids=list(docs))
        for doc_id, ids in answer.items():
            if doc_id not in docs:
                continue
            listed = DocumentLayout.from_slots(doc_id, ids, docs[doc_id], "docstore")
            known = layouts.get(doc_id)
            if known is None:
                agrees = all(n.node_id in listed.positions for n in docs[doc_id])
            else:  # stamped indices must agree with the record
                agrees = all(listed.positions.get(n) == p for n, p in known.positions.items())
            if agrees:
                layouts[doc_id] = listed
    pending = [d for d in docs if d not in layouts]
    if pending and source.supports("documents"):
        limit = max_document_chunks * len(pending)
        read: list[BaseNode] = yield ChunkRequest("documents", doc_ids=pending, limit=limit)
        for doc_id, members in group_by_document(read).items():
            if doc_id not in pending or len(members) > max_document_chunks:
                continue
            order = document_order(members)
            layout = DocumentLayout.from_slots(
                doc_id, [n.node_id for n in order], order, "vector_store"
            )
            if all(n.node_id in layout.positions for n in docs[doc_id]):
                layout.hold(order)
                layouts[doc_id] = layout
    for doc_id, members in docs.items():
        if doc_id not in layouts and orderable(members):
            layouts[doc_id] = DocumentLayout(doc_id, positions_from_links(members), "links")
        if doc_id in layouts:
            layouts[doc_id].hold(members)  # the retrieved copy wins over a copy read back
    return layouts


def missing_positions(
    segments: Iterable[Segment], layouts: Mapping[str, DocumentLayout]
) -> dict[str, set[int]]:
    """Positions inside ``segments`` whose chunk is not at hand, per document."""
    missing: dict[str, set[int]] = {}
    for s in segments:
        held = layouts[s.doc_id].held
        gaps = {p for p in range(s.start, s.end) if p not in held}
        if gaps:
            missing.setdefault(s.doc_id, set()).update(gaps)
    return missing


def read_missing(
    missing: Mapping[str, set[int]],
    layouts: Mapping[str, DocumentLayout],
    by_index_ok: bool = True,
) -> Generator[ChunkRequest, Any, list[BaseNode]]:
    """Read the ``missing`` chunks: by id where a store listed the document or the chunks have
    stable ids, else by index (also for chunks not found under their stable id, when
    ``by_index_ok``: the source can read by index)."""
    by_id: list[str] = []
    by_index: dict[str, list[int]] = {}
    stable: dict[str, dict[str, int]] = {}  # document -> stable id -> position
    for doc_id, positions in missing.items():
        layout = layouts[doc_id]
        if layout.slots is not None:
            by_id.extend(node_id for p in sorted(positions) if (node_id := layout.slots[p]))
        elif layout.stable_ids:
            stable[doc_id] = {stable_chunk_id(doc_id, p): p for p in sorted(positions)}
            by_id.extend(stable[doc_id])
        else:
            by_index[doc_id] = sorted(positions)
    read: list[BaseNode] = []
    if by_id:
        read.extend((yield ChunkRequest("node_ids", node_ids=by_id)))
    found = {node.node_id for node in read if node is not None}
    for doc_id, ids in stable.items():
        # A chunk ingested without a stable id (another pipeline) is still found by its index.
        rest = [p for node_id, p in ids.items() if node_id not in found]
        if rest and by_index_ok:
            by_index[doc_id] = rest
    if by_index:
        read.extend((yield ChunkRequest("chunk_indices", indices=by_index)))
    return read


def place_read(
    read: Sequence[BaseNode],
    missing: Mapping[str, set[int]],
    layouts: Mapping[str, DocumentLayout],
    index_key: str,
) -> None:
    """Put chunks read back in their place; what was asked for and not read is a hole.

    When nothing at all came back (the store failed, which :class:`ChunkSource` logs, or it
    cannot read), the documents stop being fetchable instead, so no read is repeated.
    """
    for node in read:
        layout = layouts.get(node.ref_doc_id or "") if node is not None else None
        if layout is None or layout.doc_id not in missing:
            continue
        if layout.slots is not None:
            position = layout.positions.get(node.node_id)
        else:
            position = chunk_index(node, index_key)
        if position is not None and position in missing[layout.doc_id]:
            layout.positions[node.node_id] = position
            layout.held[position] = node
    for doc_id, positions in missing.items():
        layout = layouts[doc_id]
        if not read:
            layout.fetchable = False
        else:
            lost = positions - layout.held.keys()
            layout.mark_unreadable(lost, "the store returned no chunk for this position")


def _span(node: BaseNode) -> tuple[int | None, int | None]:
    return getattr(node, "start_char_idx", None), getattr(node, "end_char_idx", None)
