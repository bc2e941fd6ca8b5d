"""The package's spans opened by hand and its model calls: nested under the caller's span,
dropped with the error that ends them, handed over to a stream, and nothing built while no
handler listens.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events.llm import LLMCompletionEndEvent
from llama_index.core.instrumentation.events.span import SpanDropEvent
from traces import name_of, recorded

from llama_index.packs.self_rag_rse.common import tracing
from llama_index.packs.self_rag_rse.common.bridge import run_sync

dispatcher = get_dispatcher(__name__)


def test_only_a_handler_that_is_not_core_s_null_one_listens() -> None:
    assert not tracing.observed()
    with recorded():
        assert tracing.observed()
    assert not tracing.observed()
    opened = tracing.open_span("Step.unheard")
    assert opened.id is None
    opened.close()  # nothing to close, nothing sent


def test_spans_nest_and_cross_the_bridge() -> None:
    @dispatcher.span
    async def inner() -> str:
        return "done"

    with recorded() as record, tracing.span("Step.outer", question="q") as outer:
        outer.result = run_sync(inner())
    (span,) = record.named("Step.outer")
    (child,) = [s for s in record.done() if name_of(s.id_).endswith("inner")]
    assert child.parent_id == span.id_
    assert record.tree() == ["Step.outer", "  " + name_of(child.id_)]


def test_a_failing_block_drops_its_span_with_the_error() -> None:
    with recorded() as record, pytest.raises(KeyError), tracing.span("Step.failing"):
        raise KeyError("missing")
    (dropped,) = record.spans.dropped_spans
    assert name_of(dropped.id_) == "Step.failing" and "missing" in dropped.metadata["error"]
    (event,) = record.of(SpanDropEvent)
    assert event.span_id == dropped.id_


async def _pieces() -> AsyncIterator[str]:
    for piece in ("a", "b", "c"):
        yield piece


def test_a_stream_closes_the_span_handed_to_it() -> None:
    async def read(stop_after: int | None) -> list[str]:
        opened = tracing.open_span("Step.streamed")
        stream = tracing.traced(_pieces(), opened.hand_over())
        assert opened.id is None  # the block's end leaves it alone now
        read: list[str] = []
        async for piece in stream:
            read.append(piece)
            if len(read) == stop_after:
                break
        await stream.aclose()
        return read

    with recorded() as record:
        assert asyncio.run(read(None)) == ["a", "b", "c"]
        assert asyncio.run(read(1)) == ["a"]
    assert [s.id_ is not None for s in record.named("Step.streamed")] == [True, True]
    assert record.spans.dropped_spans == []


def test_model_calls_report_their_counts_or_nothing_when_unheard() -> None:
    def never() -> list[str]:
        raise AssertionError("prompts read while nobody listens")

    with tracing.ModelCalls("Model.complete", "tiny", prompts=never) as calls:
        calls.end(never)  # type: ignore[arg-type]
    prompts = ["p1", "p2"]
    with (
        recorded() as record,
        tracing.ModelCalls("Model.complete", "tiny", lambda: prompts) as calls,
    ):
        calls.end(lambda: [tracing.Completed("a", 3, 1), tracing.Completed("b", 2, 4)])
    ends: list[Any] = record.of(LLMCompletionEndEvent)
    assert [e.response.raw["usage"] for e in ends] == [
        {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6},
    ]
    assert record.tree() == ["Model.complete", "Model.complete"]
    # An error ends the calls: their spans are dropped with it.
    failing = pytest.raises(RuntimeError)
    with recorded() as record, failing, tracing.ModelCalls("Model.complete", "tiny", lambda: ["p"]):
        raise RuntimeError("decode failed")
    assert [name_of(s.id_) for s in record.spans.dropped_spans] == ["Model.complete"]
