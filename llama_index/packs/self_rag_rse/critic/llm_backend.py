"""The critic backend for any LlamaIndex LLM: one call per prompt, run concurrently.

Each prompt becomes one ``achat`` (chat models, with the LLM's system prompt) or ``acomplete``
call; at most ``num_workers`` run at once per event loop. Label probabilities come from the
response's token log-probs when it carries them (``ChatResponse.logprobs``, e.g. OpenAI with
``logprobs=True, top_logprobs=5``); otherwise the reply is parsed tolerantly
(:func:`~.labels.parse_reply`) and an unreadable reply falls back to the scale's neutral score.
Log-probs that no probability has (NaN, ±inf, above 0) are not scored: the reply is read as if
there were none, and the judgement's ``details["notes"]`` names the position and token (logged
once per backend).
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.llms import LLM
from llama_index.core.prompts import BasePromptTemplate

from llama_index.packs.self_rag_rse.common.options import require_counts
from llama_index.packs.self_rag_rse.critic.backend import CriticBackend, Generated, Scored, Values
from llama_index.packs.self_rag_rse.critic.labels import (
    InvalidLogprob,
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
        return Scored(
            score=reading.score,
            method=reading.method,
            note=reading.note,
            generated_tokens=tokens,
        )
    return Scored(
        score=scale.fallback,
        method="fallback",
        note=reading.note or "unreadable reply",
        generated_tokens=tokens,
    )


class LLMBackend(CriticBackend):
    """:class:`~.backend.CriticBackend` over any LlamaIndex ``LLM``.

    Args:
        llm: the LLM to call.
        llm_kwargs: extra keyword arguments for every ``achat``/``acomplete`` call (e.g.
            ``{"max_tokens": 8}``).
        num_workers: most calls in flight at once (per event loop).
    """

    def __init__(
        self, llm: LLM, llm_kwargs: Mapping[str, Any] | None = None, num_workers: int = 4
    ) -> None:
        require_counts("LLMBackend", num_workers=num_workers)
        self.llm = llm
        self.llm_kwargs = dict(llm_kwargs or {})
        self.num_workers = num_workers
        # A semaphore belongs to the loop it first waits on: keep one per loop.
        self._limits: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )
        self._warned_logprobs = False

    def _prompt(self, template: BasePromptTemplate, values: Values) -> list[ChatMessage] | str:
        """A chat model's messages (with the LLM's system prompt), or a completion model's text
        (after the system prompt).
        """
        system = self.llm.system_prompt
        if self.llm.metadata.is_chat_model:
            return with_system(template.format_messages(**dict(values)), system)
        text = template.format(**dict(values))
        return f"{system}\n\n{text}" if system else text

    async def call(self, template: BasePromptTemplate, values: Values) -> Reply:
        """Ask once; chat models get a user message (plus the LLM's system prompt)."""
        prompt = self._prompt(template, values)
        async with self._limit():
            if isinstance(prompt, str):
                done: Any = await self.llm.acomplete(prompt, **self.llm_kwargs)
                text = done.text
            else:
                done = await self.llm.achat(prompt, **self.llm_kwargs)
                text = done.message.content or ""
        return Reply(text, _logprob_pairs(done.logprobs), _usage(done.raw))

    async def astream(self, template: BasePromptTemplate, values: Values) -> AsyncIterator[str]:
        """One answer through the LLM's ``astream_chat``/``astream_complete``; an LLM that does
        not stream (``NotImplementedError``) answers in one piece.
        """
        prompt = self._prompt(template, values)
        stream: AsyncIterator[Any] | None = None
        first: Any = None
        async with self._limit():
            try:
                if isinstance(prompt, str):
                    stream = await self.llm.astream_complete(prompt, **self.llm_kwargs)
                else:
                    stream = await self.llm.astream_chat(prompt, **self.llm_kwargs)
                first = await anext(stream, None)
            except NotImplementedError:
                stream = None
        if stream is None:  # outside the limit: the one-piece answer takes its own slot
            async for piece in super().astream(template, values):
                yield piece
            return
        if first is not None:
            yield first.delta or ""
        async for item in stream:
            yield item.delta or ""

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
        ignored = None
        if reply.logprobs:
            try:
                label_lps = label_logprobs_from_top(reply.logprobs, scale)
            except InvalidLogprob as exc:
                ignored = f"log-probs ignored ({exc}), reply read instead"
                self._warn_logprobs(ignored)
            else:
                if label_lps is not None:
                    return Scored(
                        score=scale.expected_value(label_lps),
                        method="logprobs",
                        generated_tokens=reply.generated_tokens,
                    )
        scored = fallback_score(scale, parse_reply(reply.text, scale), reply.generated_tokens)
        if ignored:
            scored.note = f"{ignored}; {scored.note}" if scored.note else ignored
        return scored

    def _warn_logprobs(self, what: str) -> None:
        if not self._warned_logprobs:
            self._warned_logprobs = True
            logger.warning(
                "%s returned log-probs no probability has: %s (flagged in each judgement's "
                "details['notes'], logged once); check the LLM's logprobs output",
                type(self.llm).__name__,
                what,
            )

    def _limit(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        for closed in [old for old in self._limits if old.is_closed()]:
            del self._limits[closed]  # a semaphore holds its loop: the weak key never lets go
        return self._limits.setdefault(loop, asyncio.Semaphore(self.num_workers))


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
    value = raw
    for name in ("usage", "completion_tokens"):  # absent anywhere: None from there on
        value = value.get(name) if isinstance(value, Mapping) else getattr(value, name, None)
    # A count: bool is an int to Python, and a negative one is no count.
    is_count = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    return value if is_count else None
