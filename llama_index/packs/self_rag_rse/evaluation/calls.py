"""Counting the answering model's calls during a query, through LlamaIndex instrumentation.

**LLM requests** are the ``LLMChatStartEvent``/``LLMCompletionStartEvent`` of any LlamaIndex LLM;
one made inside another (``LlamaCPP.chat`` calls its own ``complete``) counts once, by a nesting
depth in a context variable (per thread and asyncio task). **Critic operations** of a Self-RAG
critic decoding in process emit no LLM event: each span of a :class:`BaseCritic` method
(``adecide_retrieval``, ``ajudge``, ``agenerate``) in which no LLM request happened counts as one
call, so a critic on an LLM (a served model) is counted by its requests, never twice. A critic
of yours is seen once its three methods carry ``@dispatcher.span``.
"""

from __future__ import annotations

import contextvars
import threading
from typing import Any

from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events.llm import (
    LLMChatEndEvent,
    LLMChatStartEvent,
    LLMCompletionEndEvent,
    LLMCompletionStartEvent,
)
from llama_index.core.instrumentation.span_handlers import NullSpanHandler

from llama_index.packs.self_rag_rse.self_rag.contract import BaseCritic

#: Methods of the critic contract whose spans count as model calls.
CRITIC_METHODS = frozenset({"adecide_retrieval", "ajudge", "agenerate"})

_DEPTH: contextvars.ContextVar[int] = contextvars.ContextVar("self_rag_rse_llm_depth", default=0)


class ModelCallCounter:
    """Counts the calls described in the module docstring while attached (``with counter:``).

    Example::

        with ModelCallCounter() as counter:
            engine.query("...")
        counter.counts()  # {"llm_requests": 0, "critic_calls": 3, "model_calls": 3}

    Counts every call in the process while attached: attach it around the answering work only.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events = _EventSink(owner=self)
        self._spans = _SpanSink()  # BaseSpanHandler's __init__ takes no extra fields
        self._spans.owner = self
        self.reset()

    def reset(self) -> None:
        """Start counting from zero."""
        with self._lock:
            self._llm = 0
            self._parents: dict[str, str | None] = {}
            self._critic_spans: set[str] = set()
            self._critic_with_llm: set[str] = set()

    def counts(self) -> dict[str, int]:
        """``llm_requests``, ``critic_calls`` (those served without one) and ``model_calls``."""
        with self._lock:
            native = len(self._critic_spans - self._critic_with_llm)
            return {
                "llm_requests": self._llm,
                "critic_calls": native,
                "model_calls": self._llm + native,
            }

    def __enter__(self) -> ModelCallCounter:
        get_dispatcher().add_event_handler(self._events)
        get_dispatcher().add_span_handler(self._spans)
        return self

    def __exit__(self, *exc_info: object) -> None:
        root = get_dispatcher()
        root.event_handlers[:] = [h for h in root.event_handlers if h is not self._events]
        root.span_handlers[:] = [h for h in root.span_handlers if h is not self._spans]

    def _on_event(self, event: BaseEvent) -> None:
        if isinstance(event, (LLMChatEndEvent, LLMCompletionEndEvent)):
            _DEPTH.set(max(0, _DEPTH.get() - 1))
        if not isinstance(event, (LLMChatStartEvent, LLMCompletionStartEvent)):
            return
        depth = _DEPTH.get()
        _DEPTH.set(depth + 1)
        if depth:
            return  # a request made by a request already counted
        with self._lock:
            self._llm += 1
            span: str | None = event.span_id
            while span is not None:
                if span in self._critic_spans:
                    self._critic_with_llm.add(span)
                span = self._parents.get(span)

    def _on_span(self, id_: str, parent: str | None, instance: Any) -> None:
        method = id_.rsplit("-", 5)[0].rsplit(".", 1)[-1]  # "Class.method-<uuid>"
        with self._lock:
            self._parents[id_] = parent
            if method in CRITIC_METHODS and isinstance(instance, BaseCritic):
                self._critic_spans.add(id_)


class _EventSink(BaseEventHandler):
    owner: Any = None

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        self.owner._on_event(event)


class _SpanSink(NullSpanHandler):
    """Sees each span open (with the instance whose method it wraps); keeps no span."""

    owner: Any = None

    def span_enter(self, *args: Any, **kwargs: Any) -> None:
        """Record the span (the dispatcher passes ``id_``, ``instance``, ``parent_id`` by name)."""
        self.owner._on_span(kwargs["id_"], kwargs.get("parent_id"), kwargs.get("instance"))
