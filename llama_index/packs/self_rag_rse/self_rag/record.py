"""What one query did, as typed entries: the record behind ``metadata["self_rag"]``.

The engine starts a :class:`QueryRecord` per query; the gate, :func:`~.short_form.short_form`
and :func:`~.long_form.long_form` write into it, each fact through one method of its kind:
:meth:`~QueryRecord.decided` (the gate), :meth:`~QueryRecord.judged` (a paragraph),
:meth:`~QueryRecord.regenerated`, :meth:`~QueryRecord.choose` (the answer's paragraph),
:meth:`~QueryRecord.cite` (a long-form segment) and :meth:`~QueryRecord.add` (a trace step,
one small dataclass per kind of step). Code that asks what happened (was query2doc tried? why
was there nothing to judge?) reads the typed steps back (:meth:`~QueryRecord.steps`), and the
``verbose=True`` tables (:mod:`.trace`) print from the record.

:meth:`QueryRecord.to_metadata` turns the record into the dict users read, with the keys, their
order and their values of every release so far.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, TypeVar

from llama_index.core.schema import NodeWithScore

from llama_index.packs.self_rag_rse.common import tracing
from llama_index.packs.self_rag_rse.critic.contract import Continuation, ParagraphJudgement
from llama_index.packs.self_rag_rse.self_rag.events import (
    AnswerChosenEvent,
    ParagraphJudgedEvent,
    SegmentCitedEvent,
    SelfRAGStepEvent,
)

S = TypeVar("S", bound="Step")


# -- trace steps: one dataclass per kind; each gives its dict of metadata["self_rag"]["trace"] --


@dataclass(frozen=True)
class Step:
    """One entry of the query's trace; ``kind`` is its ``"step"`` value, named on the class line
    of each kind (``class Decide(Step, kind="decide")``).
    """

    kind: ClassVar[str]

    def __init_subclass__(cls, kind: str = "") -> None:
        cls.kind = kind

    def as_dict(self) -> dict[str, Any]:
        """The entry as the trace shows it: ``{"step": kind}``, then the step's fields in the
        order they are declared (rows of a list as dicts too).
        """
        return {"step": self.kind, **asdict(self)}


@dataclass(frozen=True)
class Generate(Step, kind="generate"):
    """The model answers alone, without a gate (``mode="no_retrieval"``)."""

    reason: str = "mode=no_retrieval"


@dataclass(frozen=True)
class Decide(Step, kind="decide"):
    """The gate's verdict: retrieve or not, and p(retrieve) when the critic read one."""

    retrieve: bool
    probability: float | None


@dataclass(frozen=True, kw_only=True)
class Retrieve(Step, kind="retrieve"):
    """One retrieval: where it ran (short form's ``round`` or long form's ``depth``), its search
    text and how many paragraphs it gave; when a postprocessor kept none of the ``retrieved``
    nodes, which one (``dropped_by``) and why (``reason``).
    """

    round: int | None = None
    depth: int | None = None
    query: str
    nodes: int
    retrieved: int = 0
    dropped_by: str | None = None
    reason: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The retrieval's entry: where it ran, not the other place (``None``); the
        postprocessor's part only when one dropped every node.
        """
        entry = {key: value for key, value in super().as_dict().items() if value is not None}
        if self.dropped_by is None:
            del entry["retrieved"]
        return entry


@dataclass(frozen=True)
class SkipEmpty(Step, kind="skip_empty"):
    """Retrieved paragraphs with no text, left out of judging."""

    node_ids: list[str]
    reason: str = "paragraph has no text"


@dataclass(frozen=True)
class NewSearch(Step):
    """The corrective loop searches next with a text the model wrote (``query``), for
    ``reason``; an empty one stands for the question. A text searched already is not searched
    again: a :class:`Repeated` step follows, and the rounds end.
    """

    reason: str
    query: str


@dataclass(frozen=True)
class Query2Doc(NewSearch, kind="query2doc"):
    """A new search with a pseudo-document the model wrote (query2doc)."""


@dataclass(frozen=True)
class Rewrite(NewSearch, kind="rewrite"):
    """A new search with a query the model rewrote."""


@dataclass(frozen=True)
class Regenerate(Step, kind="regenerate"):
    """One regeneration of the chosen paragraph's unsupported answer, and its new support."""

    attempt: int
    support: float
    node_id: str


@dataclass(frozen=True)
class Repeated(Step, kind="repeated"):
    """The corrective loop's attempt just before (a regeneration, or a new search's text)
    repeats an earlier one, so the loop tries no more of that kind (``reason`` says which).
    """

    reason: str


@dataclass(frozen=True)
class NextBest(Step, kind="next_best"):
    """Regeneration failed: the answer comes from the next paragraph whose answer is supported."""

    node_id: str


@dataclass(frozen=True)
class KeepBest(Step, kind="keep_best"):
    """Regeneration failed and no paragraph supports its answer: the best one stays."""

    reason: str = "no paragraph supports its answer"


@dataclass(frozen=True)
class Fallback(Step, kind="fallback"):
    """No paragraph's answer can be the response: the model answers alone (``reason`` says why)."""

    reason: str


@dataclass(frozen=True)
class NoAnswer(Step, kind="no_answer"):
    """The answer had no text: the response says so (:data:`~.flow.NO_ANSWER`)."""

    reason: str = "the model generated no text"


@dataclass(frozen=True)
class DepthRow:
    """One candidate path of a long-form depth (new or carried over), and its last segment:
    ``segment`` is its text, then its scores (no segment yet: ``""`` and no scores).
    """

    rank: int
    kept: bool
    finished: bool
    path_score: float
    node_ids: list[str]
    segment: str = ""
    relevance: float | None = None
    support: float | None = None
    utility: float | None = None
    score: float | None = None


@dataclass(frozen=True)
class Depth(Step, kind="depth"):
    """One depth of long form's beam search: every candidate path, best first."""

    depth: int
    candidates: list[DepthRow]


@dataclass(frozen=True)
class OnPath(Step):
    """A step on one long-form path (``path``: its place in the beam) at a ``depth``."""

    depth: int
    path: int


@dataclass(frozen=True)
class SegmentFailed(OnPath, kind="segment_failed"):
    """A long-form continuation from passage ``node_id`` that failed (``error``); its path goes
    on without it.
    """

    node_id: str
    error: str


@dataclass(frozen=True)
class PathFinished(OnPath, kind="path_finished"):
    """A long-form path that could not be continued at a depth (``reason`` says why)."""

    reason: str


# -- what the steps are about: judged paragraphs, cited segments ---------------------------------


@dataclass(eq=False)
class Paragraph:
    """One judged paragraph: its node, the critic's judgement and its final score (both replaced
    when a regenerated answer is kept). Compared by identity: the same node retrieved twice is
    two paragraphs.
    """

    node: NodeWithScore
    judgement: ParagraphJudgement
    score: float

    @property
    def node_id(self) -> str:
        """The paragraph's node id."""
        return self.node.node.node_id

    @property
    def reported_score(self) -> float | None:
        """The final score, or ``None`` for a paragraph the critic failed on."""
        return self.score if self.judgement.error is None else None

    def as_dict(self) -> dict[str, Any]:
        """The row of ``metadata["self_rag"]["paragraphs"]``; ``error`` and ``details`` only
        when there are some.
        """
        judgement = self.judgement
        error = {"error": judgement.error} if judgement.error is not None else {}
        details = {"details": judgement.details} if judgement.details else {}
        return {
            "node_id": self.node_id,
            "answer": judgement.answer,
            "relevance": judgement.relevance,
            "support": judgement.support,
            "utility": judgement.utility,
            "seq_score": judgement.seq_score,
            "score": self.reported_score,
            **error,
            **details,
        }


@dataclass(frozen=True)
class Segment:
    """One segment of a long-form path: what the critic wrote (``written``), from which passage,
    its score, and, once the path is the answer, the number its passage is cited by (``None``
    before, and for a segment with no text).
    """

    written: Continuation
    passage: NodeWithScore
    score: float
    citation: int | None = None

    @property
    def node_id(self) -> str:
        """The passage's node id."""
        return self.passage.node.node_id

    def as_dict(self) -> dict[str, Any]:
        """The row of ``metadata["self_rag"]["segments"]``."""
        segment = self.written
        # Tokens of the passage the critic left out to fit its n_ctx (0: read whole).
        passage_cut = int(segment.details.get("passage_cut", 0))
        return {
            "text": segment.answer,
            "node_id": self.node_id,
            "citation": self.citation,
            "relevance": segment.relevance,
            "support": segment.support,
            "utility": segment.utility,
            "seq_score": segment.seq_score,
            "score": self.score,
            "passage_cut": passage_cut,
        }


# -- the record ---------------------------------------------------------------------------------


@dataclass
class QueryRecord:
    """Everything one query did (see the module docstring); ``critic`` is the critic's name.

    ``retrieved`` says whether the answer had evidence to come from (``metadata``'s
    ``"retrieve"``).
    """

    critic: str
    long_form: bool = False
    retrieved: bool = False
    retrieve_probability: float | None = None
    paragraphs: list[Paragraph] = field(default_factory=list)
    best: int | None = None
    segments: list[Segment] = field(default_factory=list)
    trace: list[Step] = field(default_factory=list)
    _metadata: dict[str, Any] | None = field(default=None, init=False, repr=False, compare=False)

    def add(self, step: Step) -> None:
        """Append ``step`` to the trace (and to the metadata already handed out, if any)."""
        self.trace.append(step)
        tracing.emit(SelfRAGStepEvent, step=step)
        if self._metadata is not None:
            self._metadata["trace"].append(step.as_dict())

    def decided(self, retrieve: bool, probability: float | None) -> None:
        """The gate's verdict and p(retrieve) (``None``: the critic read no probability)."""
        self.retrieve_probability = probability
        self.add(Decide(retrieve=retrieve, probability=probability))

    def judged(self, node: NodeWithScore, judgement: ParagraphJudgement, score: float) -> None:
        """Add a judged paragraph (a row of :attr:`paragraphs`: the short form's candidates)."""
        paragraph = Paragraph(node=node, judgement=judgement, score=score)
        self.paragraphs.append(paragraph)
        tracing.emit(
            ParagraphJudgedEvent,
            node_id=paragraph.node_id,
            judgement=judgement,
            score=paragraph.reported_score,
        )

    def regenerated(
        self, paragraph: Paragraph, judgement: ParagraphJudgement, score: float
    ) -> None:
        """Keep a regenerated answer for ``paragraph``, with its judgement and score."""
        paragraph.judgement = judgement
        paragraph.score = score
        tracing.emit(
            ParagraphJudgedEvent,
            node_id=paragraph.node_id,
            judgement=judgement,
            score=paragraph.reported_score,
        )

    def choose(self, chosen: Paragraph | None) -> None:
        """The paragraph whose answer is the response (``None``: the model answers alone)."""
        # Found by identity: see Paragraph.
        self.best = None if chosen is None else self.paragraphs.index(chosen)
        if chosen is None:
            tracing.emit(AnswerChosenEvent, node_id=None, score=None)
        else:
            tracing.emit(AnswerChosenEvent, node_id=chosen.node_id, score=chosen.reported_score)

    def cite(self, segment: Segment) -> None:
        """Add a segment of the long-form answer (in the answer's order)."""
        self.segments.append(segment)
        tracing.emit(
            SegmentCitedEvent,
            text=segment.written.answer,
            node_id=segment.node_id,
            citation=segment.citation,
            score=segment.score,
        )

    def steps(self, kind: type[S]) -> list[S]:
        """The trace's steps of one kind, in order."""
        return [step for step in self.trace if isinstance(step, kind)]

    @property
    def path_score(self) -> float | None:
        """Long form: the answer's path score, the mean of its segments' (``None``: none)."""
        scores = [segment.score for segment in self.segments]
        return sum(scores) / len(scores) if scores else None

    @property
    def depth(self) -> int:
        """How many depths long form searched."""
        return len(self.steps(Depth))

    @property
    def beams(self) -> list[list[dict[str, Any]]]:
        """Long form's beam after each depth: the kept paths' scores and passages."""
        beams = []
        for step in self.steps(Depth):
            beams.append(
                [
                    {"score": row.path_score, "node_ids": list(row.node_ids)}
                    for row in step.candidates
                    if row.kept
                ]
            )
        return beams

    def to_metadata(self) -> dict[str, Any]:
        """``metadata["self_rag"]``: the record as users read it. The dict is kept: a step
        added later (a streamed answer found empty once read) appears in its trace too.
        """
        long_form: dict[str, Any] = {}
        if self.long_form:
            long_form = {
                "long_form": True,
                "segments": [segment.as_dict() for segment in self.segments],
                "path_score": self.path_score,
                "depth": self.depth,
                "beams": self.beams,
            }
        self._metadata = {
            "critic": self.critic,
            "retrieve": self.retrieved,
            "retrieve_prob": self.retrieve_probability,
            "best": self.best,
            "paragraphs": [paragraph.as_dict() for paragraph in self.paragraphs],
            "trace": [step.as_dict() for step in self.trace],
            **long_form,
        }
        return self._metadata
