"""The served critic's model calls in LlamaIndex instrumentation: one span with core's LLM events
per completion request, holding the token counts the server reported, on llama.cpp's own server
(native and /v1 API) and llama-cpp-python's, streamed requests too (ended with their stream, or
when a reader stops early); answers that report no counts still trace.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from llama_index.core.instrumentation.events.llm import (
    LLMCompletionEndEvent,
    LLMCompletionStartEvent,
)
from retrievers import FixedRetriever
from served.stub import Reply, StubServer, forward
from traces import name_of, recorded

from llama_index.packs.self_rag_rse import SelfRAGQueryEngine, ServedReflectionCritic
from llama_index.packs.self_rag_rse.common.bridge import run_sync
from llama_index.packs.self_rag_rse.served.http import JSONClient

QUESTION = "What does the while statement do?"


def completion_path(path: str) -> bool:
    return path.rstrip("/").endswith(("/completion", "/completions"))


@pytest.mark.parametrize(
    ("server", "api"),
    [("llama-server", "llama.cpp"), ("llama-server", "openai"), ("llama-cpp-python", "openai")],
)
def test_each_completion_request_is_a_model_call_with_its_counts(
    server: str, api: str, llama_server: Any, llama_cpp_python_server: Any
) -> None:
    upstream = (llama_server if server == "llama-server" else llama_cpp_python_server)(
        "user_defined"
    ).url
    answers: list[dict[str, Any]] = []

    def record(method: str, path: str, body: Any) -> Reply:
        reply = forward(upstream, method, path, body)
        if completion_path(path):
            answers.append(json.loads(reply.body))
        return reply

    with StubServer(record) as proxy:
        critic = ServedReflectionCritic(proxy.url, api=api, max_new_tokens=30)
        engine = SelfRAGQueryEngine(
            critic=critic, retriever=FixedRetriever(), mode="adaptive_retrieval", threshold=0.0
        )
        with recorded() as record_:
            engine.query(QUESTION)
        critic.close()
    calls = record_.named("JSONClient.complete")
    assert len(calls) == len(answers) >= 4  # the gate, one per paragraph, follow-ups
    parents = {name_of(call.parent_id) for call in calls}
    assert parents == {"ServedReflectionCritic.adecide_retrieval", "ServedReflectionCritic.ajudge"}
    starts = record_.of(LLMCompletionStartEvent)
    ends = record_.of(LLMCompletionEndEvent)
    # Requests run concurrently: each call's pair of events is in its span, whatever the order.
    assert len(starts) == len(ends) == len(calls)
    assert {e.span_id for e in starts} == {e.span_id for e in ends} == {c.id_ for c in calls}
    # What each answer said it evaluated and generated (llama-server: its timings, the prompt
    # tokens its cache did not hold; elsewhere OpenAI's usage).
    reported = sorted(_counts(answer) for answer in answers)
    traced = sorted(
        (e.response.raw["usage"]["prompt_tokens"], e.response.raw["usage"]["completion_tokens"])
        for e in ends
    )
    assert traced == reported
    assert all(completion > 0 for _, completion in traced)
    assert all(start.model_dict["class_name"] == "JSONClient" for start in starts)


def _counts(answer: dict[str, Any]) -> tuple[int, int]:
    """What an answer (or a stream's last event) reported; ``(0, 0)``: nothing."""
    timings = answer.get("timings")
    if timings:
        return timings["prompt_n"], timings["predicted_n"]
    usage = answer.get("usage") or {"prompt_tokens": 0, "completion_tokens": 0}
    return usage["prompt_tokens"], usage["completion_tokens"]


def _stream_events(body: bytes) -> list[dict[str, Any]]:
    """The JSON events of a server-sent event stream, ``[DONE]`` left out."""
    lines = body.decode().splitlines()
    data = [line[5:].strip() for line in lines if line.startswith("data:")]
    return [json.loads(each) for each in data if each != "[DONE]"]


def _text(event: dict[str, Any]) -> str:
    """The text of a streamed event: llama.cpp's native ``content``, or OpenAI's choice."""
    if "content" in event:
        return str(event["content"])
    return str(event["choices"][0]["text"]) if event["choices"] else ""


@pytest.mark.parametrize(
    ("server", "api"),
    [("llama-server", "llama.cpp"), ("llama-server", "openai"), ("llama-cpp-python", "openai")],
)
def test_a_streamed_answer_is_a_model_call_ended_by_its_stream(
    server: str,
    api: str,
    llama_server: Any,
    llama_cpp_python_server: Any,
    talkative_gguf: Any,
) -> None:
    upstream = (llama_server if server == "llama-server" else llama_cpp_python_server)(
        talkative_gguf
    ).url
    streams: list[list[dict[str, Any]]] = []
    #: Whether each completion request, in the order sent, was streamed.
    streaming: list[bool] = []

    def record(method: str, path: str, body: Any) -> Reply:
        reply = forward(upstream, method, path, body)
        if completion_path(path):
            streaming.append(bool(body.get("stream")))
            if streaming[-1]:
                streams.append(_stream_events(reply.body))
        return reply

    with StubServer(record) as proxy:
        critic = ServedReflectionCritic(proxy.url, api=api, max_new_tokens=30)
        engine = SelfRAGQueryEngine(
            critic=critic, retriever=FixedRetriever(), mode="no_retrieval", streaming=True
        )
        with recorded() as record_:
            answer = "".join(engine.query(QUESTION).response_gen)
        sent = list(streaming)
        # A reader that stops early: the call ends with what was read, not as a failure.
        with recorded() as closed:
            stream = engine.query(QUESTION).response_gen
            next(stream)
            stream.close()
        critic.close()
    assert closed.tree()[:3] == [
        "SelfRAGQueryEngine.query",
        "  SelfRAG.generate",
        "    JSONClient.complete",
    ]
    assert closed.spans.dropped_spans == []
    assert len(closed.of(LLMCompletionEndEvent)) == len(closed.named("JSONClient.complete"))
    events = streams[0]
    (generate,) = record_.named("SelfRAG.generate")
    # One call per completion request (the server's probe, the stream, a follow-up for
    # log-probs the stream left out), in the order sent: the requests are made one by one.
    calls = record_.named("JSONClient.complete")
    assert len(calls) == len(sent)
    assert {call.parent_id for call in calls} == {generate.id_}
    streamed = calls[sent.index(True)]
    assert streamed.end_time <= generate.end_time
    (end,) = [e for e in record_.of(LLMCompletionEndEvent) if e.span_id == streamed.id_]
    # The completion is the events' texts joined; the counts, what the last event reported
    # (llama-server: its timings; llama-cpp-python reports none in a stream).
    assert end.response.text == "".join(_text(event) for event in events)
    shown = re.sub(r"\[[^]]*\]|</s>", "", end.response.text)  # the answer, as the model wrote it
    assert answer and "".join(answer.split()) == "".join(shown.split())
    usage = end.response.raw["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == _counts(events[-1])
    if server == "llama-server":
        assert usage["completion_tokens"] > 0


def test_an_answer_without_counts_still_traces() -> None:
    def answer(method: str, path: str, body: Any) -> Reply:
        return Reply.json({"content": "hi", "timings": "none", "tokens_predicted": True})

    with StubServer(answer) as server:
        client = JSONClient(server.url)
        with recorded() as record:
            assert run_sync(client.post("/completion", {"prompt": [1, 2, 3]}))["content"] == "hi"
            run_sync(client.post("/tokenize", {"content": "no model call"}))
        client.close()
    (start,) = record.of(LLMCompletionStartEvent)
    (end,) = record.of(LLMCompletionEndEvent)
    assert start.prompt == "[1, 2, 3]"  # token ids, as sent
    assert end.response.text == "hi"
    assert end.response.raw["usage"] == {
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "total_tokens": 0,
    }
