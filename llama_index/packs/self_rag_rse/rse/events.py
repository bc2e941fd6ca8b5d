"""RSE's instrumentation event: what one extraction took in and handed on, and why.

Sent once per :meth:`~.postprocessor.RelevantSegmentPostprocessor.extract` (so once per
postprocess call), under the extraction's span, only while a handler listens; it carries the
call's own objects (nothing is copied), and its properties read them when asked.
"""

from __future__ import annotations

from typing import Any

from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.schema import MetadataMode, NodeWithScore

from llama_index.packs.self_rag_rse.rse.context_budget import Tokenizer, count_tokens
from llama_index.packs.self_rag_rse.rse.types import Segment


class SegmentsExtractedEvent(BaseEvent):
    """One RSE extraction: the ``hits`` it took in (each node once, best first, those with a
    source document), the segments the search chose (``searched``, a list of
    :class:`~.types.Segment`) and the ``extraction`` it returned (the
    :class:`~.types.SegmentExtraction`: its ``segments``, the nodes passed through,
    ``left_out`` of a budget, ``holes``, and ``note``: why nothing came back when that
    happened); ``tokenizer`` is the postprocessor's (``None``: none given).

    :attr:`segments` shows each segment handed on; :attr:`dropped` and :attr:`refilled` what a
    context budget changed after measuring the segments' text.
    """

    # Any: RSE's dataclasses (nodes and numpy inside) pass as they are, never validated or copied.
    hits: list[NodeWithScore]
    searched: Any  # list[Segment]
    extraction: Any  # SegmentExtraction
    tokenizer: Any = None

    @classmethod
    def class_name(cls) -> str:
        """Name used in serialisation."""
        return "SegmentsExtractedEvent"

    @property
    def segments(self) -> list[dict[str, Any]]:
        """Each segment handed on, best first: its document, its chunks (``[first, last + 1)``,
        true indices when known, else positions), its value, and the characters and tokens of
        the text the LLM reads for it (headers included; tokens as a context budget counts them:
        with ``tokenizer``, else one per four characters).
        """
        return [_row(segment, self.tokenizer) for segment in self.extraction.segments]

    @property
    def dropped(self) -> list[Segment]:
        """Segments the search chose that were not handed on: a context budget dropped them
        (their text did not fit), or, rarely, earlier segments already gave all their text.
        """
        handed_on = self.extraction.segments
        return [s for s in self.searched if not any(s is kept for kept in handed_on)]

    @property
    def refilled(self) -> list[Segment]:
        """Segments a context budget added after a drop (single hits, or a piece of one)."""
        return [s for s in self.extraction.segments if not any(s is c for c in self.searched)]


def _row(segment: Segment, tokenizer: Tokenizer | None) -> dict[str, Any]:
    """One segment as :attr:`SegmentsExtractedEvent.segments` shows it."""
    texts = [node.get_content(metadata_mode=MetadataMode.LLM) for node in segment.nodes]
    return {
        "doc_id": segment.doc_id,
        "chunks": segment.chunk_range or (segment.start, segment.end),
        "value": segment.value,
        "characters": sum(map(len, texts)),
        "tokens": sum(count_tokens(text, tokenizer) for text in texts),
    }
