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
import math
import warnings
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events.rerank import ReRankEndEvent, ReRankStartEvent
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import BaseNode, NodeWithScore, QueryBundle
from llama_index.core.storage.docstore.types import BaseDocumentStore
from llama_index.core.vector_stores.types import BasePydanticVectorStore

from llama_index.packs.self_rag_rse.common.bridge import adrive, drive
from llama_index.packs.self_rag_rse.common.notes import record_note
from llama_index.packs.self_rag_rse.common.options import (
    pydantic_fields,
    reject_unknown,
    require_finite,
)
from llama_index.packs.self_rag_rse.rse.budget import (
    MAX_BUDGET,
    fill_budget,
    find_budgeted_segments,
)
from llama_index.packs.self_rag_rse.rse.calibration import (
    DEFAULT_COSINE_RANGE,
    check_calibration,
    node_relevance,
    reject_nan,
)
from llama_index.packs.self_rag_rse.rse.chunk_index import CHUNK_INDEX_KEY, CHUNK_VERSION_KEY
from llama_index.packs.self_rag_rse.rse.chunk_sources import ChunkRequest, ChunkSource
from llama_index.packs.self_rag_rse.rse.costs import (
    CHARS_PER_TOKEN,
    chunk_costs,
    count_tokens,
    llm_text,
    node_cost,
)
from llama_index.packs.self_rag_rse.rse.layout import (
    DocumentLayout,
    lay_out,
    missing_positions,
    place_read,
    read_missing,
)
from llama_index.packs.self_rag_rse.rse.segment_nodes import segment_nodes
from llama_index.packs.self_rag_rse.rse.segments import find_best_segments
from llama_index.packs.self_rag_rse.rse.types import (
    DocumentRegion,
    Segment,
    SegmentExtraction,
)
from llama_index.packs.self_rag_rse.rse.values import adjust_for_length, chunk_value, get_preset

logger = logging.getLogger(__name__)
dispatcher = get_dispatcher(__name__)

#: Most rounds of reading chunks between hits. One round suffices unless a read reveals a hole
#: and the search, run again, wants chunks it did not want before; the bound keeps a store that
#: keeps revealing holes from costing a read per chunk.
MAX_READ_ROUNDS = 3

#: Most searches under a context budget: when the nodes built exceed it (costs of chunks not at
#: hand were estimates), the budget shrinks by the excess and the search runs again.
MAX_BUDGET_ROUNDS = 3

#: Keyword arguments the constructor takes besides the pydantic fields.
_PARTS = ("docstore", "vector_store", "index")


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
        default=None,
        description=(
            "How node scores become relevance in [0, 1]: 'spread' (per query: best hit 1, median "
            "hit 0; no range to tune per embedder), 'cosine_adaptive' (linear over cosine_range, "
            "its top raised to the query's best score), 'cosine' (linear over the fixed "
            "cosine_range), 'raw' (as is), 'cohere' / 'voyage' (dsRAG's beta CDFs for those "
            "rerankers), or a callable on a numpy array (one query's scores). None (default): "
            "'spread' under a context budget, 'cosine_adaptive' without one."
        ),
    )
    cosine_range: tuple[float, float] = Field(
        default=DEFAULT_COSINE_RANGE,
        description=(
            "Similarities at or below the first count 0, at or above the second 1 ('cosine'); "
            "'cosine_adaptive' maps the query's best score to 1 when it is above the second."
        ),
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
    chunk_version_key: str = Field(
        default=CHUNK_VERSION_KEY,
        description="Metadata key of the stamped document version (never joined across).",
    )
    doc_id_key: str = Field(
        default="doc_id", description="Vector-store payload key holding the source document id."
    )
    max_document_chunks: int = Field(
        default=20_000,
        description="Most nodes read back per document when the order must be read from the store.",
    )
    max_context_chars: int | None = Field(
        default=None,
        description=(
            "Most characters the returned nodes hand the LLM (segment text with the overlap cut, "
            "each segment's header once). Set, the search maximises value within it and fills "
            "what is left with the best remaining hits; None keeps dsRAG's chunk counts."
        ),
    )
    max_context_tokens: int | None = Field(
        default=None,
        description="The same budget in tokens, counted with `tokenizer`.",
    )
    tokenizer: Any = Field(
        default=None,
        exclude=True,
        description=(
            "Callable text -> tokens (a sequence) for max_context_tokens; default: one token per "
            "4 characters, rounded up."
        ),
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
        # Pydantic would drop a misspelt option silently and use its default.
        reject_unknown(type(self).__name__, kwargs, pydantic_fields(type(self)) | set(_PARTS))
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
        if self.calibration is not None:
            check_calibration(self.calibration)
        self._check_budget()
        low, high = self.cosine_range
        require_finite(
            type(self).__name__,
            minimum_value=self.minimum_value,
            irrelevant_chunk_penalty=self.irrelevant_chunk_penalty,
            decay_rate=self.decay_rate,
            **{"cosine_range[0]": low, "cosine_range[1]": high},
        )
        if not high > low:
            raise ValueError(
                f"cosine_range must be (low, high) with high > low, got {self.cosine_range}"
            )

    def _check_budget(self) -> None:
        for name in ("max_context_chars", "max_context_tokens"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"{name} must be a positive integer, got {value!r}: pass the size of the "
                    "context the LLM may read, e.g. 3000"
                )
            if value > MAX_BUDGET:
                raise ValueError(f"{name} must be at most {MAX_BUDGET:,}, got {value:,}")
        if self.budgeted and self.output != "segments":
            raise ValueError(
                "a context budget (max_context_chars / max_context_tokens) needs "
                "output='segments': member chunks repeat their overlap, which the budget cuts"
            )
        if self.tokenizer is not None and not callable(self.tokenizer):
            raise ValueError(
                f"tokenizer must be a callable text -> tokens, got {type(self.tokenizer).__name__}"
                ": pass e.g. tiktoken.get_encoding('cl100k_base').encode"
            )

    @property
    def budgeted(self) -> bool:
        """Whether a context budget is set (the segments are then sized to it)."""
        return self.max_context_chars is not None or self.max_context_tokens is not None

    @property
    def relevance_calibration(self) -> Any:
        """The calibration in use: the one given, else 'spread' under a budget, else
        'cosine_adaptive'."""
        if self.calibration is not None:
            return self.calibration
        return "spread" if self.budgeted else "cosine_adaptive"

    @classmethod
    def class_name(cls) -> str:
        """Name used in serialisation."""
        return "RelevantSegmentPostprocessor"

    # -- parameters -------------------------------------------------------------------------
    def _param(self, name: str) -> Any:
        value = getattr(self, name)
        return getattr(get_preset(self.preset), name) if value is None else value

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
        """Run the extraction and return its full result (values, segments, members, holes)."""
        source = self._source()
        extraction = drive(self._plan(list(nodes), source), source.run)
        extraction.store_calls = source.calls
        return extraction

    async def aextract(self, nodes: Sequence[NodeWithScore]) -> SegmentExtraction:
        """Async :meth:`extract`."""
        source = self._source()
        extraction = await adrive(self._plan(list(nodes), source), source.arun)
        extraction.store_calls = source.calls
        return extraction

    # -- the algorithm, written once for sync and async drivers -----------------------------
    def _plan(
        self, nodes: list[NodeWithScore], source: ChunkSource
    ) -> Generator[ChunkRequest, Any, SegmentExtraction]:
        hits, passthrough = self._rank(nodes)
        if not hits:
            extraction = SegmentExtraction([], [], passthrough)
            if self.budgeted:
                self._fit_passthrough(extraction, self._budget(hits), (0, 0))
            return self._finish(extraction, nodes, hits)
        docs = self._select_documents(hits)
        layouts = yield from lay_out(
            docs, source, self.chunk_index_key, self.max_document_chunks, self.chunk_version_key
        )
        for doc_id in [d for d in docs if d not in layouts]:
            lost = [h.item for h in hits if h.node.ref_doc_id == doc_id]
            self._unplaceable(lost, "carry no chunk index, offsets or NEXT/PREVIOUS links")
            passthrough.extend(lost)
            del docs[doc_id]
        claimed = {n.node_id for layout in layouts.values() for n in layout.conflicts}
        extra = [h.item for h in hits if h.node.node_id in claimed]
        self._unplaceable(extra, "claim the chunk index of a better-ranked hit of their document")
        passthrough.extend(extra)
        # Hits by node id, best first (dict order): their values, and their ranks for ties.
        values_of = {h.node.node_id: h.value for h in hits}
        budget = self._budget(hits) if self.budgeted else None
        segments, regions = yield from self._settle(docs, layouts, values_of, source, budget)
        if budget is not None:
            # Costs of chunks not at hand were estimates: check the nodes, shrink, search again.
            costs = self._costs(segments)
            for _ in range(MAX_BUDGET_ROUNDS):
                over = budget.overrun(_total(costs))
                if over <= 0:
                    break
                budget = budget.shrunk(over)
                segments, regions = yield from self._settle(
                    docs, layouts, values_of, source, budget
                )
                costs = self._costs(segments)
            segments, spent = self._trim(segments, costs, budget)
        holes = [hole for doc_id in docs for hole in layouts[doc_id].holes]
        extraction = SegmentExtraction(regions, segments, passthrough, holes=holes)
        if budget is not None:
            self._fit_passthrough(extraction, budget, spent)
        return self._finish(extraction, nodes, hits)

    def _settle(
        self,
        docs: dict[str, list[BaseNode]],
        layouts: dict[str, DocumentLayout],
        values_of: dict[str, float],
        source: ChunkSource,
        budget: _Budget | None,
    ) -> Generator[ChunkRequest, Any, tuple[list[Segment], list[DocumentRegion]]]:
        """Search, read the chunks the segments need, search again where reads showed holes;
        returns the segments with their members, and the regions last searched."""
        penalty = float(self._param("irrelevant_chunk_penalty"))
        length = int(self._param("max_length"))
        # In rank order of the documents: the search breaks ties by position.
        regions = [r for d in docs for r in layouts[d].regions(values_of, penalty, length)]
        segments = self._search(regions, layouts, values_of, budget)
        rounds = 0
        while True:
            missing = missing_positions(segments, layouts)
            if missing and rounds < MAX_READ_ROUNDS:
                rounds += 1
                read = yield from read_missing(
                    missing, layouts, by_index_ok=source.supports("chunk_indices")
                )
                place_read(read, missing, layouts, self.chunk_index_key)
            elif missing:
                for doc_id in missing:  # out of rounds: join only chunks already at hand
                    layouts[doc_id].fetchable = False
            # Chunks now at hand may show holes the retrieved ones could not.
            found = sum(layouts[s.doc_id].check(s.start, s.end) for s in segments)
            if not found and not missing_positions(segments, layouts):
                break
            regions = [r for d in docs for r in layouts[d].regions(values_of, penalty, length)]
            segments = self._search(regions, layouts, values_of, budget)
        for segment in segments:
            layouts[segment.doc_id].fill(segment, self.chunk_index_key)
        return segments, regions

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
        reject_nan(scores)
        if all(s is not None for s in scores):
            unique.sort(key=lambda item: -float(item.score))  # type: ignore[arg-type]
            scores = [item.score for item in unique]
        elif any(s is not None for s in scores):
            warnings.warn(
                "some nodes have no score: RSE ranks all nodes by their input order and uses "
                "relevance 1 for nodes without a score; give every node a score (or none) "
                "for a consistent ranking",
                stacklevel=4,
            )
        relevance = node_relevance(self.relevance_calibration, scores, self.cosine_range)
        ranks = np.arange(len(unique), dtype=float)
        values = chunk_value(
            ranks, relevance, self._param("decay_rate"), self._param("irrelevant_chunk_penalty")
        )
        lengths = np.array([len(item.node.get_content()) for item in unique], dtype=float)
        if self.chunk_length_adjustment:
            values = adjust_for_length(values, lengths)
        if self.budgeted and lengths.size and lengths.mean() > 0:
            # A budget is spent in characters: a hit's worth scales with the text it brings, so
            # the knapsack does not trade one long strong hit for two short weaker ones.
            values = np.where(values > 0, values * lengths / lengths.mean(), values)
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
            "relationships), add ChunkIndexer at ingestion (stable_ids=True, so a re-ingest "
            "overwrites a document's chunks instead of copying them), or pass the docstore or "
            "vector store."
        )
        if self.on_unplaceable == "raise":
            raise ValueError(message)
        warnings.warn(message, stacklevel=5)

    def _select_documents(self, hits: list[_Hit]) -> dict[str, list[BaseNode]]:
        # Under a budget the budget decides; top-k keeps every document's hits too.
        top_k = len(hits) if self.budgeted else int(self._param("top_k_for_document_selection"))
        docs: dict[str, list[BaseNode]] = {}
        for hit in hits:  # hits are in rank order, so documents enter by their best rank
            doc_id = hit.node.ref_doc_id
            assert doc_id is not None
            if doc_id in docs:
                docs[doc_id].append(hit.node)
            elif len(docs) < top_k:
                docs[doc_id] = [hit.node]
        return docs

    def _search(
        self,
        regions: list[DocumentRegion],
        layouts: dict[str, DocumentLayout],
        values_of: dict[str, float],
        budget: _Budget | None,
    ) -> list[Segment]:
        if not regions:
            return []
        laid_out = SegmentExtraction(regions, [], [])
        if budget is None:
            spans, scores = find_best_segments(
                laid_out.values[None, :],
                laid_out.document_splits,
                int(self._param("max_length")),
                int(self._param("overall_max_length")),
                float(self._param("minimum_value")),
            )
        else:
            spans = self._budgeted_spans(laid_out, layouts, values_of, budget)
            scores = [float(np.sum(laid_out.values[start:end])) for start, end in spans]
        segments = [
            laid_out.segment_at(start, end, score)
            for (start, end), score in zip(spans, scores, strict=True)
        ]
        segments.sort(key=lambda s: -s.value)
        return segments

    def _budgeted_spans(
        self,
        laid_out: SegmentExtraction,
        layouts: dict[str, DocumentLayout],
        values_of: dict[str, float],
        budget: _Budget,
    ) -> list[tuple[int, int]]:
        """Segments worth most within the budget, then the best remaining hits that fit."""
        values, splits = laid_out.values, laid_out.document_splits

        def overhead(node: BaseNode) -> int:
            if node.node_id not in budget.overheads:
                budget.overheads[node.node_id] = self._overhead(node)
            return budget.overheads[node.node_id]

        first, step = chunk_costs(laid_out.regions, layouts, overhead)
        spans, _ = find_budgeted_segments(
            values,
            splits,
            first,
            step,
            budget.chars,
            int(self._param("max_length")),
            float(self._param("minimum_value")),
        )
        where: dict[str, int] = {}
        offset = 0
        for region in laid_out.regions:
            held = layouts[region.doc_id].held
            for i, position in enumerate(region.positions):
                node = held.get(position)
                if node is not None and node.node_id in values_of:
                    where[node.node_id] = offset + i
            offset += len(region.positions)
        # In rank order (values_of is best first): equal values fill as top-k would.
        hit_positions = [where[node_id] for node_id in values_of if node_id in where]
        return fill_budget(spans, values, splits, first, step, budget.chars, hit_positions)

    def _overhead(self, node: BaseNode) -> int:
        """Characters a segment starting at ``node`` shows besides its text (its header)."""
        alone = Segment(node.ref_doc_id or "", 0, 1, 0.0, members=[node])
        built = segment_nodes(alone, self.chunk_index_key)[0]
        return len(llm_text(built)) - len(built.get_content())

    def _costs(self, segments: Sequence[Segment]) -> list[tuple[int, int]]:
        """``(characters, tokens)`` the LLM reads for each segment's node(s)."""
        return [
            _total([node_cost(n, self.tokenizer) for n in segment_nodes(s, self.chunk_index_key)])
            for s in segments
        ]

    def _budget(self, hits: list[_Hit]) -> _Budget:
        """The budget in characters; a token budget converts at the hits' own ratio."""
        limits = []
        ratio = float(CHARS_PER_TOKEN)
        if self.max_context_tokens is not None:
            texts = [h.node.get_content() for h in hits]
            counted = sum(count_tokens(t, self.tokenizer) for t in texts)
            ratio = sum(map(len, texts)) / counted if counted else ratio
            limits.append(int(self.max_context_tokens * ratio))
        if self.max_context_chars is not None:
            limits.append(self.max_context_chars)
        return _Budget(min(limits), ratio, self.max_context_chars, self.max_context_tokens)

    def _trim(
        self, segments: list[Segment], costs: list[tuple[int, int]], budget: _Budget
    ) -> tuple[list[Segment], tuple[int, int]]:
        """Drop the least valuable segments until the nodes fit (estimates that stayed wrong);
        returns the segments kept, best first, and what they cost together."""
        kept = sorted(zip(segments, costs, strict=True), key=lambda pair: -pair[0].value)
        while kept and budget.overrun(_total([c for _, c in kept])) > 0:
            kept.pop()
        return [s for s, _ in kept], _total([c for _, c in kept])

    def _fit_passthrough(
        self, extraction: SegmentExtraction, budget: _Budget, spent: tuple[int, int]
    ) -> None:
        """Nodes RSE could not place follow the segments (costing ``spent``) as far as the
        budget lets them."""
        chars, tokens = spent
        kept = []
        for item in extraction.passthrough:
            c, t = node_cost(item.node, self.tokenizer)
            if budget.overrun((chars + c, tokens + t)) <= 0:
                kept.append(item)
                chars, tokens = chars + c, tokens + t
            else:
                extraction.left_out.append(item)
        extraction.passthrough = kept
        if extraction.left_out:
            logger.info(
                "RSE left %d unplaced node(s) out: they do not fit the context budget",
                len(extraction.left_out),
            )

    def _finish(
        self, extraction: SegmentExtraction, nodes: list[NodeWithScore], hits: list[_Hit]
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
            extraction.note = self._why_empty(extraction, len(nodes), hits)
            logger.info("%s", extraction.note)
            record_note(type(self).__name__, extraction.note)
        if self.verbose:
            print(extraction.describe())
        return extraction

    def _why_empty(self, extraction: SegmentExtraction, n_nodes: int, hits: list[_Hit]) -> str:
        minimum = float(self._param("minimum_value"))
        penalty = float(self._param("irrelevant_chunk_penalty"))
        head = f"RSE kept none of {n_nodes} nodes"
        if not hits or not extraction.regions:
            return f"{head}: none could be placed in a document"
        if self.budgeted:
            cheapest = min(len(h.node.get_content()) + self._overhead(h.node) for h in hits)
            limits = ", ".join(
                f"{name}={getattr(self, name)}"
                for name in ("max_context_chars", "max_context_tokens")
                if getattr(self, name) is not None
            )
            return (
                f"{head}: no hit fits the context budget ({limits}); the shortest needs "
                f"{cheapest} characters with its header: raise the budget"
            )
        values = extraction.values
        if float(values.max()) < 0:
            return (
                f"{head}: no chunk is worth more than irrelevant_chunk_penalty {penalty:g} "
                f"(best chunk value {float(values.max()):.3g}); lower irrelevant_chunk_penalty, "
                "or check the calibration (cosine_range) against your scores"
            )
        length = int(self._param("max_length"))
        _, best = find_best_segments(
            values[None, :], extraction.document_splits, length, length, -math.inf
        )
        return (
            f"{head}: best segment value {best[0]:.3g} < minimum_value {minimum:g}; lower "
            "minimum_value or irrelevant_chunk_penalty"
        )

    def _to_nodes(self, extraction: SegmentExtraction) -> list[NodeWithScore]:
        result: list[NodeWithScore] = []
        for segment in extraction.segments:
            if self.output == "chunks":
                result.extend(NodeWithScore(node=m, score=segment.value) for m in segment.members)
            else:
                result.extend(
                    NodeWithScore(node=node, score=segment.value)
                    for node in segment_nodes(segment, self.chunk_index_key)
                )
        return result + extraction.passthrough


def _total(costs: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """``(characters, tokens)`` summed."""
    return sum(c for c, _ in costs), sum(t for _, t in costs)


@dataclass(frozen=True)
class _Budget:
    """A context budget: ``chars`` the search spends, ``ratio`` characters per token (for a
    token limit), and the user's limits the built nodes are checked against."""

    chars: int
    ratio: float
    max_chars: int | None
    max_tokens: int | None
    # Header characters per node id, computed once per call (each search round reuses them).
    overheads: dict[str, int] = field(default_factory=dict, compare=False)

    def overrun(self, cost: tuple[int, int]) -> int:
        """By how many characters ``(characters, tokens)`` exceed the limits (<= 0: fits)."""
        chars, tokens = cost
        over = chars - self.max_chars if self.max_chars is not None else -1
        if self.max_tokens is not None:
            over = max(over, math.ceil((tokens - self.max_tokens) * self.ratio))
        return over

    def shrunk(self, over: int) -> _Budget:
        return _Budget(
            max(0, self.chars - over), self.ratio, self.max_chars, self.max_tokens, self.overheads
        )


@dataclass
class _Hit:
    item: NodeWithScore
    rank: int
    value: float

    @property
    def node(self) -> BaseNode:
        return self.item.node
