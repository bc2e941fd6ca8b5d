"""Counting the answering model's calls during a query, through LlamaIndex instrumentation.

Two kinds of call reach the answering model:

* **LLM requests**: ``LLMChatStartEvent`` / ``LLMCompletionStartEvent`` of any LlamaIndex LLM. A
  request made inside another one (``LlamaCPP.chat`` calls its own ``complete``, and both emit a
  start event) counts once: a context variable tracks the nesting depth, per thread and per
  asyncio task, so concurrent requests are still counted apart.
* **Critic operations served without an LLM request**: a Self-RAG critic running in process on
  llama.cpp decodes directly (a retrieval decision, one judgement of all paragraphs in batched
  decodes, one generation), and no LLM event is emitted. Each span of a
  :class:`~llama_index.packs.self_rag_rse.self_rag.contract.Critic` method (``adecide_retrieval``,
  ``ajudge``, ``agenerate``) in which no LLM request happened counts as one call. A critic that
  goes through an LLM (a served model) is counted by its LLM requests instead, never twice.

Every critic of this package emits these spans (prompted, reflection in process, served
reflection); a critic of your own is seen once its three methods carry ``@dispatcher.span``.
"""

from __future__ import annotations

import contextvars
import inspect
import threading
from types import TracebackType
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
from llama_index.core.instrumentation.span import BaseSpan
from llama_index.core.instrumentation.span_handlers import BaseSpanHandler

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
        root = get_dispatcher()
        root.add_event_handler(self._events)
        root.add_span_handler(self._spans)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        root = get_dispatcher()
        if self._events in root.event_handlers:
            root.event_handlers.remove(self._events)
        if self._spans in root.span_handlers:
            root.span_handlers.remove(self._spans)

    # -- called by the sinks ----------------------------------------------------------------
    def _on_event(self, event: BaseEvent) -> None:
        if isinstance(event, (LLMChatStartEvent, LLMCompletionStartEvent)):
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
        elif isinstance(event, (LLMChatEndEvent, LLMCompletionEndEvent)):
            _DEPTH.set(max(0, _DEPTH.get() - 1))

    def _on_span(self, id_: str, parent: str | None, instance: Any) -> None:
        method = id_.rsplit("-", 5)[0].rsplit(".", 1)[-1]
        is_critic = method in CRITIC_METHODS and _is_critic(instance)
        with self._lock:
            self._parents[id_] = parent
            if is_critic:
                self._critic_spans.add(id_)


def _is_critic(instance: Any) -> bool:
    from llama_index.packs.self_rag_rse.self_rag.contract import Critic

    return instance is not None and isinstance(instance, Critic)


class _EventSink(BaseEventHandler):
    owner: Any = None

    @classmethod
    def class_name(cls) -> str:
        return "ModelCallCounterEvents"

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        self.owner._on_event(event)


class _SpanSink(BaseSpanHandler[BaseSpan]):
    owner: Any = None

    @classmethod
    def class_name(cls) -> str:
        return "ModelCallCounterSpans"

    def new_span(
        self,
        id_: str,
        bound_args: inspect.BoundArguments,
        instance: Any | None = None,
        parent_span_id: str | None = None,
        tags: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> BaseSpan | None:
        self.owner._on_span(id_, parent_span_id, instance)
        return None

    def prepare_to_exit_span(
        self,
        id_: str,
        bound_args: inspect.BoundArguments,
        instance: Any | None = None,
        result: Any | None = None,
        **kwargs: Any,
    ) -> BaseSpan | None:
        return None

    def prepare_to_drop_span(
        self,
        id_: str,
        bound_args: inspect.BoundArguments,
        instance: Any | None = None,
        err: BaseException | None = None,
        **kwargs: Any,
    ) -> BaseSpan | None:
        return None
