"""Where each chunk sits in its document, as the segment search sees it, and which to read.

:func:`lay_out` places every retrieved chunk in its document from the cheapest evidence there is
(stamped chunk indices, a store's record, the document's nodes read back, links between hits);
a :class:`DocumentLayout` keeps, per document, the chunk at each position, the *breaks* the
search must not join across and the *holes* found on the way. :func:`read_missing` and
:func:`place_read` fetch the chunks inside chosen segments that retrieval did not return. All
work is bounded by the chunks at hand and the segment length, never by index values.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from llama_index.core.schema import BaseNode

from llama_index.packs.self_rag_rse.rse.chunk_index import (
    CHUNK_INDEX_KEY,
    CHUNK_VERSION_KEY,
    stable_chunk_id,
)
from llama_index.packs.self_rag_rse.rse.chunk_sources import ChunkRequest, ChunkSource
from llama_index.packs.self_rag_rse.rse.node_fields import char_span, chunk_index, node_version
from llama_index.packs.self_rag_rse.rse.ordering import (
    by_version,
    document_order,
    group_by_document,
    linked,
    listed_in_order,
    orderable,
    positions_from_links,
    run_breaks,
    version_conflict,
    with_missing_slots,
)
from llama_index.packs.self_rag_rse.rse.types import DocumentRegion, Hole, Segment

logger = logging.getLogger(__name__)


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
    - ``holes``: every break, missing chunk and conflict found, for the extraction's record;
    - ``conflicts``: hits that claim a position a better-ranked hit holds (two copies of one
      chunk); they are not placed, and pass through.
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
    conflicts: list[BaseNode] = field(default_factory=list)

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

    def regions(
        self, values_of: Mapping[str, float], penalty: float, max_length: int
    ) -> list[DocumentRegion]:
        """Runs of positions the search may join, valued: hits by ``values_of`` (node id ->
        value), chunks between them ``-penalty``; a break or an unavailable chunk ends a run.

        Only positions within ``max_length - 1`` of a hit are laid out: a segment holding a hit
        never reaches further, so two hits a million chunks apart cost two short runs, not a
        million positions.
        """
        hit_positions = {p: values_of[n] for n, p in self.positions.items() if n in values_of}
        if not hit_positions:
            return []
        # Chunks before the first hit or after the last are worth -penalty and can never end a
        # segment, so runs span first..last hit only.
        reach = max(0, int(max_length) - 1)
        hits = sorted(hit_positions)
        visit: list[int | None] = []  # None: a stretch no segment with a hit can reach
        for left, right in itertools.pairwise(hits):
            if right - left - 1 <= 2 * reach:
                visit.extend(range(left, right))
            else:
                visit.extend([*range(left, left + reach + 1), None, *range(right - reach, right)])
        visit.append(hits[-1])
        runs: list[list[int]] = []
        run: list[int] = []
        for p in visit:
            here = p is not None and self.available(p)
            if p is not None and here and run and run[-1] == p - 1 and self.joinable(p - 1):
                run.append(p)
                continue
            if run:
                runs.append(run)
            run = [p] if p is not None and here else []
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
        texts contradict (see :func:`~.ordering.run_breaks`); returns how many new breaks were
        found.
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
                self.cut(run[i], reason)
            p = run[-1] + 1
        return len(self.breaks) - before

    def cut(self, position: int, reason: str) -> None:
        """Forbid joining ``position`` and ``position + 1``, and record the hole."""
        if position not in self.breaks:
            self.breaks[position] = reason
            self.holes.append(Hole(self.doc_id, position, position + 1, reason))

    def mark_unreadable(self, positions: Iterable[int], reason: str) -> None:
        """Positions a store did not return: the search must not join across them."""
        for p in sorted(set(positions) - self.unreadable):
            self.unreadable.add(p)
            self.holes.append(Hole(self.doc_id, p - 1, p + 1, reason))

    def choose(self, position: int, claimants: Sequence[BaseNode]) -> BaseNode | str:
        """The chunk read back for ``position``, or why none can be trusted.

        A store holding two chunks at one position (copies from separate ingests, without
        stable ids) answers a read by index with both. Copies with the same text and offsets
        are one chunk; otherwise the one of the version of the nearest chunk at hand wins, then
        the one linked to a neighbour at hand; when neither decides, none is taken (joining
        either could mix the copies).
        """
        distinct: dict[tuple[Any, ...], BaseNode] = {}
        for node in claimants:
            key = (node.get_content(), char_span(node), node_version(node, CHUNK_VERSION_KEY))
            distinct.setdefault(key, node)
        candidates = list(distinct.values())
        if len(candidates) > 1 and self.held:
            nearest = min(self.held, key=lambda q: (abs(q - position), q))
            wanted = node_version(self.held[nearest], CHUNK_VERSION_KEY)
            same = [n for n in candidates if node_version(n, CHUNK_VERSION_KEY) == wanted]
            candidates = same if wanted is not None and same else candidates
        if len(candidates) > 1:
            before = self.held.get(position - 1)
            after = self.held.get(position + 1)
            tied = [
                n
                for n in candidates
                if (before is not None and linked(before, n))
                or (after is not None and linked(n, after))
            ]
            candidates = tied or candidates
        if len(candidates) == 1:
            return candidates[0]
        ids = ", ".join(n.node_id for n in distinct.values())
        return (
            f"the store holds {len(distinct)} different chunks at this position ({ids}): "
            "copies from separate ingests; delete the stale copies, or ingest with "
            "ChunkIndexer(stable_ids=True) so a re-ingest overwrites them"
        )

    def fill(self, segment: Segment) -> None:
        """Give ``segment`` its member chunks, true chunk range and distrusted members."""
        positions = range(segment.start, segment.end)
        segment.members = [self.held[p] for p in positions]
        segment.chunk_range = self._chunk_range(segment)
        segment.distrusted = frozenset(self.held[p].node_id for p in positions if p in self.suspect)

    def _chunk_range(self, segment: Segment) -> tuple[int, int] | None:
        """True chunk indices of ``segment``, or ``None`` when nothing vouches for them.

        Stamped indices vouch; so does a store's record, up to the first hole (past one, the
        number of chunks missing is unknown). Positions inferred from links never do.
        """
        indices = [chunk_index(m, CHUNK_INDEX_KEY) for m in segment.members]
        if all(i is not None for i in indices):
            first = indices[0]
            assert first is not None
            consecutive = indices == list(range(first, first + len(indices)))
            return (first, first + len(indices)) if consecutive else None
        if self.renumbered or any(hole.left < segment.start for hole in self.holes):
            return None
        return segment.start, segment.end


def lay_out(
    docs: Mapping[str, Sequence[BaseNode]], source: ChunkSource, max_document_chunks: int
) -> Generator[ChunkRequest, Any, dict[str, DocumentLayout]]:
    """Place every retrieved node (``docs``: document id -> its hits, best first) in its document.

    A generator that yields the reads it needs (answer each with the store's reply) and
    returns the layouts, asking the stores only what the nodes do not say: stamped chunk
    indices first, then the docstore's record of each document (read back and ordered by offsets,
    or links, where the hits show it out of order), then the vector store's nodes of the
    documents still unplaced, then links between the hits. A document nothing orders is
    absent from the result. A stamped index that is no chunk position (negative, fractional,
    infinite) is a ``ValueError``; two hits stamped with one index are a conflict: the better
    ranked is placed, the other is listed in ``conflicts``.
    """
    layouts: dict[str, DocumentLayout] = {}
    for doc_id, members in docs.items():
        indices = {n.node_id: chunk_index(n, CHUNK_INDEX_KEY, strict=True) for n in members}
        if all(i is not None for i in indices.values()):
            layouts[doc_id] = _stamped(doc_id, members, indices, source)
    if source.supports("ref_doc_ids"):
        # Asked for indexed documents too: the docstore then serves their gap reads by id.
        answer: dict[str, list[str]] = yield ChunkRequest("ref_doc_ids", doc_ids=list(docs))
        shuffled = [d for d, ids in answer.items() if not listed_in_order(ids, docs.get(d, []))]
        if shuffled:
            # Out of document order (nodes deleted and inserted again): read them, order them.
            wanted = [node_id for doc_id in shuffled for node_id in answer[doc_id]]
            read: list[BaseNode] = yield ChunkRequest("node_ids", node_ids=wanted)
            for doc_id, members in group_by_document(read).items():
                answer[doc_id] = [n.node_id for n in document_order(members)]
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
        found: list[BaseNode] = yield ChunkRequest("documents", doc_ids=pending, limit=limit)
        for doc_id, members in group_by_document(found).items():
            if doc_id not in pending or len(members) > max_document_chunks:
                continue
            order = by_version(document_order(members), docs[doc_id])
            ids = [n.node_id for n in order]
            layout = DocumentLayout.from_slots(doc_id, ids, order, "vector_store")
            if all(n.node_id in layout.positions for n in docs[doc_id]):
                layout.hold(order)
                for left, right in itertools.pairwise(sorted(layout.held)):
                    why = version_conflict(layout.held[left], layout.held[right])
                    if why is not None and right == left + 1:
                        layout.cut(left, why)
                layouts[doc_id] = layout
    for doc_id, members in docs.items():
        if doc_id not in layouts and orderable(members):
            layouts[doc_id] = DocumentLayout(doc_id, positions_from_links(members), "links")
        if doc_id in layouts:
            layouts[doc_id].hold(members)  # the retrieved copy wins over a copy read back
    return layouts


def _stamped(
    doc_id: str, members: Sequence[BaseNode], indices: Mapping[str, int | None], source: ChunkSource
) -> DocumentLayout:
    """Layout from stamped chunk indices; a hit claiming a position taken is a conflict."""
    positions: dict[str, int] = {}
    holder: dict[int, BaseNode] = {}
    conflicts: list[tuple[BaseNode, int]] = []
    for node in members:  # best first: the better-ranked claimant keeps the position
        index = indices[node.node_id]
        assert index is not None
        if index in holder:
            conflicts.append((node, index))
        else:
            holder[index] = node
            positions[node.node_id] = index
    stable = all(n == stable_chunk_id(doc_id, i) for n, i in positions.items())
    fetchable = source.supports("chunk_indices") or (stable and source.can_read)
    layout = DocumentLayout(
        doc_id, positions, "chunk_index", fetchable=fetchable, stable_ids=stable
    )
    for node, index in conflicts:
        layout.conflicts.append(node)
        why = (
            f"{node.node_id} and {holder[index].node_id} both claim chunk index {index} (two "
            "copies of one chunk, e.g. a re-ingest without stable ids); the first is passed "
            "through"
        )
        layout.holes.append(Hole(doc_id, index, index, why))
    return layout


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
    missing: Mapping[str, set[int]], layouts: Mapping[str, DocumentLayout], by_index_ok: bool = True
) -> Generator[ChunkRequest, Any, list[BaseNode]]:
    """Read the ``missing`` chunks: by id where a store listed the document or the chunks have
    stable ids, else by index (also for chunks not found under their stable id, when
    ``by_index_ok``: the source can read by index).
    """
    by_id: list[str] = []
    by_index: dict[str, list[int]] = {}
    stable: dict[str, dict[str, int]] = {}  # document -> stable id -> position
    for doc_id, positions in missing.items():
        layout = layouts[doc_id]
        if layout.slots is not None:
            listed = [layout.slots[position] for position in sorted(positions)]
            by_id.extend(node_id for node_id in listed if node_id)  # None: a chunk the list lacks
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
    read: Sequence[BaseNode], missing: Mapping[str, set[int]], layouts: Mapping[str, DocumentLayout]
) -> None:
    """Put chunks read back in their place; what was asked for and not read is a hole, and so
    is a position two different chunks were read for (see :meth:`DocumentLayout.choose`).

    When nothing at all came back (the store failed, which :class:`ChunkSource` logs, or it
    cannot read), the documents stop being fetchable instead, so no read is repeated.
    """
    claims: dict[tuple[str, int], list[BaseNode]] = {}
    for node in read:
        layout = layouts.get(node.ref_doc_id or "") if node is not None else None
        if layout is None or layout.doc_id not in missing:
            continue
        # Where the store listed the document, its list places the node; else its stamped index.
        position = (
            layout.positions.get(node.node_id)
            if layout.slots is not None
            else chunk_index(node, CHUNK_INDEX_KEY)
        )
        if position is not None and position in missing[layout.doc_id]:
            claims.setdefault((layout.doc_id, position), []).append(node)
    for (doc_id, position), claimants in sorted(claims.items(), key=lambda c: c[0][1]):
        layout = layouts[doc_id]
        chosen = layout.choose(position, claimants)
        if isinstance(chosen, str):
            layout.mark_unreadable([position], chosen)
        else:
            layout.positions[chosen.node_id] = position
            layout.held[position] = chosen
    if not read and missing:
        logger.warning(
            "the store returned none of the chunks between the hits of %s: segments join only "
            "the chunks at hand. Does it hold the chunks? An IngestionPipeline's docstore holds "
            "its documents, not their chunks: pass vector_store= or index= instead",
            ", ".join(sorted(missing)),
        )
    for doc_id, positions in missing.items():
        layout = layouts[doc_id]
        if not read:
            layout.fetchable = False
        else:
            lost = positions - layout.held.keys() - layout.unreadable
            layout.mark_unreadable(lost, "the store returned no chunk for this position")
