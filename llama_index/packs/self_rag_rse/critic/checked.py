"""The critic as the engine calls it: every answer checked against the contract on its way in.

A critic is often user code (a subclass of :class:`~.contract.BaseCritic`), and a method that
returns the wrong thing (``None`` for text, one judgement for three paragraphs, a plain
generator for an async one) used to fail deep in the flow: an ``AttributeError`` on a strip, a
failed unpacking, a ``StopIteration`` turned ``RuntimeError``. :class:`CheckedCritic` wraps the
critic the engine was given; the engine and the flow call the critic only through it, so each
return value is checked once, where it arrives, and a broken one raises a ``TypeError`` naming
the critic's class, the method, what it returned and what it should return.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import Any

from llama_index.packs.self_rag_rse.critic.contract import (
    BaseCritic,
    Continuation,
    ParagraphJudgement,
    RetrievalDecision,
    astream,
)


class CheckedCritic:
    """``critic`` with what each of its methods returns checked (see the module docstring).

    The methods are the critic's own, with the same arguments; :meth:`agenerate` writes a
    search text (a query2doc passage, a rewrite), :meth:`aanswer` and :meth:`astream_answer`
    the model's own answer with no evidence, which becomes the response.
    """

    def __init__(self, critic: BaseCritic) -> None:
        #: The critic as it was given (the engine's ``critic`` property returns this one).
        self.critic = critic
        self._owner = type(critic).__name__

    async def adecide_retrieval(
        self, query: str, threshold: float | None, answer_if_skipped: bool
    ) -> RetrievalDecision:
        """The gate's decision; its answer, when retrieval is skipped, is checked as text."""
        decision = await self.critic.adecide_retrieval(query, threshold, answer_if_skipped)
        if not hasattr(decision, "retrieve"):
            raise TypeError(
                f"{self._owner}.adecide_retrieval must return a RetrievalDecision, got "
                f"{decision!r:.80}: return RetrievalDecision(retrieve=..., probability=...)"
            )
        # The answer is read only when the gate skips retrieval: it is then the response.
        answer_is_used = not decision.retrieve and decision.answer is not None
        if answer_is_used and not isinstance(decision.answer, str):
            raise TypeError(
                f"{self._owner}.adecide_retrieval returned an answer that is no text, got "
                f"{decision.answer!r:.80}: set RetrievalDecision.answer to the generated str, "
                "or to None to have the engine ask agenerate"
            )
        return decision

    async def ajudge(self, query: str, paragraphs: Sequence[str]) -> list[ParagraphJudgement]:
        """One judgement per paragraph, in order, each with text as its answer."""
        judged = await self.critic.ajudge(query, paragraphs)
        return self._one_each(
            judged,
            method="ajudge",
            expected=f"one ParagraphJudgement per paragraph ({len(paragraphs)})",
            count=len(paragraphs),
        )

    async def agenerate(self, prompt: str) -> str:
        """The text the critic writes for ``prompt`` (a query2doc passage, a rewrite)."""
        text = await self.critic.agenerate(prompt)
        if not isinstance(text, str):
            raise TypeError(
                f"{self._owner}.agenerate must return text; it returned {text!r:.80}: return "
                'the generated str ("" when the model wrote nothing)'
            )
        return text

    async def aanswer(self, query: str) -> str:
        """The model's own answer to ``query``, with no evidence."""
        answer = await self.critic.agenerate(query)
        return self._answer_text(answer)

    async def astream_answer(self, query: str) -> AsyncGenerator[str, None]:
        """:meth:`aanswer` piece by piece as the model writes it (``astream_generate``);
        closing this stream closes the critic's at once (a reader that stops early frees the
        model's work then, not when the stream is collected).
        """
        stream = astream(self.critic, query)
        try:
            async for piece in stream:
                yield self._answer_text(piece)
        finally:
            close = getattr(stream, "aclose", None)
            if close is not None:
                await close()

    async def astart_path(self, query: str) -> tuple[Any, ...]:
        """The context a long-form answer to ``query`` starts from."""
        return await self.critic.astart_path(query)

    async def awrite_segments(
        self, branches: Sequence[tuple[tuple[Any, ...], str]], boundary_threshold: float | None
    ) -> list[Continuation]:
        """One long-form segment per branch, in order, each with text as its answer."""
        written = await self.critic.awrite_segments(branches, boundary_threshold)
        return self._one_each(
            written,
            method="awrite_segments",
            expected=f"one Continuation per branch ({len(branches)})",
            count=len(branches),
        )

    def _one_each(self, out: Any, *, method: str, expected: str, count: int) -> Any:
        """``out`` when it is a list (or tuple) of ``count`` results whose answers are text."""
        counted = isinstance(out, list | tuple) and len(out) == count
        if not counted or not all(isinstance(getattr(item, "answer", None), str) for item in out):
            raise TypeError(
                f"{self._owner}.{method} must return {expected}, in order, with text answers; "
                f"it returned {out!r:.80}: return a list holding one result per input, its "
                'answer a str ("" when the model wrote nothing; set error= on one that failed)'
            )
        return out

    def _answer_text(self, answer: Any) -> str:
        """``answer`` when it is text: it becomes the response, or a piece of it."""
        if not isinstance(answer, str):
            raise TypeError(
                f"{self._owner}.agenerate, .astream_generate and .ajudge must give text, got "
                f'{answer!r:.80}: return the answer as a str ("" when the model wrote nothing) '
                "and yield a streamed one as str pieces"
            )
        return answer
