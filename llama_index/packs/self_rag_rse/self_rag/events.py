"""The Self-RAG engine's instrumentation events: what a query did, as it does it.

Each event is sent by the method of the query's record (:class:`~.record.QueryRecord`) that
writes the same fact into ``metadata["self_rag"]``, so events, metadata and the ``verbose=True``
tables cannot disagree. They are sent under the span of the step that produced them (the gate,
a retrieval round, a judgement batch, a long-form depth: see docs/tracing.md), only while a
handler listens, and carry the record's own objects.
"""

from __future__ import annotations

from typing import Any

from llama_index.core.instrumentation.events import BaseEvent

from llama_index.packs.self_rag_rse.critic.contract import ParagraphJudgement


class SelfRAGStepEvent(BaseEvent):
    """One entry of the query's trace (``metadata["self_rag"]["trace"]``), as it is added.

    ``step`` is the record's typed step (:mod:`~llama_index.packs.self_rag_rse.self_rag.record`):
    ``step.kind`` names it (``"decide"``: the gate's ``retrieve`` and ``probability``;
    ``"retrieve"``, ``"query2doc"``, ``"rewrite"``, ``"regenerate"``, ``"depth"`` with every
    candidate path and whether the beam kept it, ``"fallback"``...) and ``step.as_dict()`` is
    the trace's entry.
    """

    step: Any

    @classmethod
    def class_name(cls) -> str:
        """Name used in serialisation."""
        return "SelfRAGStepEvent"


class ParagraphJudgedEvent(BaseEvent):
    """A paragraph the critic judged (a row of ``metadata["self_rag"]["paragraphs"]``): its
    ``node_id``, the ``judgement`` (``answer``, ``relevance``, ``support``, ``utility``,
    ``seq_score``, ``error``) and its final ``score`` (``None`` when the critic failed on it).
    Sent again for the same paragraph when a regenerated answer replaces its judgement.
    """

    node_id: str
    judgement: ParagraphJudgement
    score: float | None

    @classmethod
    def class_name(cls) -> str:
        """Name used in serialisation."""
        return "ParagraphJudgedEvent"


class AnswerChosenEvent(BaseEvent):
    """The paragraph whose answer is the response (``metadata["self_rag"]["best"]``):
    ``node_id`` and ``score``, both ``None`` when the model answers alone.
    """

    node_id: str | None
    score: float | None

    @classmethod
    def class_name(cls) -> str:
        """Name used in serialisation."""
        return "AnswerChosenEvent"


class SegmentCitedEvent(BaseEvent):
    """A segment of the long-form answer, in the answer's order (a row of
    ``metadata["self_rag"]["segments"]``): its ``text``, the passage it came from
    (``node_id``), the number that cites it (``citation``; ``None`` for a segment with no
    text) and its ``score``.
    """

    text: str
    node_id: str
    citation: int | None
    score: float

    @classmethod
    def class_name(cls) -> str:
        """Name used in serialisation."""
        return "SegmentCitedEvent"
