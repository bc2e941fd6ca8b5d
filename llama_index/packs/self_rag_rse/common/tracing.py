"""The package's steps in LlamaIndex instrumentation: spans opened by hand, events, model calls.

Core's ``@dispatcher.span`` names a span after the method it wraps and shows all its arguments.
The steps of a Self-RAG query (the gate, a retrieval round, a judgement batch, a long-form
depth) are blocks of one flow rather than methods, and the flow's arguments hold parts that no
tracing tool should copy (a critic, a model). :func:`span` opens a span for such a block, named
for the step, showing only the ``inputs`` given and the ``result`` the block sets, nested under
the caller's span (core's ``active_span_id``, which crosses the package's sync/async bridge and
its worker threads with the rest of the context). :func:`emit` sends one of the package's events.
:class:`ModelCalls` reports the model calls no LlamaIndex LLM makes (the sequences of a batched
llama.cpp decode, a request to a model server) as core's LLM events, with their token counts.

Nothing is built or sent while no handler listens (:func:`observed`): a query then costs what it
cost before tracing existed.
"""

from __future__ import annotations

import inspect
import uuid
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from llama_index.core.base.llms.types import CompletionResponse
from llama_index.core.instrumentation import (
    DISPATCHER_SPAN_DECORATED_ATTR,
    NullEventHandler,
    NullSpanHandler,
    get_dispatcher,
)
from llama_index.core.instrumentation.dispatcher import Dispatcher, active_instrument_tags
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events.llm import (
    LLMCompletionEndEvent,
    LLMCompletionStartEvent,
)
from llama_index.core.instrumentation.events.span import SpanDropEvent
from llama_index.core.instrumentation.span import active_span_id

F = TypeVar("F", bound=Callable[..., Any])

dispatcher = get_dispatcher(__name__)

#: The ``model_dict["class_name"]`` of the LLM events :class:`ModelCalls` sends: the package's
#: own ways of calling a model (a critic's batched llama.cpp decoder, a model server's client).
CRITIC_MODELS = frozenset({"BatchedDecoder", "JSONClient"})


def observed() -> bool:
    """Whether any handler listens: an event or span handler, other than core's null ones, on
    this package's dispatcher or those it passes events on to (the root's, where users attach
    theirs).
    """
    current: Dispatcher | None = dispatcher
    while current is not None:
        handlers = [*current.event_handlers, *current.span_handlers]
        if any(type(handler) not in (NullEventHandler, NullSpanHandler) for handler in handlers):
            return True
        current = current.parent if current.propagate else None
    return False


def emit(event: Callable[..., BaseEvent], **fields: Any) -> None:
    """Send ``event(**fields)`` to the handlers, under the current span; built only when one
    listens (pass the record's own objects, not copies: nothing is copied when nobody does).
    """
    if observed():
        dispatcher.event(event(**fields))


@dataclass
class Span:
    """A span opened by hand (:func:`open_span`): its ``id`` (``None`` when nobody listens, or
    once closed: nothing is sent then), the inputs it shows (``arguments``) and ``result``, the
    output handlers see when it closes.
    """

    id: str | None = None
    arguments: inspect.BoundArguments = field(default_factory=lambda: inspect.Signature().bind())
    result: Any = None

    def close(self, error: BaseException | None = None) -> None:
        """End the span, once: exited with :attr:`result`, or dropped with ``error``."""
        span_id = self.id
        self.id = None
        if span_id is None:
            return
        if error is not None:
            dispatcher.event(SpanDropEvent(span_id=span_id, err_str=str(error)))
            dispatcher.span_drop(id_=span_id, bound_args=self.arguments, err=error)
            return
        dispatcher.span_exit(id_=span_id, bound_args=self.arguments, result=self.result)

    def hand_over(self) -> Span:
        """This span, still open, for another to close (a stream that outlives the block that
        opened it); this object is closed from now on, so the block's end leaves it alone.
        """
        taken = Span(self.id, self.arguments)
        self.id = None
        return taken


def open_span(name: str, **inputs: Any) -> Span:
    """A span ``name`` under the current one, showing ``inputs`` as its arguments (span ids
    are ``name-<uuid>``, as core's); :func:`within` makes it the current span.
    """
    if not observed():
        return Span()
    parameters = [inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY) for key in inputs]
    arguments = inspect.Signature(parameters).bind(**inputs)
    span_id = f"{name}-{uuid.uuid4()}"
    dispatcher.span_enter(
        id_=span_id,
        bound_args=arguments,
        parent_id=active_span_id.get(),
        tags=active_instrument_tags.get(),
    )
    return Span(span_id, arguments)


@contextmanager
def within(opened: Span) -> Iterator[Span]:
    """Run the block with ``opened`` as the current span: the spans and events it makes nest
    under it.
    """
    if opened.id is None:
        yield opened
        return
    token = active_span_id.set(opened.id)
    try:
        yield opened
    finally:
        active_span_id.reset(token)


@contextmanager
def span(name: str, **inputs: Any) -> Iterator[Span]:
    """A span for the block (see :func:`open_span`): current inside it, closed at its end with
    the ``result`` the block set, dropped with the error that ends it.
    """
    opened = open_span(name, **inputs)
    try:
        with within(opened):
            yield opened
    except BaseException as error:
        opened.close(error)
        raise
    opened.close()


def opens_own_span(method: F) -> F:
    """Mark ``method`` as opening its span by hand, so that core's ``DispatcherSpanMixin`` does
    not wrap it in a second one that ends when it returns (a streamed query's span ends with its
    stream).
    """
    setattr(method, DISPATCHER_SPAN_DECORATED_ATTR, True)
    return method


async def traced(stream: AsyncGenerator[str, None], opened: Span) -> AsyncGenerator[str, None]:
    """``stream``, each piece read with ``opened`` as the current span, which closes when the
    stream ends or is closed (with the text streamed as its result) or fails; ``stream`` is
    closed then too.
    """
    pieces: list[str] = []
    failure: BaseException | None = None
    try:
        while True:
            with within(opened):
                piece = await anext(stream, None)
            if piece is None:
                break
            pieces.append(piece)
            yield piece
    except Exception as error:
        failure = error
        raise
    finally:
        await stream.aclose()
        opened.result = "".join(pieces)
        opened.close(failure)


@dataclass(frozen=True)
class Completed:
    """What one model call gave: its ``text``, the prompt tokens the model evaluated for it
    and the tokens it generated.
    """

    text: str
    prompt_tokens: int
    completion_tokens: int


class ModelCalls:
    """Model calls made together that no LlamaIndex LLM makes, as core's LLM events.

    Each call gets a span ``name`` under the current one, an ``LLMCompletionStartEvent`` with
    its prompt when the calls start and, when they end (:meth:`end`), an
    ``LLMCompletionEndEvent`` whose response holds the text and, in ``raw["usage"]``, the token
    counts as OpenAI reports them (``prompt_tokens``, ``completion_tokens``, ``total_tokens``),
    which token counters and tracing tools read. ``model_dict`` names the class that made the
    calls (:data:`CRITIC_MODELS`) and the ``model``. Use it as a context manager around the
    calls: an error that ends the block drops the spans. ``prompts`` (a function) and the
    results are read only when a handler listens.
    """

    def __init__(self, name: str, model: str, prompts: Callable[[], Sequence[str]]) -> None:
        self._spans: list[Span] = []
        self._prompts: list[str] = []
        if not observed():
            return
        self._prompts = list(prompts())
        model_dict = {"class_name": name.partition(".")[0], "model": model}
        for prompt in self._prompts:
            opened = open_span(name, prompt=prompt)
            self._spans.append(opened)
            started = LLMCompletionStartEvent(
                prompt=prompt, additional_kwargs={}, model_dict=model_dict, span_id=opened.id
            )
            dispatcher.event(started)

    def end(self, results: Callable[[], Sequence[Completed]]) -> None:
        """Report what each call gave (``results``, in the prompts' order) and close its span
        (once: the block's end then leaves the closed spans alone).
        """
        if not self._spans:
            return
        for opened, prompt, done in zip(self._spans, self._prompts, results(), strict=True):
            usage = {
                "prompt_tokens": done.prompt_tokens,
                "completion_tokens": done.completion_tokens,
                "total_tokens": done.prompt_tokens + done.completion_tokens,
            }
            response = CompletionResponse(text=done.text, raw={"usage": usage})
            dispatcher.event(
                LLMCompletionEndEvent(prompt=prompt, response=response, span_id=opened.id)
            )
            opened.result = done.text
            opened.close()

    def __enter__(self) -> ModelCalls:
        return self

    def __exit__(self, kind: Any, error: BaseException | None, trace: Any) -> None:
        # The spans end() closed are left alone (a span closes once): the rest are dropped.
        for opened in self._spans:
            opened.close(error)
