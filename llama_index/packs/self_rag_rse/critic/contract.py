"""The contract between the Self-RAG engine and its critics.

A critic answers three questions for the engine: should we retrieve for this query, what does the
model answer from each paragraph (and how relevant, supported and useful is that answer), and what
does it answer with no evidence at all. :class:`BaseCritic` is that contract, as
``BaseNodePostprocessor`` is for postprocessors: the reflection-token critics (llama.cpp in-process,
served models) and the prompted critic (any LlamaIndex LLM) subclass it, so the engine never knows
which one it drives.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from llama_index.core.prompts.mixin import PromptDictType, PromptMixin, PromptMixinType

from llama_index.packs.self_rag_rse.common.bridge import iterate_sync, run_sync


@dataclass
class RetrievalDecision:
    """The gate's verdict for one query.

    ``probability`` is p(retrieve) normalised against p(no retrieve), or ``None`` when the critic
    could only read a discrete verdict. ``answer`` is filled when the critic generated the
    no-retrieval answer in the same pass (the reflection critic does, from the same KV cache).
    """

    retrieve: bool
    probability: float | None = None
    answer: str | None = None


@dataclass
class ParagraphJudgement:
    """One paragraph's answer and its three reflection scores.

    ``relevance`` and ``support`` lie in [0, 1], ``utility`` in [-1, 1] (the paper's weights
    -1, -0.5, 0, 0.5, 1 over Utility:1..5). ``seq_score`` is exp(mean token log-prob) of the
    answer when the critic can read log-probs. ``error`` is set, with all scores 0, when this
    paragraph failed but the others did not. ``details`` is free-form, critic-specific trace
    data for the engine's trace (the prompted critic records there how each score was obtained:
    ``"logprobs"``, ``"parsed"`` or ``"fallback"``).
    """

    answer: str
    relevance: float
    support: float
    utility: float
    seq_score: float | None = None
    error: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def score(
        self, w_rel: float = 1.0, w_sup: float = 1.0, w_use: float = 0.5, use_seqscore: bool = False
    ) -> float:
        """Self-RAG's final score: [seq] + w_rel·IsREL + w_sup·IsSUP + w_use·IsUSE.

        ``use_seqscore`` adds the answer's sequence score (exp of the mean token log-prob), which
        favours fluent, confident answers; a critic that cannot read log-probs contributes 0 there.
        """
        total = w_rel * self.relevance + w_sup * self.support + w_use * self.utility
        if use_seqscore and self.seq_score is not None:
            total += self.seq_score
        return float(total)


@dataclass
class Continuation(ParagraphJudgement):
    """One long-form segment: a path continued from one passage, and its scores.

    ``answer`` is the segment's text (reflection tokens and quoted evidence removed, whitespace
    collapsed); ``tokens`` the generated tokens that form it (the boundary or end token left
    out); ``context`` what the path continues from next (its context plus ``tokens``; the
    passage is not kept). ``stop`` says why generation ended: ``"boundary"`` (the model asked
    for evidence again: the path goes on), ``"eos"`` or ``"length"`` (the path is finished), or
    ``"error"`` (then ``error`` says why).
    """

    tokens: list[Any] = field(default_factory=list)
    context: tuple[Any, ...] = ()
    stop: str = "eos"


class BaseCritic(PromptMixin, ABC):
    """What the engine needs from a critic; one subclass per way of judging.

    Subclasses implement the three async methods; the blocking ones run them through the
    package's one sync/async bridge (``common.bridge.run_sync``), so both paths share one
    implementation. ``close`` frees what the critic holds (a llama.cpp context, a worker
    thread), never a model it was given. A critic is a ``PromptMixin``: ``get_prompts()`` lists
    its templates (none by default) and the engine shows them under ``critic:``.
    """

    #: Short name shown in traces: ``"reflection"`` or ``"prompted"``.
    name: str = "critic"

    @abstractmethod
    async def adecide_retrieval(
        self, query: str, threshold: float | None, answer_if_skipped: bool = True
    ) -> RetrievalDecision:
        """Decide whether ``query`` needs evidence (``threshold=None``: greedy decides)."""

    @abstractmethod
    async def ajudge(self, query: str, paragraphs: Sequence[str]) -> list[ParagraphJudgement]:
        """Answer ``query`` from each paragraph and score each answer, in input order."""

    @abstractmethod
    async def agenerate(self, query: str) -> str:
        """Answer ``query`` with no evidence."""

    async def astream_generate(self, query: str) -> AsyncIterator[str]:
        """Answer ``query`` with no evidence, piece by piece as the model writes it.

        The pieces join to :meth:`agenerate`'s answer. This default yields that whole answer
        once; critics whose model can stream (llama.cpp in process, a served model, an LLM with
        ``astream_complete``) override it.
        """
        yield await self.agenerate(query)

    #: Whether :meth:`awrite_segments` works (long form needs a model with Self-RAG's tokens).
    writes_segments: bool = False

    async def astart_path(self, query: str) -> tuple[Any, ...]:
        """The context a long-form answer to ``query`` starts from (the prompt's tokens)."""
        raise NotImplementedError(
            f"the {self.name} critic cannot write long-form answers: long form needs a "
            "Self-RAG model's reflection critic; use the short form (long_form=False)"
        )

    async def awrite_segments(
        self, branches: Sequence[tuple[tuple[Any, ...], str]], boundary_threshold: float | None
    ) -> list[Continuation]:
        """Continue each ``(context, paragraph)`` greedily from ``context + [Retrieval]<paragraph>
        paragraph</paragraph>`` up to the next ``[Retrieval]`` (a boundary), the end of
        generation or ``max_new_tokens``, all branches in one batch, and score each segment.

        ``boundary_threshold``: a generated ``[No Retrieval]`` is a boundary too where
        p([Retrieval]) / (p([Retrieval]) + p([No Retrieval])) exceeds it (``None``: never).
        """
        raise NotImplementedError(
            f"the {self.name} critic cannot write long-form answers: long form needs a "
            "Self-RAG model's reflection critic; use the short form (long_form=False)"
        )

    def decide_retrieval(
        self, query: str, threshold: float | None, answer_if_skipped: bool = True
    ) -> RetrievalDecision:
        """Blocking :meth:`adecide_retrieval`."""
        return run_sync(self.adecide_retrieval(query, threshold, answer_if_skipped))

    def judge(self, query: str, paragraphs: Sequence[str]) -> list[ParagraphJudgement]:
        """Blocking :meth:`ajudge`."""
        return run_sync(self.ajudge(query, paragraphs))

    def generate(self, query: str) -> str:
        """Blocking :meth:`agenerate`."""
        return run_sync(self.agenerate(query))

    def stream_generate(self, query: str) -> Iterator[str]:
        """Blocking :meth:`astream_generate`: pieces arrive as the model writes them."""
        return iterate_sync(astream(self, query))

    def close(self) -> None:
        """Free what the critic holds; the models it was given stay open."""

    def __enter__(self) -> BaseCritic:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- PromptMixin ---------------------------------------------------------------------------

    def _get_prompts(self) -> PromptDictType:
        """No prompts unless the subclass has some."""
        return {}

    def _get_prompt_modules(self) -> PromptMixinType:
        """No sub-modules."""
        return {}

    def _update_prompts(self, prompts_dict: PromptDictType) -> None:
        """Nothing to update unless the subclass has prompts."""


def astream(critic: BaseCritic, query: str) -> AsyncIterator[str]:
    """``critic.astream_generate(query)``, or a ``TypeError`` naming the critic where that is no
    async generator (a plain ``def`` with ``yield``, an ``async def`` that returns).

    The one check of that method: :meth:`BaseCritic.stream_generate` reads the stream through
    it, and so does the engine's checked critic (:mod:`.checked`), which also checks each piece.
    """
    stream = critic.astream_generate(query)
    if not hasattr(stream, "__anext__"):
        # A coroutine that is never awaited warns when it is collected: close it first.
        close = getattr(stream, "close", None)
        if close is not None:
            close()
        raise TypeError(
            f"{type(critic).__name__}.astream_generate must be an async generator (async def "
            f"with yield), got {type(stream).__name__}: write it as an async def that yields "
            "the answer's pieces, or leave it out to stream the agenerate answer in one piece"
        )
    return stream
