"""Doubles whose replies follow a script, shared by the test packages: an LLM and two critics.

``ScriptedLLM(reply)`` answers every completion with ``reply(prompt)``: a string, a
``CompletionResponse`` (to carry log-probs), or an exception, which is raised to fail that call.
It records every prompt, sleeps ``delay`` seconds per call (so concurrent calls overlap) and
counts the most calls in flight at once (``max_active``). Completions emit LlamaIndex's LLM
events like a real LLM's; ``chat_model=True`` makes it report itself as a chat model.

``BlockingCritic`` is a base for test critics written with blocking methods; ``TableCritic``
judges paragraphs, writes text and long-form segments from tables (the flows' branches on
demand).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.llms import CompletionResponse, CustomLLM, LLMMetadata
from llama_index.core.llms.callbacks import llm_completion_callback

from llama_index.packs.self_rag_rse import BaseCritic, ParagraphJudgement, RetrievalDecision
from llama_index.packs.self_rag_rse.critic.contract import Continuation


class ScriptedLLM(CustomLLM):
    """Replies ``reply(prompt)``; records prompts; counts concurrent calls (module docstring)."""

    reply: Any = None
    model: str = "scripted"
    chat_model: bool = False
    delay: float = 0.0
    max_active: int = 0
    prompts: list[str] = Field(default_factory=list)
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)
    _active: int = PrivateAttr(default=0)

    def __init__(self, reply: Callable[[str], Any] | None = None, **kwargs: Any) -> None:
        super().__init__(reply=reply, **kwargs)

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(model_name=self.model, is_chat_model=self.chat_model)

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        with self._in_flight():
            time.sleep(self.delay)
            return self._answer(prompt)

    @llm_completion_callback()
    async def acomplete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponse:
        with self._in_flight():
            await asyncio.sleep(self.delay)
            return self._answer(prompt)

    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> Any:
        raise NotImplementedError("ScriptedLLM does not stream: the tests never ask it to")

    def _answer(self, prompt: str) -> CompletionResponse:
        with self._lock:
            self.prompts.append(prompt)
        reply = self.reply(prompt)
        if isinstance(reply, Exception):
            raise reply
        if isinstance(reply, CompletionResponse):
            return reply
        return CompletionResponse(text=reply)

    @contextmanager
    def _in_flight(self) -> Iterator[None]:
        with self._lock:
            self._active += 1
            self.max_active = max(self.max_active, self._active)
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1


class BlockingCritic(BaseCritic):
    """A test critic written with blocking ``decide_retrieval``, ``judge`` and ``generate``
    (subclasses define them); the async methods call them.
    """

    async def adecide_retrieval(
        self, query: str, threshold: float | None, answer_if_skipped: bool = True
    ) -> RetrievalDecision:
        return self.decide_retrieval(query, threshold, answer_if_skipped)

    async def ajudge(self, query: str, paragraphs: Sequence[str]) -> list[ParagraphJudgement]:
        return self.judge(query, paragraphs)

    async def agenerate(self, query: str) -> str:
        return self.generate(query)


#: What :class:`TableCritic` writes when asked for text it has no script for.
ALONE = "model-only answer"


class TableCritic(BaseCritic):
    """A critic that judges from tables, for flows no real model can be made to take on demand.

    ``table`` maps a paragraph (the text the critic reads) to its ``(relevance, support,
    utility)``; the answer from it is ``answers[paragraph]``, else ``"answer from <paragraph>"``.
    ``per_query`` holds other tables for given questions (the corrective loop's grounded
    prompt, say). ``texts`` maps a
    prompt to what :meth:`agenerate` writes for it (a query2doc passage, a rewrite); any other
    prompt gets :data:`ALONE`. ``gate`` is p(retrieve). ``segments`` maps ``(paragraph, depth)``
    to the long-form segment written from it at that depth (a path's context is the question
    and then the paragraphs it was continued from; depth 1 is the first segment). Every call is
    recorded: ``judged`` (question, paragraphs), ``generated`` (prompts), ``branches``.
    """

    name = "scripted"
    writes_segments = True

    def __init__(
        self,
        table: dict[str, tuple[float, float, float]],
        *,
        per_query: dict[str, dict[str, tuple[float, float, float]]] | None = None,
        texts: dict[str, str] | None = None,
        gate: float = 0.9,
        segments: dict[tuple[str, int], Continuation] | None = None,
        answers: dict[str, str] | None = None,
    ) -> None:
        self.table = table
        self.answers = answers or {}
        self.per_query = per_query or {}
        self.texts = texts or {}
        self.gate = gate
        self.segments = segments or {}
        self.judged: list[tuple[str, list[str]]] = []
        self.generated: list[str] = []
        self.branches: list[list[tuple[tuple[Any, ...], str]]] = []

    async def adecide_retrieval(
        self, query: str, threshold: float | None, answer_if_skipped: bool = True
    ) -> RetrievalDecision:
        bar = 0.5 if threshold is None else threshold
        retrieve = self.gate > bar
        answer = None
        if not retrieve and answer_if_skipped:
            answer = await self.agenerate(query)
        return RetrievalDecision(retrieve=retrieve, probability=self.gate, answer=answer)

    async def ajudge(self, query: str, paragraphs: Sequence[str]) -> list[ParagraphJudgement]:
        self.judged.append((query, list(paragraphs)))
        table = self.per_query.get(query, self.table)
        judgements = []
        for paragraph in paragraphs:
            relevance, support, utility = table[paragraph]
            judgement = ParagraphJudgement(
                answer=self.answers.get(paragraph, f"answer from {paragraph}"),
                relevance=relevance,
                support=support,
                utility=utility,
            )
            judgements.append(judgement)
        return judgements

    async def agenerate(self, query: str) -> str:
        self.generated.append(query)
        return self.texts.get(query, ALONE)

    async def astart_path(self, query: str) -> tuple[Any, ...]:
        return (query,)

    async def awrite_segments(
        self, branches: Sequence[tuple[tuple[Any, ...], str]], boundary_threshold: float | None
    ) -> list[Continuation]:
        self.branches.append(list(branches))
        written = []
        for context, paragraph in branches:
            depth = len(context)
            script = self.segments[(paragraph, depth)]
            segment = dataclasses.replace(script, context=(*context, paragraph))
            written.append(segment)
        return written
