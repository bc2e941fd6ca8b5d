"""What LlamaIndex instrumentation records, for the tracing tests.

``recorded()`` attaches core's ``SimpleSpanHandler`` and an event handler that keeps every event
to the root dispatcher for the block; ``openinference()`` instruments LlamaIndex with
OpenInference into OpenTelemetry's in-memory exporter (no server) for the block. Both give the
span tree as lines, ``"  " * depth + name``, children in the order they started.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from llama_index.core.bridge.pydantic import Field
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.span_handlers import SimpleSpanHandler


class _Keeper(BaseEventHandler):
    kept: list[Any] = Field(default_factory=list)

    def handle(self, event: Any, **kwargs: Any) -> None:
        self.kept.append(event)


class Recorded:
    """The spans and events of a block (see :func:`recorded`)."""

    def __init__(self) -> None:
        self.spans = SimpleSpanHandler()
        self.keeper = _Keeper()

    @property
    def events(self) -> list[Any]:
        return self.keeper.kept

    def done(self) -> list[Any]:
        """The spans that ended (exited or dropped), in the order they started."""
        spans = self.spans.completed_spans + self.spans.dropped_spans
        return sorted(spans, key=lambda span: span.start_time)

    def tree(self) -> list[str]:
        done = self.done()
        return _lines(
            [(s.id_, s.parent_id, name_of(s.id_)) for s in done],
        )

    def named(self, name: str) -> list[Any]:
        return [span for span in self.done() if name_of(span.id_) == name]

    def of(self, kind: type) -> list[Any]:
        """The events of one class, in order."""
        return [event for event in self.events if type(event) is kind]

    def span_of(self, event: Any) -> str:
        return name_of(event.span_id)


def name_of(span_id: str) -> str:
    """A span's name: its id without the ``-<uuid>`` tail."""
    return span_id.partition("-")[0]


@contextmanager
def recorded() -> Iterator[Recorded]:
    record = Recorded()
    root = get_dispatcher()
    root.add_span_handler(record.spans)
    root.add_event_handler(record.keeper)
    try:
        yield record
    finally:
        root.span_handlers.remove(record.spans)
        root.event_handlers.remove(record.keeper)


@contextmanager
def openinference() -> Iterator[Any]:
    """OpenInference's instrumentor into an ``InMemorySpanExporter`` (yielded) for the block."""
    from openinference.instrumentation.llama_index import LlamaIndexInstrumentor
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrumentor = LlamaIndexInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    try:
        yield exporter
    finally:
        instrumentor.uninstrument()


def otel_tree(spans: Any) -> list[str]:
    """The exported OpenTelemetry spans as tree lines."""
    ordered = sorted(spans, key=lambda span: span.start_time)
    return _lines(
        [(s.context.span_id, s.parent.span_id if s.parent else None, s.name) for s in ordered],
    )


def _lines(spans: list[tuple[Any, Any, str]]) -> list[str]:
    """Tree lines of ``(id, parent id, name)`` in start order; a span whose parent was not
    recorded is a root.
    """
    ids = {span_id for span_id, _, _ in spans}
    children: dict[Any, list[tuple[Any, Any, str]]] = {}
    for span in spans:
        parent = span[1] if span[1] in ids else None
        children.setdefault(parent, []).append(span)
    lines: list[str] = []

    def visit(parent: Any, depth: int) -> None:
        for span_id, _, name in children.get(parent, []):
            lines.append("  " * depth + name)
            visit(span_id, depth + 1)

    visit(None, 0)
    return lines
