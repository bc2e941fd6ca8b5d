"""What one segment extraction computed: the regions searched, the segments chosen, the holes.

Plain dataclasses over numpy, so the search, the plot and tests can read a result without
LlamaIndex. A *position* is a chunk's place in its document as the postprocessor laid it out (the
stamped chunk index, or the index in a store's ordered list of the document's nodes); the search
itself sees the regions' values laid end to end, and :meth:`SegmentExtraction.offsets` /
:meth:`SegmentExtraction.segment_at` translate between the two.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # annotations only: this module must import without LlamaIndex
    from llama_index.core.schema import BaseNode, NodeWithScore


@dataclass
class DocumentRegion:
    """A run of consecutive chunk positions of one document that the search may join.

    ``values[i]`` is the chunk value at ``positions[i]``; positions are consecutive integers.
    """

    doc_id: str
    positions: list[int]
    values: np.ndarray


@dataclass
class Segment:
    """One extracted segment: document, chunk positions ``[start, end)``, value and members.

    ``chunk_range`` is the segment's true chunk indices ``[first, last + 1)`` when something
    vouches for them (stamped chunk indices, or a store's ordered record of the document), and
    ``None`` when positions were only inferred from links between retrieved chunks.
    ``distrusted`` holds the ids of members whose character offsets the texts contradict
    (stitching ignores them and reports no character range for the text around them).
    ``nodes`` are the node(s) handed on for it, built once (see :mod:`~.segment_nodes`).
    """

    doc_id: str
    start: int
    end: int
    value: float
    members: list[BaseNode] = field(default_factory=list)
    chunk_range: tuple[int, int] | None = None
    distrusted: frozenset[str] = frozenset()
    nodes: list[BaseNode] = field(default_factory=list, repr=False, compare=False)

    def touches(self, other: Segment) -> bool:
        """Whether ``other`` starts inside this segment or next to it (in the same document)."""
        return self.doc_id == other.doc_id and self.start - 1 <= other.start <= self.end


@dataclass(frozen=True)
class Hole:
    """A break in a document's order: positions ``left`` and ``right`` must not be joined.

    Found from evidence on the nodes (a NEXT/PREVIOUS link naming a chunk the store does not
    list, character offsets further apart than a splitter strips, offsets the texts contradict,
    chunks of two versions of the document, or a chunk no store could return). ``right - left``
    is 2 when an empty position was inserted for a missing chunk, 1 otherwise, and 0 for a
    conflict: two hits claiming position ``left`` (the second passes through unplaced).
    """

    doc_id: str
    left: int
    right: int
    reason: str


@dataclass
class SegmentExtraction:
    """Everything one call computed: the regions searched (values laid end to end, as the
    segment search saw them), the segments chosen, the nodes that could not be placed in any
    document, the holes that kept chunks apart, how many store reads it took, a ``note`` saying
    why nothing was returned when nodes came in but no segment did, and (under a context
    budget) the unplaced nodes ``left_out`` because they did not fit.
    :func:`~llama_index.packs.self_rag_rse.plot_segments` draws it.
    """

    regions: list[DocumentRegion]
    segments: list[Segment]
    passthrough: list[NodeWithScore]
    store_calls: int = 0
    holes: list[Hole] = field(default_factory=list)
    note: str | None = None
    left_out: list[NodeWithScore] = field(default_factory=list)

    @property
    def values(self) -> np.ndarray:
        """Chunk values of all regions laid end to end."""
        if not self.regions:
            return np.zeros(0)
        return np.concatenate([r.values for r in self.regions])

    @property
    def document_splits(self) -> list[int]:
        """End offset of each region in :attr:`values`."""
        return [int(x) for x in np.cumsum([len(r.values) for r in self.regions])]

    def offsets(self, segment: Segment) -> tuple[int, int] | None:
        """Where ``segment`` lies in :attr:`values`: ``(start, end)``, end exclusive.

        ``None`` when no region of its document contains its first position (a segment built
        by hand, or from another extraction).
        """
        start = 0
        for region in self.regions:
            first = region.positions[0] if region.positions else 0
            if region.doc_id == segment.doc_id and 0 <= segment.start - first < len(region.values):
                begin = start + segment.start - first
                return begin, begin + segment.end - segment.start
            start += len(region.values)
        return None

    def segment_at(self, start: int, end: int, value: float) -> Segment:
        """The segment covering ``values[start:end]`` (the inverse of :meth:`offsets`).

        ``start`` and ``end`` must lie in one region, as the segment search guarantees.
        """
        offset = 0
        for region in self.regions:
            if start < offset + len(region.values):
                if end > offset + len(region.values):
                    raise ValueError(
                        f"values[{start}:{end}] crosses the end of region {region.doc_id!r} at "
                        f"{offset + len(region.values)}: pass document_splits to the search"
                    )
                first = region.positions[start - offset]
                return Segment(region.doc_id, first, first + (end - start), float(value))
            offset += len(region.values)
        raise ValueError(
            f"values[{start}:{end}] lies beyond the {offset} values of the regions: pass a span "
            "the search returned for these regions"
        )

    def describe(self) -> str:
        """A readable trace: each region's values, the segments, the holes, the note."""
        documents = len({r.doc_id for r in self.regions})
        lines = [
            f"RSE: {len(self.values)} chunk positions searched in {documents} document(s), "
            f"{len(self.segments)} segment(s)"
        ]
        for region in self.regions:
            shown = " ".join(f"{v:+.2f}" for v in region.values[:40])
            more = " ..." if len(region.values) > 40 else ""
            lines.append(
                f"  doc {region.doc_id[:12]} chunks {region.positions[0]}-"
                f"{region.positions[-1]}: {shown}{more}"
            )
        lines.extend(
            f"  segment doc {s.doc_id[:12]} chunks [{s.start}, {s.end}) value {s.value:.3f}"
            for s in self.segments
        )
        lines.extend(
            f"  hole doc {h.doc_id[:12]} between {h.left} and {h.right}: {h.reason}"
            for h in self.holes
        )
        if self.passthrough:
            lines.append(f"  {len(self.passthrough)} node(s) passed through unplaced")
        if self.left_out:
            lines.append(f"  {len(self.left_out)} unplaced node(s) left out: over the budget")
        if self.note:
            lines.append(f"  {self.note}")
        return "\n".join(lines)
