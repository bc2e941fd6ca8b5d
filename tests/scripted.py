"""Doubles whose replies follow a script, shared by the test packages: an LLM and a critic base.

``ScriptedLLM(reply)`` answers every completion with ``reply(prompt)``: a string, a
``CompletionResponse`` (to carry log-probs), or an exception, which is raised to fail that call.
It records every prompt, sleeps ``delay`` seconds per call (so concurrent calls overlap) and
counts the most calls in flight at once (``max_active``). Completions emit LlamaIndex's LLM
events like a real LLM's; ``chat_model=True`` makes it report itself as a chat model.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.llms import CompletionResponse, CustomLLM, LLMMetadata
from llama_index.core.llms.callbacks import llm_completion_callback

from llama_index.packs.self_rag_rse import BaseCritic, ParagraphJudgement, RetrievalDecision


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
