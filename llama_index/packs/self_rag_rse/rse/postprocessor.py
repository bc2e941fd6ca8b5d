"""Relevant Segment Extraction (dsRAG) as a LlamaIndex node postprocessor.

Retrieval returns fragments; the answer usually lives in a contiguous passage. RSE scores every
chunk of the documents that were hit (retrieved chunks by rank and relevance, the chunks between
them by a small penalty), finds the spans with the largest total value, and returns each span as
one node holding the exact document text, the chunks between hits read back from the docstore or
the vector store. Where the evidence on the nodes shows a hole in a document's order (a deleted
chunk, offsets the texts contradict), segments stop at the hole instead of papering over it.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Generator, Iterable, Sequence
from typing import Any

import numpy as np
from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events.rerank import ReRankEndEvent, ReRankStartEvent
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import BaseNode, NodeWithScore, QueryBundle
from llama_index.core.storage.docstore.types import BaseDocumentStore
from llama_index.core.vector_stores.types import BasePydanticVectorStore

from llama_index.packs.self_rag_rse.common import tracing
from llama_index.packs.self_rag_rse.common.bridge import adrive, drive
from llama_index.packs.self_rag_rse.common.notes import print_escaped, record_note
from llama_index.packs.self_rag_rse.common.options import pydantic_fields, reject_unknown
from llama_index.packs.self_rag_rse.rse.calibration import node_relevance, reject_nan
from llama_index.packs.self_rag_rse.rse.chunk_sources import ChunkRequest, ChunkSource
from llama_index.packs.self_rag_rse.rse.context_budget import ContextBudget
from llama_index.packs.self_rag_rse.rse.events import SegmentsExtractedEvent
from llama_index.packs.self_rag_rse.rse.layout import (
    DocumentLayout,
    lay_out,
    missing_positions,
    place_read,
    read_missing,
)
from llama_index.packs.self_rag_rse.rse.node_fields import off_span
from llama_index.packs.self_rag_rse.rse.options import SegmentOptions
from llama_index.packs.self_rag_rse.rse.segment_nodes import drop_given_text, segment_nodes
from llama_index.packs.self_rag_rse.rse.selection import ChunkCounts, SelectionPolicy
from llama_index.packs.self_rag_rse.rse.types import DocumentRegion, Segment, SegmentExtraction
from llama_index.packs.self_rag_rse.rse.values import adjust_for_length, chunk_value

logger = logging.getLogger(__name__)
dispatcher = get_dispatcher(__name__)

#: Most rounds of reading chunks between hits. One round suffices unless a read reveals a hole
#: and the search, run again, wants chunks it did not want before; the bound keeps a store that
#: keeps revealing holes from costing a read per chunk.
MAX_READ_ROUNDS = 3

#: Keyword arguments the constructor takes besides the pydantic fields.
_PARTS = ("docstore", "vector_store", "index")


class RelevantSegmentPostprocessor(SegmentOptions, BaseNodePostprocessor):
    """Turn retrieved chunks into contiguous segments of their documents (dsRAG's RSE).

    Every retrieved chunk gets the value ``exp(-rank / decay_rate) * relevance -
    irrelevant_chunk_penalty``; the chunks between hits get ``-irrelevant_chunk_penalty``. The
    segments with the largest total value (at most ``max_length`` chunks each, at most
    ``overall_max_length`` chunks in all, worth at least ``minimum_value``) are returned, best
    first, each as one node with the exact text of the span, named by what it holds (its
    chunks' ids and its text: the same id on every call for the same content). Under a context
    budget (``max_context_chars`` / ``max_context_tokens``) the segments are sized to it
    instead: each call picks one selection policy, dsRAG's chunk counts
    (:class:`~.selection.ChunkCounts`) or the budget (:class:`~.context_budget.ContextBudget`),
    and everything the choice changes is asked of it (:mod:`~.selection`). Options are checked
    at construction and again whenever one is set (:mod:`~.options`).

    Chunk order comes, per document, from a ``chunk_index`` stamped by
    :class:`~llama_index.packs.self_rag_rse.ChunkIndexer` (cheapest: only the missing chunks are
    read, with one filtered call), else from the docstore's record of the document's nodes, else
    by reading the document's nodes from the vector store and sorting them by ``start_char_idx``.
    With no store at all, only chunks that were all retrieved and are known to be adjacent are
    joined. Nodes without a source document pass through unchanged, after the segments.

    Holes are never joined across: a NEXT/PREVIOUS link naming a chunk the store lacks, offsets
    further apart than a splitter strips, offsets the texts contradict where no link vouches for
    the join, a chunk no store returns, or chunks of two versions of a document (stamped by
    ``ChunkIndexer``). Two hits stamped with one chunk index are a conflict: the better ranked
    is placed, the other passes through. All are listed in :attr:`SegmentExtraction.holes`
    and logged once per call. When nodes came in but no segment was worth ``minimum_value``,
    :attr:`SegmentExtraction.note` says so (and it is logged at INFO).

    Example::

        rse = RelevantSegmentPostprocessor(index=index, preset="balanced")
        engine = index.as_query_engine(similarity_top_k=20, node_postprocessors=[rse])
    """

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
        # Pydantic would drop a misspelt option silently and use its default.
        reject_unknown(type(self).__name__, kwargs, pydantic_fields(type(self)) | set(_PARTS))
        for name, part in zip(_PARTS, (docstore, vector_store, index), strict=True):
            needs = "docstore" if name == "index" else "get_nodes"  # what RSE reads chunks with
            if part is not None and not hasattr(part, needs):
                raise TypeError(
                    f"{name} is a {type(part).__name__}, not a LlamaIndex "
                    f"{name.replace('_', ' ')}: pass index=<your VectorStoreIndex>"
                )
        super().__init__(**kwargs)
        if index is not None:
            # An index keeps its nodes in its docstore unless its vector store keeps the text
            # (Qdrant etc.): the store's kind says so, not what the docstore holds yet.
            index_store = getattr(index, "vector_store", None)
            if docstore is None and not getattr(index_store, "stores_text", False):
                docstore = getattr(index, "docstore", None)
            vector_store = vector_store or index_store
        self._docstore = docstore
        self._vector_store = vector_store

    @classmethod
    def class_name(cls) -> str:
        """Name used in serialisation."""
        return "RelevantSegmentPostprocessor"

    # -- LlamaIndex hooks -------------------------------------------------------------------
    def _postprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        """Replace retrieved chunks by the best segments of their documents."""
        nodes = _scored(nodes)  # any iterable: the start event must not use up a generator
        dispatcher.event(self._start_event(nodes, query_bundle))
        result = self._to_nodes(self.extract(nodes))
        dispatcher.event(ReRankEndEvent(nodes=result))
        return result

    @dispatcher.span
    async def _apostprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        """Async variant: store reads use the stores' async APIs."""
        nodes = _scored(nodes)
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
    @dispatcher.span
    def extract(self, nodes: Sequence[NodeWithScore]) -> SegmentExtraction:
        """Run the extraction and return its full result (values, segments, members, holes)."""
        source = ChunkSource(self._docstore, self._vector_store)
        # Each store read is a span of its own (ChunkSource.run), inside the extraction's.
        return drive(self._plan(_scored(nodes), source), dispatcher.span(source.run))

    @dispatcher.span
    async def aextract(self, nodes: Sequence[NodeWithScore]) -> SegmentExtraction:
        """Async :meth:`extract`."""
        source = ChunkSource(self._docstore, self._vector_store)
        return await adrive(self._plan(_scored(nodes), source), dispatcher.span(source.arun))

    # -- the algorithm, written once for sync and async drivers -----------------------------
    def _plan(
        self, nodes: list[NodeWithScore], source: ChunkSource
    ) -> Generator[ChunkRequest, Any, SegmentExtraction]:
        unique, hits, passthrough = self._rank(nodes)
        policy = self._selection(hits)
        values_of = self._values(unique, policy)
        extraction = SegmentExtraction([], [], passthrough)
        layouts: dict[str, DocumentLayout] = {}
        if hits:
            docs = policy.documents([hit.node for hit in hits])
            layouts = yield from lay_out(docs, source, self.max_document_chunks)
            for doc_id in [d for d in docs if d not in layouts]:
                lost = [h for h in hits if h.node.ref_doc_id == doc_id]
                self._unplaceable(
                    lost,
                    why="carry no chunk index, offsets or NEXT/PREVIOUS links",
                    fix=(
                        "build nodes with a LlamaIndex splitter (offsets and relationships), add "
                        "ChunkIndexer at ingestion, or pass the docstore or vector store that "
                        "holds the document's chunks (index=...), so RSE can read their order"
                    ),
                )
                passthrough.extend(lost)
                del docs[doc_id]
            claimed = {n.node_id for layout in layouts.values() for n in layout.conflicts}
            extra = [h for h in hits if h.node.node_id in claimed]
            self._unplaceable(
                extra,
                why="claim the chunk index of a better-ranked hit of their document",
                because=(
                    "The store holds two chunks at one place of the document: the document was "
                    "ingested twice without stable ids, or two chunkings of it share one "
                    "document id. "
                ),
                fix=(
                    "ingest each document once with ChunkIndexer(stable_ids=True), so a re-ingest "
                    "overwrites a document's chunks instead of copying them, and delete the "
                    "copies; give each chunking its own document ids"
                ),
            )
            passthrough.extend(extra)
            segments, regions = yield from self._settle(docs, layouts, values_of, source, policy)
            holes = [hole for doc_id in docs for hole in layouts[doc_id].holes]
            extraction = SegmentExtraction(regions, segments, passthrough, holes=holes)
        searched = list(extraction.segments)
        policy.fit(
            extraction,
            hits=[hit.node for hit in hits],
            values_of=values_of,
            layouts=layouts,
        )
        if self.output == "segments":
            extraction.segments = drop_given_text(extraction.segments)
        extraction.store_calls = source.calls  # every read is answered by now
        self._finish(extraction, nodes, hits, policy)
        tracing.emit(
            SegmentsExtractedEvent,
            hits=hits,
            searched=searched,
            extraction=extraction,
            tokenizer=self.tokenizer,
        )
        return extraction

    def _selection(self, hits: list[NodeWithScore]) -> SelectionPolicy:
        """The one place a context budget is looked at: with one, the segments are sized to it
        (:class:`ContextBudget`); without, to dsRAG's chunk counts (:class:`ChunkCounts`).
        """
        max_length = int(self._param("max_length"))
        if self.budgeted:
            return ContextBudget(
                max_length=max_length,
                max_chars=self.max_context_chars,
                max_tokens=self.max_context_tokens,
                tokenizer=self.tokenizer,
                minimum_value=self.minimum_value,
                keep_top_hits=self.keep_top_hits,
                partial=self.partial_fill,
                headers=self.segment_headers,
            )
        return ChunkCounts(
            max_length=max_length,
            overall_max_length=int(self._param("overall_max_length")),
            minimum_value=float(self._param("minimum_value")),
            irrelevant_chunk_penalty=float(self._param("irrelevant_chunk_penalty")),
            most_documents=int(self._param("top_k_for_document_selection")),
        )

    def _settle(
        self,
        docs: dict[str, list[BaseNode]],
        layouts: dict[str, DocumentLayout],
        values_of: dict[str, float],
        source: ChunkSource,
        policy: SelectionPolicy,
    ) -> Generator[ChunkRequest, Any, tuple[list[Segment], list[DocumentRegion]]]:
        """Search, read the chunks the segments need, search again where reads showed holes;
        returns the segments with their members and nodes, and the regions last searched.
        """
        penalty = float(self._param("irrelevant_chunk_penalty"))
        rounds = 0
        while True:
            # In rank order of the documents: the search breaks ties by position.
            regions = [
                region
                for doc_id in docs
                for region in layouts[doc_id].regions(values_of, penalty, policy.max_length)
            ]
            segments = self._search(regions, layouts, values_of, policy)
            missing = missing_positions(segments, layouts)
            if missing and rounds < MAX_READ_ROUNDS:
                rounds += 1
                read = yield from read_missing(
                    missing, layouts, by_index_ok=source.supports("chunk_indices")
                )
                place_read(read, missing, layouts)
            elif missing:
                for doc_id in missing:  # out of rounds: join only chunks already at hand
                    layouts[doc_id].fetchable = False
            # Chunks now at hand may show holes the retrieved ones could not.
            found = sum(layouts[s.doc_id].check(s.start, s.end) for s in segments)
            if not found and not missing_positions(segments, layouts):
                break
        for segment in segments:
            layouts[segment.doc_id].fill(segment)
            segment.nodes = list(segment_nodes(segment, self.segment_headers))
        return segments, regions

    # -- steps --------------------------------------------------------------------------------
    def _rank(
        self, nodes: list[NodeWithScore]
    ) -> tuple[list[NodeWithScore], list[NodeWithScore], list[NodeWithScore]]:
        """Deduplicate and rank by score: returns every node once, best first; the hits (those
        with a source document); and the nodes that pass through.
        """
        reject_nan([item.score for item in nodes])
        best: dict[str, NodeWithScore] = {}
        other: list[NodeWithScore] = []  # one id, another text: passed through, not dropped
        for item in nodes:  # a node given twice (two retrievers' lists joined): its best score
            node_id = item.node.node_id
            kept = best.setdefault(node_id, item)
            scored_higher = item.score is not None and (
                kept.score is None or item.score > kept.score
            )
            if scored_higher:
                best[node_id] = item
                item = kept
            if item is not best[node_id] and item.get_content() != best[node_id].get_content():
                other.append(item)
        unique = list(best.values())
        scores = [item.score for item in unique]
        if all(s is not None for s in scores):
            unique.sort(key=lambda item: -float(item.score))  # type: ignore[arg-type]
        elif any(s is not None for s in scores):
            warnings.warn(
                "some nodes have no score: RSE ranks all nodes by their input order and uses "
                "relevance 1 for nodes without a score; give every node a score (or none) "
                "for a consistent ranking",
                stacklevel=4,
            )
        hits = [item for item in unique if item.node.ref_doc_id is not None]
        if changed := [h for h in hits if off_span(h.node)]:
            warnings.warn(
                f"{len(changed)} hit(s) hold more or less text than their offsets span (e.g. "
                f"{changed[0].node.node_id!r}): changed before RSE, as by MetadataReplacement"
                "PostProcessor's sentence windows or a compressor? Joined, such texts repeat or "
                "skip text. Put RelevantSegmentPostprocessor first, or leave the other out: RSE "
                "adds the neighbouring text itself",
                stacklevel=4,
            )
        passthrough = [item for item in unique if item.node.ref_doc_id is None]
        self._unplaceable(
            passthrough,
            why="have no source document (no SOURCE relationship)",
            fix=(
                "build them with a LlamaIndex splitter (a node parser), which names the document "
                "each chunk was cut from; nodes that are no document's chunks can stay as they are"
            ),
        )
        self._unplaceable(
            other,
            why="share their node id with a better-ranked hit of another text",
            because=(
                "Two chunkings of one document, both stamped ChunkIndexer(stable_ids=True), name "
                "their k-th chunks alike (a stable id is made of the document id and the chunk "
                "index). "
            ),
            fix=(
                "give each chunking its own document ids (e.g. Document(id_=f'{doc.doc_id}-256', "
                "text=doc.text, metadata=doc.metadata) for the 256-token chunking), then re-ingest"
            ),
        )
        return unique, hits, passthrough + other

    def _values(self, unique: list[NodeWithScore], policy: SelectionPolicy) -> dict[str, float]:
        """The chunk value of every hit by node id, in rank order (``unique``: every node once,
        best first): rank and calibrated relevance (:func:`~.values.chunk_value`), scaled as
        the policy says.
        """
        scores = [item.score for item in unique]
        calibration = policy.calibration(self.calibration)
        relevance = node_relevance(calibration, scores, self.cosine_range)
        # Every score positive and below the range: another scale, such as rank fusion's
        # (negative cosine similarities say irrelevant, not another scale).
        top = max((float(s) for s in scores if s is not None), default=0.0)
        cosine = calibration in ("cosine", "cosine_adaptive")
        if cosine and relevance.size > 0 and not relevance.any() and top > 0:
            warnings.warn(
                f"no node's score is above cosine_range[0] ({self.cosine_range[0]}), so every "
                "hit is worth 0 and RSE keeps none: for scores that are no cosine similarities "
                "(reciprocal-rank fusion, BM25, a reranker) pass calibration='spread' or a "
                "cosine_range that fits them",
                stacklevel=4,
            )
        ranks = np.arange(len(unique), dtype=float)
        values = chunk_value(
            ranks,
            relevance,
            decay_rate=self._param("decay_rate"),
            irrelevant_chunk_penalty=self._param("irrelevant_chunk_penalty"),
        )
        lengths = np.array([len(item.node.get_content()) for item in unique], dtype=float)
        if self.chunk_length_adjustment:
            values = adjust_for_length(values, lengths)
        values = policy.scale(values, lengths)
        return {
            item.node.node_id: float(value)
            for item, value in zip(unique, values, strict=True)
            if item.node.ref_doc_id is not None
        }

    def _unplaceable(
        self, items: list[NodeWithScore], *, why: str, fix: str, because: str = ""
    ) -> None:
        """Warn (or raise) about nodes that pass through because RSE cannot place them: ``why``
        (after "N node(s)"), what usually causes it (``because``, a sentence or empty), and the
        fix for that cause.
        """
        if not items:
            return
        message = (
            f"{len(items)} node(s) {why}, so RSE cannot place them in their document; they pass "
            f"through unchanged. {because}Fix: {fix}."
        )
        if self.on_unplaceable == "raise":
            raise ValueError(message)
        warnings.warn(message, stacklevel=5)

    def _search(
        self,
        regions: list[DocumentRegion],
        layouts: dict[str, DocumentLayout],
        values_of: dict[str, float],
        policy: SelectionPolicy,
    ) -> list[Segment]:
        if not regions:
            return []
        laid_out = SegmentExtraction(regions, [], [])
        spans, scores = policy.search(laid_out, layouts, list(values_of))
        return sorted(
            (
                laid_out.segment_at(start, end, score)
                for (start, end), score in zip(spans, scores, strict=True)
            ),
            key=lambda s: -s.value,
        )

    def _finish(
        self,
        extraction: SegmentExtraction,
        nodes: list[NodeWithScore],
        hits: list[NodeWithScore],
        policy: SelectionPolicy,
    ) -> SegmentExtraction:
        """Say what went wrong, once, in the log and on the result."""
        if extraction.holes:
            shown = "; ".join(
                f"{h.doc_id} chunks {h.left}|{h.right}: {h.reason}" for h in extraction.holes[:3]
            )
            more = f" (and {len(extraction.holes) - 3} more)" if len(extraction.holes) > 3 else ""
            logger.warning(
                "RSE found %d hole(s) in the chunk order and did not join across them: %s%s. "
                "Fix: re-ingest the documents so the store holds every chunk of one version "
                "with true offsets, once (ChunkIndexer(stable_ids=True), and delete an older "
                "version's leftover chunks; see SegmentExtraction.holes).",
                len(extraction.holes),
                shown,
                more,
            )
        if nodes and not extraction.segments and not extraction.passthrough:
            head = f"RSE kept none of {len(nodes)} nodes"
            extraction.note = (
                policy.why_empty(head, extraction, [h.node for h in hits])
                if hits and extraction.regions
                else f"{head}: none could be placed in a document (RSE warned why, with the fix)"
            )
            logger.info("%s", extraction.note)
            record_note(type(self).__name__, extraction.note)
        if self.verbose:
            print_escaped(extraction.describe())
        return extraction

    def _to_nodes(self, extraction: SegmentExtraction) -> list[NodeWithScore]:
        result: list[NodeWithScore] = []
        for segment in extraction.segments:
            parts = segment.members if self.output == "chunks" else segment.nodes
            result.extend(NodeWithScore(node=node, score=segment.value) for node in parts)
        return result + extraction.passthrough


def _scored(nodes: Iterable[NodeWithScore]) -> list[NodeWithScore]:
    """``nodes`` as a list; bare nodes are refused before core's event fails on them unexplained."""
    items = list(nodes)
    if wrong := [n for n in items if not isinstance(n, NodeWithScore)]:  # None too
        raise TypeError(
            f"RelevantSegmentPostprocessor got a {type(wrong[0]).__name__} among its nodes; it "
            "takes retrieved nodes: wrap each in NodeWithScore(node=..., score=...)"
        )
    return items
