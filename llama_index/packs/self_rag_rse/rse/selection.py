"""How RSE chooses its segments: dsRAG's chunk counts, or a context budget, behind one interface.

dsRAG sizes what RSE returns in chunks: at most ``max_length`` in one segment and
``overall_max_length`` in all, from the documents of its best hits (:class:`ChunkCounts`). A
context budget sizes it in the text the answer LLM reads
(:class:`~llama_index.packs.self_rag_rse.rse.context_budget.ContextBudget`). Everything that
choice changes lives behind :class:`SelectionPolicy`, so the postprocessor picks a policy once
per call and never asks which one it has:

- the defaults it implies: the calibration used when none is given, and ``minimum_value``;
- how a hit's value scales with the length of its text (:meth:`SelectionPolicy.scale`);
- which documents are searched (:meth:`SelectionPolicy.documents`);
- the search itself (:meth:`SelectionPolicy.search`);
- the fit of the nodes built from the segments (:meth:`SelectionPolicy.fit`);
- why a call that was given nodes returned none (:meth:`SelectionPolicy.why_empty`).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from llama_index.core.schema import BaseNode

from llama_index.packs.self_rag_rse.rse.layout import DocumentLayout
from llama_index.packs.self_rag_rse.rse.segments import FloatArray, find_best_segments
from llama_index.packs.self_rag_rse.rse.types import SegmentExtraction

#: ``(start, end)`` positions of the regions laid end to end, and the value of each.
Spans = tuple[list[tuple[int, int]], list[float]]


@dataclass(kw_only=True, eq=False)
class SelectionPolicy(ABC):
    """What decides the segments of one RSE call (see the module docstring).

    ``max_length``: the most chunks in one segment; ``minimum_value``: the least a segment the
    search returns is worth; ``most_documents``: how many documents (by their best hit) are
    searched, ``None`` for every document hit.
    """

    #: The calibration used when the ``calibration`` option is left ``None``.
    default_calibration: ClassVar[str]

    max_length: int
    minimum_value: float
    most_documents: int | None

    def calibration(self, given: Any) -> Any:
        """The calibration in use: ``given`` (the option), else this policy's default."""
        return self.default_calibration if given is None else given

    def scale(self, values: FloatArray, lengths: FloatArray) -> FloatArray:
        """The hits' values (best first) given the lengths of their texts: unchanged, as dsRAG
        has them (its own length adjustment is the ``chunk_length_adjustment`` option).
        """
        return values

    def documents(self, hits: Sequence[BaseNode]) -> dict[str, list[BaseNode]]:
        """The documents searched, each with its hits: ``hits`` come best first, each with a
        source document, and documents enter by their best hit, up to :attr:`most_documents`.
        """
        docs: dict[str, list[BaseNode]] = {}
        for hit in hits:
            doc_id = hit.ref_doc_id
            assert doc_id is not None
            if doc_id in docs:
                docs[doc_id].append(hit)
            elif self.most_documents is None or len(docs) < self.most_documents:
                docs[doc_id] = [hit]
        return docs

    @abstractmethod
    def search(
        self,
        laid_out: SegmentExtraction,
        layouts: Mapping[str, DocumentLayout],
        hit_ids: Sequence[str],
    ) -> Spans:
        """The segments to return, as ``(start, end)`` positions of ``laid_out`` (its regions
        laid end to end, with their values and document splits), and their values.
        ``layouts``: the documents' layouts (the chunks at hand); ``hit_ids``: the hits, best
        first.
        """

    @abstractmethod
    def fit(
        self,
        extraction: SegmentExtraction,
        *,
        hits: Sequence[BaseNode],
        values_of: Mapping[str, float],
        layouts: Mapping[str, DocumentLayout],
    ) -> None:
        """Correct ``extraction`` once its nodes are built. ``hits``: best first, with their
        values by node id, placed in ``layouts`` (where the search left them).
        """

    @abstractmethod
    def why_empty(self, head: str, extraction: SegmentExtraction, hits: Sequence[BaseNode]) -> str:
        """Why a call whose hits were placed (``extraction.regions``) returned no segment:
        ``head`` (how many nodes came in) followed by the cause and its fix.
        """


@dataclass(kw_only=True, eq=False)
class ChunkCounts(SelectionPolicy):
    """dsRAG's selection: segments of at most ``max_length`` chunks and ``overall_max_length``
    chunks in all, each worth ``minimum_value`` at least, from the first ``most_documents``
    documents hit (its ``top_k_for_document_selection``; :func:`~.segments.find_best_segments`).
    ``irrelevant_chunk_penalty`` is named when no chunk is worth anything.
    """

    default_calibration = "cosine_adaptive"

    overall_max_length: int
    irrelevant_chunk_penalty: float

    def search(
        self,
        laid_out: SegmentExtraction,
        layouts: Mapping[str, DocumentLayout],
        hit_ids: Sequence[str],
    ) -> Spans:
        """dsRAG's search: the best segments by value until the chunk count is spent."""
        return find_best_segments(
            laid_out.values[None, :],
            laid_out.document_splits,
            max_length=self.max_length,
            overall_max_length=self.overall_max_length,
            minimum_value=self.minimum_value,
        )

    def fit(
        self,
        extraction: SegmentExtraction,
        *,
        hits: Sequence[BaseNode],
        values_of: Mapping[str, float],
        layouts: Mapping[str, DocumentLayout],
    ) -> None:
        """Nothing to correct: the search kept to the chunk counts."""

    def why_empty(self, head: str, extraction: SegmentExtraction, hits: Sequence[BaseNode]) -> str:
        """No chunk worth more than the penalty, or no segment worth ``minimum_value``."""
        values = extraction.values
        best_chunk = float(values.max())
        if best_chunk < 0:
            return (
                f"{head}: no chunk is worth more than irrelevant_chunk_penalty "
                f"{self.irrelevant_chunk_penalty:g} (best chunk value {best_chunk:.3g}); lower "
                "irrelevant_chunk_penalty, or check the calibration (cosine_range) against "
                "your scores"
            )
        _, best = find_best_segments(
            values[None, :],
            extraction.document_splits,
            max_length=self.max_length,
            overall_max_length=self.max_length,
            minimum_value=-math.inf,
        )
        return (
            f"{head}: best segment value {best[0]:.3g} < minimum_value "
            f"{self.minimum_value:g}; lower minimum_value or irrelevant_chunk_penalty"
        )
