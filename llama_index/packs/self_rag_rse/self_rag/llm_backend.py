"""The critic backend for any LlamaIndex LLM: one call per prompt, run concurrently.

Each prompt becomes one ``achat`` (chat models, with the LLM's system prompt) or ``acomplete``
call; at most ``num_workers`` run at once per event loop. Label probabilities come from the
response's token log-probs when it carries them (``ChatResponse.logprobs``, e.g. OpenAI with
``logprobs=True, top_logprobs=5``); otherwise the reply is parsed tolerantly
(:func:`~.labels.parse_reply`) and an unreadable reply falls back to the scale's neutral score.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.llms import LLM
from llama_index.core.prompts import BasePromptTemplate

from llama_index.packs.self_rag_rse.self_rag.backend import CriticBackend, Generated, Scored, Values
from llama_index.packs.self_rag_rse.self_rag.labels import (
    LabelScale,
    Reading,
    label_logprobs_from_top,
    parse_reply,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class Reply:
    """One LLM reply: text, top log-probs per position (when returned), tokens generated."""

    text: str
    logprobs: list[list[tuple[str, float]]] | None
    generated_tokens: int | None


def with_system(messages: list[ChatMessage], system: str | None) -> list[ChatMessage]:
    """Prepend the LLM's system prompt unless the messages already have one."""
    if system and not any(m.role == MessageRole.SYSTEM for m in messages):
        return [ChatMessage(role=MessageRole.SYSTEM, content=system), *messages]
    return list(messages)


def fallback_score(scale: LabelScale, reading: Reading, tokens: int | None) -> Scored:
    """A parsed reply's score, or the scale's neutral score when it could not be read."""
    if reading.score is not None:
        return Scored(reading.score, reading.method, reading.note, tokens)
    return Scored(scale.fallback, "fallback", reading.note or "unreadable reply", tokens)


class LLMBackend(CriticBackend):
    """:class:`~.backend.CriticBackend` over any LlamaIndex ``LLM``.

    Args:
        llm: the LLM to call.
        llm_kwargs: extra keyword arguments for every ``achat``/``acomplete`` call (e.g.
            ``{"max_tokens": 8}``).
        num_workers: most calls in flight at once (per event loop).
    """

    prompt_format = "llm"

    def __init__(
        self, llm: LLM, llm_kwargs: Mapping[str, Any] | None = None, num_workers: int = 4
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.llm = llm
        self.llm_kwargs = dict(llm_kwargs or {})
        self.num_workers = num_workers
        # A semaphore belongs to the loop it first waits on: keep one per loop.
        self._limits: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )

    async def call(self, template: BasePromptTemplate, values: Values) -> Reply:
        """Ask once; chat models get a user message (plus the LLM's system prompt)."""
        llm = self.llm
        async with self._limit():
            if llm.metadata.is_chat_model:
                messages = with_system(template.format_messages(**dict(values)), llm.system_prompt)
                chat = await llm.achat(messages, **self.llm_kwargs)
                return Reply(
                    chat.message.content or "", _logprob_pairs(chat.logprobs), _usage(chat.raw)
                )
            text = template.format(**dict(values))
            if llm.system_prompt:
                text = f"{llm.system_prompt}\n\n{text}"
            completion = await llm.acomplete(text, **self.llm_kwargs)
        return Reply(completion.text, _logprob_pairs(completion.logprobs), _usage(completion.raw))

    async def generate(
        self, template: BasePromptTemplate, values: Sequence[Values]
    ) -> list[Generated | Exception]:
        """One call per prompt, concurrently."""
        return await _gather(self._generate_one(template, v) for v in values)

    async def score(
        self, scale: LabelScale, template: BasePromptTemplate, values: Sequence[Values]
    ) -> list[Scored | Exception]:
        """One call per prompt, concurrently; log-probs when returned, else the parsed reply."""
        return await _gather(self._score_one(scale, template, v) for v in values)

    async def _generate_one(self, template: BasePromptTemplate, values: Values) -> Generated:
        reply = await self.call(template, values)
        return Generated(reply.text.strip(), None, reply.generated_tokens)

    async def _score_one(
        self, scale: LabelScale, template: BasePromptTemplate, values: Values
    ) -> Scored:
        reply = await self.call(template, values)
        if reply.logprobs:
            label_lps = label_logprobs_from_top(reply.logprobs, scale)
            if label_lps is not None:
                return Scored(
                    scale.expected_value(label_lps), "logprobs", None, reply.generated_tokens
                )
        return fallback_score(scale, parse_reply(reply.text, scale), reply.generated_tokens)

    def _limit(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        limit = self._limits.get(loop)
        if limit is None:
            limit = self._limits[loop] = asyncio.Semaphore(self.num_workers)
        return limit

    def describe(self) -> dict[str, Any]:
        """Backend, LLM class and model name."""
        return {
            **super().describe(),
            "llm": type(self.llm).__name__,
            "model": getattr(self.llm.metadata, "model_name", None),
        }


async def _gather(jobs: Any) -> list[Any]:
    """Run jobs together; each job's exception becomes its result."""
    return list(await asyncio.gather(*(_guard(job) for job in jobs)))


async def _guard(job: Awaitable[T]) -> T | Exception:
    """Turn one prompt's exception into a value, so it cannot sink the others."""
    try:
        return await job
    except Exception as exc:
        logger.warning("critic call failed: %r", exc)
        return exc


def _logprob_pairs(logprobs: Any) -> list[list[tuple[str, float]]] | None:
    if not logprobs:
        return None
    return [[(lp.token, float(lp.logprob)) for lp in position] for position in logprobs]


def _usage(raw: Any) -> int | None:
    """Completion tokens from an OpenAI-style ``usage`` (dict or object), when present."""
    usage = raw.get("usage") if isinstance(raw, Mapping) else getattr(raw, "usage", None)
    if usage is None:
        return None
    value = (
        usage.get("completion_tokens")
        if isinstance(usage, Mapping)
        else getattr(usage, "completion_tokens", None)
    )
    return int(value) if isinstance(value, int) else None
