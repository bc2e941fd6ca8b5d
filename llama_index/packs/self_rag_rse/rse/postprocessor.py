"""Relevant Segment Extraction (dsRAG) as a LlamaIndex node postprocessor.

Retrieval returns fragments; the answer usually lives in a contiguous passage. RSE scores every
chunk of the documents that were hit (retrieved chunks by rank and relevance, the chunks between
them by a small penalty), finds the spans with the largest total value, and returns each span as
one node holding the exact document text, the chunks between hits read back from the docstore or
the vector store.
"""

from __future__ import annotations

import logging
import uuid
import warnings
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events.rerank import ReRankEndEvent, ReRankStartEvent
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import (
    BaseNode,
    NodeRelationship,
    NodeWithScore,
    QueryBundle,
    TextNode,
)
from llama_index.core.storage.docstore.types import BaseDocumentStore
from llama_index.core.vector_stores.types import BasePydanticVectorStore

from llama_index.packs.self_rag_rse.rse.calibration import (
    COHERE_RERANK_BETA,
    VOYAGE_RERANK_BETA,
    calibrate_beta,
    calibrate_minmax,
)
from llama_index.packs.self_rag_rse.rse.chunk_index import CHUNK_INDEX_KEY
from llama_index.packs.self_rag_rse.rse.chunk_sources import ChunkRequest, ChunkSource, nodes_by_id
from llama_index.packs.self_rag_rse.rse.segments import (
    adjust_for_length,
    chunk_value,
    find_best_segments,
    get_preset,
)
from llama_index.packs.self_rag_rse.rse.stitching import stitch_chunks

logger = logging.getLogger(__name__)
dispatcher = get_dispatcher(__name__)

#: Cosine similarities of all-MiniLM/BGE-class embedders mapped linearly onto [0, 1]; see README.
DEFAULT_COSINE_RANGE = (0.1, 0.5)
#: Metadata keys written on segment nodes (hidden from embedding and LLM text).
SEGMENT_METADATA_KEYS = (
    "segment_document_id",
    "segment_chunk_range",
    "segment_char_range",
    "segment_node_ids",
    "segment_value",
)

Calibration = Literal["cosine", "raw", "cohere", "voyage"] | Callable[[np.ndarray], np.ndarray]


@dataclass
class DocumentRegion:
    """A run of consecutive chunk positions of one document that the search may join."""

    doc_id: str
    positions: list[int]
    values: np.ndarray


@dataclass
class Segment:
    """One extracted segment: document, chunk positions ``[start, end)``, value and members."""

    doc_id: str
    start: int
    end: int
    value: float
    members: list[BaseNode] = field(default_factory=list)


@dataclass
class SegmentExtraction:
    """Everything one call computed: the regions searched (values laid end to end, as the
    segment search saw them), the segments chosen, the nodes that could not be placed in any
    document, and how many store reads it took. :func:`plot_segments` draws it."""

    regions: list[DocumentRegion]
    segments: list[Segment]
    passthrough: list[NodeWithScore]
    store_calls: int = 0

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


class RelevantSegmentPostprocessor(BaseNodePostprocessor):
    """Turn retrieved chunks into contiguous segments of their documents (dsRAG's RSE).

    Every retrieved chunk gets the value ``exp(-rank / decay_rate) * relevance -
    irrelevant_chunk_penalty``; the chunks between hits get ``-irrelevant_chunk_penalty``. The
    segments with the largest total value (at most ``max_length`` chunks each, at most
    ``overall_max_length`` chunks in all, worth at least ``minimum_value``) are returned, best
    first, each as one node with the exact text of the span.

    Chunk order comes, per document, from a ``chunk_index`` stamped by
    :class:`~llama_index.packs.self_rag_rse.ChunkIndexer` (cheapest: only the missing chunks are
    read, with one filtered call), else from the docstore's record of the document's nodes, else
    by reading the document's nodes from the vector store and sorting them by ``start_char_idx``.
    With no store at all, only chunks that were all retrieved and are known to be adjacent are
    joined. Nodes without a source document pass through unchanged, after the segments.
    """

    preset: str = Field(
        default="balanced",
        description="dsRAG preset giving the defaults: 'balanced', 'precision' or 'find_all'.",
    )
    max_length: int | None = Field(default=None, description="Most chunks in one segment.")
    overall_max_length: int | None = Field(
        default=None, description="Most chunks over all segments returned."
    )
    minimum_value: float | None = Field(
        default=None, description="A segment must be worth at least this much to be returned."
    )
    irrelevant_chunk_penalty: float | None = Field(
        default=None,
        description=(
            "Subtracted from every chunk's value. Higher gives shorter, fewer segments; "
            "0 lets segments grow to max_length through unretrieved chunks."
        ),
    )
    decay_rate: float | None = Field(
        default=None, description="Rank decay: a hit at rank r is worth exp(-r / decay_rate)."
    )
    top_k_for_document_selection: int | None = Field(
        default=None, description="Only documents of the top-k hits (by best rank) are searched."
    )
    calibration: Any = Field(
        default="cosine",
        description=(
            "How node scores become relevance in [0, 1]: 'cosine' (linear over cosine_range), "
            "'raw' (as is), 'cohere' / 'voyage' (dsRAG's beta CDFs for those rerankers), or a "
            "callable on a numpy array."
        ),
    )
    cosine_range: tuple[float, float] = Field(
        default=DEFAULT_COSINE_RANGE,
        description="Similarities at or below the first count 0, at or above the second 1.",
    )
    chunk_length_adjustment: bool = Field(
        default=False,
        description="Scale retrieved chunks' values by max(len, 700) / 700 characters (dsRAG).",
    )
    output: Literal["segments", "chunks"] = Field(
        default="segments",
        description="'segments': one node per segment; 'chunks': the member chunks in order.",
    )
    on_unplaceable: Literal["warn", "raise"] = Field(
        default="warn",
        description=(
            "Nodes RSE cannot place (no source document, or nothing that orders them): pass "
            "through after the segments with a warning, or raise."
        ),
    )
    chunk_index_key: str = Field(
        default=CHUNK_INDEX_KEY, description="Metadata key of the stamped chunk index."
    )
    doc_id_key: str = Field(
        default="doc_id", description="Vector-store payload key holding the source document id."
    )
    max_document_chunks: int = Field(
        default=20_000,
        description="Most nodes read back per document when the order must be read from the store.",
    )
    verbose: bool = Field(default=False, description="Print a readable trace.")

    _docstore: BaseDocumentStore | None = PrivateAttr(default=None)
    _vector_store: BasePydanticVectorStore | None = PrivateAttr(default=None)

    def __init__(
        self,
        *,
        docstore: BaseDocumentStore | None = None,
        vector_store: BasePydanticVectorStore | None = None,
        index: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        get_preset(self.preset)  # fail now on a bad name, not at the first query
        if index is not None:
            # An index's docstore is empty when the vector store keeps the text (Qdrant etc.).
            index_docstore = getattr(index, "docstore", None)
            if docstore is None and index_docstore is not None and index_docstore.docs:
                docstore = index_docstore
            if vector_store is None:
                vector_store = getattr(index, "vector_store", None)
        self._docstore = docstore
        self._vector_store = vector_store
        if (self.max_length if self.max_length is not None else 1) < 1:
            raise ValueError(f"max_length must be at least 1, got {self.max_length}")
        if self.overall_max_length is not None and self.overall_max_length < 1:
            raise ValueError(
                f"overall_max_length must be at least 1, got {self.overall_max_length}"
            )
        if not callable(self.calibration) and self.calibration not in _CALIBRATIONS:
            raise ValueError(
                f"unknown calibration {self.calibration!r}: use one of {sorted(_CALIBRATIONS)} "
                "or a callable mapping a numpy array of scores to relevance in [0, 1]"
            )
        low, high = self.cosine_range
        if not high > low:
            raise ValueError(
                f"cosine_range must be (low, high) with high > low, got {self.cosine_range}"
            )

    @classmethod
    def class_name(cls) -> str:
        """Name used in serialisation."""
        return "RelevantSegmentPostprocessor"

    # -- parameters -------------------------------------------------------------------------
    def _param(self, name: str) -> Any:
        value = getattr(self, name)
        return getattr(get_preset(self.preset), name) if value is None else value

    def _relevance(self, scores: np.ndarray) -> np.ndarray:
        if callable(self.calibration):
            return np.asarray(self.calibration(scores), dtype=float)
        if self.calibration == "cosine":
            return calibrate_minmax(scores, *self.cosine_range)
        if self.calibration == "cohere":
            return calibrate_beta(scores, *COHERE_RERANK_BETA)
        if self.calibration == "voyage":
            return calibrate_beta(scores, *VOYAGE_RERANK_BETA)
        return scores

    def _source(self) -> ChunkSource:
        return ChunkSource(
            docstore=self._docstore,
            vector_store=self._vector_store,
            doc_id_key=self.doc_id_key,
            index_key=self.chunk_index_key,
        )

    # -- LlamaIndex hooks -------------------------------------------------------------------
    def _postprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        """Replace retrieved chunks by the best segments of their documents."""
        dispatcher.event(self._start_event(nodes, query_bundle))
        result = self._to_nodes(self.extract(nodes))
        dispatcher.event(ReRankEndEvent(nodes=result))
        return result

    async def _apostprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        """Async variant: store reads use the stores' async APIs."""
        dispatcher.event(self._start_event(nodes, query_bundle))
        result = self._to_nodes(await self.aextract(nodes))
        dispatcher.event(ReRankEndEvent(nodes=result))
        return result

    def _start_event(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None
    ) -> ReRankStartEvent:
        return ReRankStartEvent(
            query=query_bundle,
            nodes=nodes,
            top_n=int(self._param("overall_max_length")),
            model_name=f"relevant-segment-extraction:{self.preset}",
        )

    # -- public API -------------------------------------------------------------------------
    def extract(self, nodes: Sequence[NodeWithScore]) -> SegmentExtraction:
        """Run the extraction and return its full result (values, segments, members)."""
        source = self._source()
        plan = self._plan(list(nodes), source)
        try:
            request = next(plan)
            while True:
                request = plan.send(source.run(request))
        except StopIteration as done:
            extraction: SegmentExtraction = done.value
        extraction.store_calls = source.calls
        return extraction

    async def aextract(self, nodes: Sequence[NodeWithScore]) -> SegmentExtraction:
        """Async :meth:`extract`."""
        source = self._source()
        plan = self._plan(list(nodes), source)
        try:
            request = next(plan)
            while True:
                request = plan.send(await source.arun(request))
        except StopIteration as done:
            extraction: SegmentExtraction = done.value
        extraction.store_calls = source.calls
        return extraction

    # -- the algorithm, written once for sync and async drivers -----------------------------
    def _plan(
        self, nodes: list[NodeWithScore], source: ChunkSource
    ) -> Generator[ChunkRequest, Any, SegmentExtraction]:
        hits, passthrough = self._rank(nodes)
        if not hits:
            return SegmentExtraction([], [], passthrough)
        docs = self._select_documents(hits)
        positions: dict[str, dict[str, int]] = {}  # doc -> hit node id -> position
        held: dict[str, dict[int, BaseNode]] = {}  # doc -> position -> node at hand
        ordered_ids: dict[str, list[str]] = {}  # doc -> node id at each position
        key = self.chunk_index_key

        for doc_id, members in docs.items():
            if all(_index(n, key) is not None for n in members):
                positions[doc_id] = {n.node_id: _index(n, key) for n in members}  # type: ignore[misc]
        if source.supports("ref_doc_ids"):
            # Asked for indexed documents too: the docstore then serves their gap reads by id.
            answer: dict[str, list[str]] = yield ChunkRequest("ref_doc_ids", doc_ids=list(docs))
            for doc_id, ids in answer.items():
                where = {node_id: i for i, node_id in enumerate(ids)}
                if doc_id in positions:
                    if all(where.get(n) == p for n, p in positions[doc_id].items()):
                        ordered_ids[doc_id] = ids
                elif all(n.node_id in where for n in docs[doc_id]):
                    positions[doc_id] = {n.node_id: where[n.node_id] for n in docs[doc_id]}
                    ordered_ids[doc_id] = ids
        pending = [d for d in docs if d not in positions]
        if pending and source.supports("documents"):
            limit = self.max_document_chunks * len(pending)
            read: list[BaseNode] = yield ChunkRequest("documents", doc_ids=pending, limit=limit)
            for doc_id, members in _group_by_document(read).items():
                if doc_id not in pending or len(members) > self.max_document_chunks:
                    continue
                order = _document_order(members)
                where = {node.node_id: i for i, node in enumerate(order)}
                if all(n.node_id in where for n in docs[doc_id]):
                    positions[doc_id] = {n.node_id: where[n.node_id] for n in docs[doc_id]}
                    ordered_ids[doc_id] = [n.node_id for n in order]
                    held[doc_id] = dict(enumerate(order))
        fetchable: set[str] = set()  # documents whose missing chunks can still be read
        for doc_id, members in list(docs.items()):
            if doc_id in ordered_ids or (doc_id in positions and source.supports("chunk_indices")):
                fetchable.add(doc_id)
            elif doc_id not in positions:
                if not _orderable(members):
                    lost = [h.item for h in hits if h.node.ref_doc_id == doc_id]
                    self._unplaceable(lost, "carry no chunk index, offsets or NEXT/PREVIOUS links")
                    passthrough.extend(lost)
                    del docs[doc_id]
                    continue
                positions[doc_id] = _positions_from_links(members)
            mine = held.setdefault(doc_id, {})
            for node in members:  # the retrieved copy wins over a copy read back
                mine[positions[doc_id][node.node_id]] = node

        values_of = {h.node.node_id: h.value for h in hits}
        regions = self._regions(docs, positions, held, values_of, fetchable)
        segments = self._search(regions)

        missing = self._missing(segments, held)
        if missing:
            read_nodes = yield from self._read_missing(missing, ordered_ids, source)
            slots = {d: {n: i for i, n in enumerate(ids)} for d, ids in ordered_ids.items()}
            for node in read_nodes:
                owner = node.ref_doc_id
                if owner is None or owner not in missing:
                    continue
                position = slots[owner].get(node.node_id) if owner in slots else _index(node, key)
                if position is not None and position in missing[owner]:
                    held[owner][position] = node
            if self._missing(segments, held):
                # Some chunks between hits could not be read: search again, joining only
                # chunks we hold, so that no segment silently skips text.
                fetchable.clear()
                regions = self._regions(docs, positions, held, values_of, fetchable)
                segments = self._search(regions)
        for segment in segments:
            segment.members = [held[segment.doc_id][p] for p in range(segment.start, segment.end)]
        extraction = SegmentExtraction(regions, segments, passthrough)
        if self.verbose:
            _print_trace(extraction, hits)
        return extraction

    def _read_missing(
        self,
        missing: dict[str, set[int]],
        ordered_ids: dict[str, list[str]],
        source: ChunkSource,
    ) -> Generator[ChunkRequest, Any, list[BaseNode]]:
        by_index = {d: sorted(p) for d, p in missing.items() if d not in ordered_ids}
        by_id = [
            ordered_ids[d][p] for d, ps in missing.items() if d in ordered_ids for p in sorted(ps)
        ]
        read: list[BaseNode] = []
        if by_id:
            read.extend((yield ChunkRequest("node_ids", node_ids=by_id)))
        if by_index:
            read.extend((yield ChunkRequest("chunk_indices", indices=by_index)))
        return read

    # -- steps --------------------------------------------------------------------------------
    def _rank(self, nodes: list[NodeWithScore]) -> tuple[list[_Hit], list[NodeWithScore]]:
        """Deduplicate, rank by score and turn scores into chunk values."""
        seen: set[str] = set()
        unique = []
        for item in nodes:
            if item.node.node_id not in seen:
                seen.add(item.node.node_id)
                unique.append(item)
        scores = [item.score for item in unique]
        if all(s is not None for s in scores):
            unique.sort(key=lambda item: -float(item.score))  # type: ignore[arg-type]
            relevance = self._relevance(np.array([float(item.score) for item in unique]))  # type: ignore[arg-type]
        else:
            if any(s is not None for s in scores):
                warnings.warn(
                    "some nodes have no score: RSE ranks all nodes by their input order and uses "
                    "relevance 1 for nodes without a score; give every node a score (or none) "
                    "for a consistent ranking",
                    stacklevel=4,
                )
            known = np.array([np.nan if s is None else float(s) for s in scores])
            relevance = np.where(np.isnan(known), 1.0, self._relevance(np.nan_to_num(known)))
        if np.isnan(relevance).any():
            raise ValueError("node scores contain NaN: fix the retriever or reranker upstream")
        ranks = np.arange(len(unique), dtype=float)
        values = chunk_value(
            ranks, relevance, self._param("decay_rate"), self._param("irrelevant_chunk_penalty")
        )
        if self.chunk_length_adjustment:
            lengths = np.array([len(item.node.get_content()) for item in unique], dtype=float)
            values = adjust_for_length(values, lengths)
        hits, passthrough = [], []
        for rank, (item, value) in enumerate(zip(unique, values, strict=True)):
            if item.node.ref_doc_id is None:
                passthrough.append(item)
            else:
                hits.append(_Hit(item, rank, float(value)))
        self._unplaceable(passthrough, "have no source document (no SOURCE relationship)")
        return hits, passthrough

    def _unplaceable(self, items: list[NodeWithScore], why: str) -> None:
        """Warn (or raise) about nodes that pass through because they cannot be ordered."""
        if not items:
            return
        message = (
            f"{len(items)} node(s) {why}, so RSE cannot place them in their document; they pass "
            "through unchanged. Fix: build nodes with a LlamaIndex splitter (offsets and "
            "relationships), add ChunkIndexer at ingestion, or pass the docstore or vector store."
        )
        if self.on_unplaceable == "raise":
            raise ValueError(message)
        warnings.warn(message, stacklevel=5)

    def _select_documents(self, hits: list[_Hit]) -> dict[str, list[BaseNode]]:
        top_k = int(self._param("top_k_for_document_selection"))
        docs: dict[str, list[BaseNode]] = {}
        for hit in hits:  # hits are in rank order, so documents enter by their best rank
            doc_id = hit.node.ref_doc_id
            assert doc_id is not None
            if doc_id in docs:
                docs[doc_id].append(hit.node)
            elif len(docs) < top_k:
                docs[doc_id] = [hit.node]
        return docs

    def _regions(
        self,
        docs: dict[str, list[BaseNode]],
        positions: dict[str, dict[str, int]],
        held: dict[str, dict[int, BaseNode]],
        values_of: dict[str, float],
        fetchable: set[str],
    ) -> list[DocumentRegion]:
        penalty = float(self._param("irrelevant_chunk_penalty"))
        regions = []
        for doc_id in docs:
            hit_positions = {
                p: values_of[n] for n, p in positions[doc_id].items() if n in values_of
            }
            if not hit_positions:
                continue
            # Chunks before the first hit or after the last are worth -penalty and can never end
            # a segment, so the region spans first..last hit only.
            lo, hi = min(hit_positions), max(hit_positions)
            at_hand = held[doc_id]
            run: list[int] = []
            for p in range(lo, hi + 1):
                if doc_id in fetchable or p in at_hand:
                    run.append(p)
                    continue
                if run:
                    regions.append(self._region(doc_id, run, hit_positions, penalty))
                run = []
            if run:
                regions.append(self._region(doc_id, run, hit_positions, penalty))
        return regions

    @staticmethod
    def _region(
        doc_id: str, run: list[int], hit_positions: dict[int, float], penalty: float
    ) -> DocumentRegion:
        values = np.array([hit_positions.get(p, -penalty) for p in run], dtype=float)
        return DocumentRegion(doc_id, run, values)

    def _search(self, regions: list[DocumentRegion]) -> list[Segment]:
        if not regions:
            return []
        values = np.concatenate([r.values for r in regions])
        splits = [int(x) for x in np.cumsum([len(r.values) for r in regions])]
        spans, scores = find_best_segments(
            values[None, :],
            splits,
            int(self._param("max_length")),
            int(self._param("overall_max_length")),
            float(self._param("minimum_value")),
        )
        starts = [0, *splits[:-1]]
        segments = []
        for (start, end), score in zip(spans, scores, strict=True):
            r = int(np.searchsorted(splits, start, side="right"))
            region = regions[r]
            offset = start - starts[r]
            first = region.positions[offset]
            segments.append(Segment(region.doc_id, first, first + (end - start), float(score)))
        segments.sort(key=lambda s: -s.value)
        return segments

    @staticmethod
    def _missing(
        segments: list[Segment], held: dict[str, dict[int, BaseNode]]
    ) -> dict[str, set[int]]:
        missing: dict[str, set[int]] = {}
        for s in segments:
            gaps = {p for p in range(s.start, s.end) if p not in held[s.doc_id]}
            if gaps:
                missing.setdefault(s.doc_id, set()).update(gaps)
        return missing

    def _to_nodes(self, extraction: SegmentExtraction) -> list[NodeWithScore]:
        result: list[NodeWithScore] = []
        for segment in extraction.segments:
            if self.output == "chunks":
                result.extend(NodeWithScore(node=m, score=segment.value) for m in segment.members)
            else:
                result.append(NodeWithScore(node=_segment_node(segment), score=segment.value))
        return result + extraction.passthrough


_CALIBRATIONS = {"cosine", "raw", "cohere", "voyage"}


@dataclass
class _Hit:
    item: NodeWithScore
    rank: int
    value: float

    @property
    def node(self) -> BaseNode:
        return self.item.node


def _index(node: BaseNode, key: str) -> int | None:
    value = node.metadata.get(key)
    if isinstance(value, bool) or value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _group_by_document(nodes: Sequence[BaseNode]) -> dict[str, list[BaseNode]]:
    groups: dict[str, list[BaseNode]] = {}
    for node in nodes_by_id(nodes).values():
        if node.ref_doc_id is not None:
            groups.setdefault(node.ref_doc_id, []).append(node)
    return groups


def _document_order(members: list[BaseNode]) -> list[BaseNode]:
    """Order one document's nodes: by start_char_idx, else by the NEXT chain."""
    if all(getattr(n, "start_char_idx", None) is not None for n in members):
        return sorted(members, key=lambda n: int(getattr(n, "start_char_idx", 0)))
    by_id = {n.node_id: n for n in members}
    previous = {n.node_id for n in members if _link(n, NodeRelationship.PREVIOUS) in by_id}
    heads = [n for n in members if n.node_id not in previous]
    ordered: list[BaseNode] = []
    placed: set[str] = set()
    for head in heads:
        node: BaseNode | None = head
        while node is not None and node.node_id not in placed:
            ordered.append(node)
            placed.add(node.node_id)
            nxt = _link(node, NodeRelationship.NEXT)
            node = by_id.get(nxt) if nxt else None
    return ordered


def _orderable(members: list[BaseNode]) -> bool:
    """Whether anything on the nodes themselves says where they sit in their document."""
    return all(getattr(n, "start_char_idx", None) is not None for n in members) or any(
        _link(n, r) is not None
        for n in members
        for r in (NodeRelationship.NEXT, NodeRelationship.PREVIOUS)
    )


def _positions_from_links(members: list[BaseNode]) -> dict[str, int]:
    """Positions for a document no store can describe: adjacent only where known adjacent.

    Hits linked by NEXT/PREVIOUS (or consecutive start/end offsets) get consecutive positions;
    unrelated runs are placed two apart, so a position with no chunk lies between them and the
    search cannot join them.
    """
    ordered = _document_order(members)
    positions: dict[str, int] = {}
    position = 0
    for i, node in enumerate(ordered):
        if i and not _adjacent(ordered[i - 1], node):
            position += 1
        positions[node.node_id] = position
        position += 1
    return positions


def _adjacent(left: BaseNode, right: BaseNode) -> bool:
    if _link(left, NodeRelationship.NEXT) == right.node_id:
        return True
    if _link(right, NodeRelationship.PREVIOUS) == left.node_id:
        return True
    # Overlapping or touching character spans: the splitter put these chunks side by side.
    first = getattr(left, "start_char_idx", None)
    end, start = getattr(left, "end_char_idx", None), getattr(right, "start_char_idx", None)
    if first is None or end is None or start is None:
        return False
    return bool(first <= start <= end)


def _link(node: BaseNode, relation: NodeRelationship) -> str | None:
    info = node.relationships.get(relation)
    return getattr(info, "node_id", None)


def _segment_node(segment: Segment) -> TextNode:
    members = segment.members
    stitched = stitch_chunks(
        [m.get_content() for m in members],
        [(getattr(m, "start_char_idx", None), getattr(m, "end_char_idx", None)) for m in members],
    )
    shared = dict(members[0].metadata)
    for member in members[1:]:
        shared = {k: v for k, v in shared.items() if member.metadata.get(k) == v}
    shared.pop(CHUNK_INDEX_KEY, None)
    shared.update(
        {
            "segment_document_id": segment.doc_id,
            "segment_chunk_range": [segment.start, segment.end],
            "segment_char_range": (
                [stitched.start_char, stitched.end_char]
                if stitched.start_char is not None and stitched.end_char is not None
                else None
            ),
            "segment_node_ids": [m.node_id for m in members],
            "segment_value": segment.value,
        }
    )
    hidden = list(SEGMENT_METADATA_KEYS)
    for key in (*members[0].excluded_llm_metadata_keys, CHUNK_INDEX_KEY):
        if key not in hidden:
            hidden.append(key)
    node_id = str(
        uuid.uuid5(uuid.NAMESPACE_URL, f"rse:{segment.doc_id}:{segment.start}:{segment.end}")
    )
    relationships = {}
    source = members[0].relationships.get(NodeRelationship.SOURCE)
    if source is not None:
        relationships[NodeRelationship.SOURCE] = source
    return TextNode(
        id_=node_id,
        text=stitched.text,
        metadata=shared,
        excluded_llm_metadata_keys=hidden,
        excluded_embed_metadata_keys=list(hidden),
        relationships=relationships,
        start_char_idx=stitched.start_char,
        end_char_idx=stitched.end_char,
    )


def _print_trace(extraction: SegmentExtraction, hits: list[_Hit]) -> None:
    print(f"RSE: {len(hits)} hits in {len({r.doc_id for r in extraction.regions})} document(s)")
    for region in extraction.regions:
        shown = " ".join(f"{v:+.2f}" for v in region.values[:40])
        more = " ..." if len(region.values) > 40 else ""
        print(
            f"  doc {region.doc_id[:12]} chunks {region.positions[0]}-{region.positions[-1]}: "
            f"{shown}{more}"
        )
    for s in extraction.segments:
        print(f"  segment doc {s.doc_id[:12]} chunks [{s.start}, {s.end}) value {s.value:.3f}")
    if extraction.passthrough:
        print(f"  {len(extraction.passthrough)} node(s) passed through unplaced")
