"""The served critic streams a no-evidence answer through the server's streaming API.

On the talkative tiny GGUF, over llama-server (native ``/completion`` and ``/v1/completions``)
and llama-cpp-python's server: the pieces arrive one server event at a time, join to the
non-streamed answer (which equals the in-process critic's), a server that does not decode
greedily stops the stream with ``ServerNotGreedy``, and the engine streams over a served critic.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from retrievers import FixedRetriever
from served.stub import Reply, StubServer, forward

from llama_index.packs.self_rag_rse import (
    ReflectionCritic,
    SelfRAGQueryEngine,
    ServedReflectionCritic,
)
from llama_index.packs.self_rag_rse.served import MalformedResponse, ServerNotGreedy

QUESTIONS = ["What does the while statement do?", "Who wrote Hamlet?"]
MAX_NEW = 40


@pytest.fixture(scope="module")
def local(talkative_gguf: Path) -> Iterator[ReflectionCritic]:
    from models import load_llama as _llama

    llm = _llama(talkative_gguf)
    critic = ReflectionCritic(llm, max_new_tokens=MAX_NEW)
    yield critic
    critic.close()
    llm.close()


@pytest.fixture(
    scope="module", params=["llama-server native", "llama-server openai", "llama-cpp-python"]
)
def server(
    request: pytest.FixtureRequest,
    talkative_gguf: Path,
    llama_server: Any,
    llama_cpp_python_server: Any,
) -> tuple[str, str]:
    """A server of the talkative GGUF and the API to reach it by: native ``/completion``
    (llama-server), or ``/v1/completions`` (llama-server: ``logprobs.content`` entries;
    llama-cpp-python: legacy log-probs with ``text_offset``).
    """
    if request.param == "llama-cpp-python":
        return llama_cpp_python_server(talkative_gguf).url, "openai"
    api = request.param.split()[1]
    return llama_server(talkative_gguf).url, "llama.cpp" if api == "native" else api


@pytest.fixture(scope="module")
def served(server: tuple[str, str]) -> Iterator[ServedReflectionCritic]:
    url, api = server
    with ServedReflectionCritic(url, api=api, max_new_tokens=MAX_NEW, timeout=30) as critic:
        yield critic


def test_the_answer_streams_and_joins_to_the_non_streamed_one(
    local: ReflectionCritic, served: ServedReflectionCritic
) -> None:
    served.connect()
    for question in QUESTIONS:
        expected = local.generate(question)
        before = served.requests
        assert served.generate(question) == expected
        plain = served.requests - before
        before = served.requests
        pieces = list(served.stream_generate(question))
        assert "".join(pieces) == expected
        assert len(pieces) > 1, pieces
        assert served.requests - before == plain  # the same requests, one of them streamed


def test_async_streaming_gives_the_same_pieces(served: ServedReflectionCritic) -> None:
    async def pieces() -> list[str]:
        return [piece async for piece in served.astream_generate(QUESTIONS[0])]

    assert asyncio.run(pieces()) == list(served.stream_generate(QUESTIONS[0]))


def test_the_engine_streams_over_a_served_critic(served: ServedReflectionCritic) -> None:
    engine = SelfRAGQueryEngine(critic=served, retriever=FixedRetriever(), mode="no_retrieval")
    expected = engine.query(QUESTIONS[0]).response
    engine.streaming = True
    pieces = list(engine.query(QUESTIONS[0]).response_gen)
    assert len(pieces) > 1 and "".join(pieces) == expected


def _forward_changed(upstream: str, change: dict[str, Any]) -> Any:
    import httpx

    def handler(method: str, path: str, body: Any) -> Reply:
        if method == "POST" and body and body.get("stream"):
            body = {**body, **change}
        response = httpx.request(method, upstream + path, json=body, timeout=30)
        return Reply(response.status_code, response.content)

    return handler


def test_a_server_that_does_not_decode_greedily_stops_the_stream(
    talkative_gguf: Path, llama_cpp_python_server: Any
) -> None:
    upstream = llama_cpp_python_server(talkative_gguf).url
    penalise = _forward_changed(upstream, {"repeat_penalty": 1.5, "presence_penalty": 1.5})
    with (
        StubServer(penalise) as proxy,
        ServedReflectionCritic(proxy.url, api="openai", max_new_tokens=MAX_NEW) as critic,
        pytest.raises(ServerNotGreedy) as caught,
    ):
        list(critic.stream_generate(QUESTIONS[0]))
    assert f"at generated position {caught.value.position}" in str(caught.value)


# --- a proxy between the critic and the server changes the stream --------------------------------


def _events_changed(upstream: str, change: Callable[[list[bytes]], list[bytes]]) -> Any:
    """A proxy handler: requests go on to ``upstream``; a streamed answer's events come back
    as ``change`` makes them (the SSE events without their blank-line separators).
    """

    def handler(method: str, path: str, body: Any) -> Reply:
        reply = forward(upstream, method, path, body)
        if method == "POST" and body and body.get("stream"):
            events = [e for e in reply.body.split(b"\n\n") if e.strip()]
            reply.body = b"".join(event + b"\n\n" for event in change(events))
        return reply

    return handler


def _streamed(url: str, api: str, question: str) -> list[str]:
    with ServedReflectionCritic(url, api=api, max_new_tokens=MAX_NEW, timeout=30) as critic:
        return list(critic.stream_generate(question))


def _tokens(events: list[bytes]) -> list[int]:
    """Indices of the events that carry a token whose text is not empty."""
    found = []
    for i, event in enumerate(events):
        data = event.removeprefix(b"data: ")
        if data.strip() == b"[DONE]":
            continue
        body = json.loads(data)
        text = body["choices"][0]["text"] if "choices" in body else body.get("content", "")
        if text.strip():
            found.append(i)
    return found


def test_a_stream_cut_short_by_a_proxy_is_an_error_naming_it(server: tuple[str, str]) -> None:
    upstream, api = server
    cut = _events_changed(upstream, lambda events: events[:4])
    with (
        StubServer(cut) as proxy,
        pytest.raises(MalformedResponse, match="ended its stream after 4 event") as caught,
    ):
        _streamed(proxy.url, api, QUESTIONS[0])
    assert proxy.url in str(caught.value)


def test_an_event_sent_twice_is_an_error_naming_the_server(server: tuple[str, str]) -> None:
    upstream, api = server

    def twice(events: list[bytes]) -> list[bytes]:
        i = _tokens(events)[2]
        return [*events[: i + 1], events[i], *events[i + 1 :]]

    with (
        StubServer(_events_changed(upstream, twice)) as proxy,
        pytest.raises(MalformedResponse, match="repeats") as caught,
    ):
        _streamed(proxy.url, api, QUESTIONS[0])
    assert proxy.url in str(caught.value)


def test_events_whose_data_spans_several_lines_read_as_one(
    server: tuple[str, str], local: ReflectionCritic
) -> None:
    upstream, api = server

    def split(events: list[bytes]) -> list[bytes]:
        out = []
        for event in events:
            data = event.removeprefix(b"data: ")
            if data.strip() != b"[DONE]":  # the JSON over several lines, one data: field each
                data = json.dumps(json.loads(data), indent=1).encode()
            out.append(b"\n".join(b"data: " + line for line in data.split(b"\n")))
        return out

    with StubServer(_events_changed(upstream, split)) as proxy:
        pieces = _streamed(proxy.url, api, QUESTIONS[1])
    assert len(pieces) > 1 and "".join(pieces) == local.generate(QUESTIONS[1])


def test_tokens_streamed_past_the_count_asked_for_are_an_error_naming_the_server(
    server: tuple[str, str],
) -> None:
    # A server (or a proxy) that ignores the answer's length: 40 tokens streamed where 10 were
    # asked for were taken as the answer, four times as long as the one asked for.
    upstream, api = server

    def longer(method: str, path: str, body: Any) -> Reply:
        if method == "POST" and body and body.get("stream"):
            length = "n_predict" if "n_predict" in body else "max_tokens"
            body = {**body, length: MAX_NEW}
        return forward(upstream, method, path, body)

    with (
        StubServer(longer) as proxy,
        ServedReflectionCritic(proxy.url, api=api, max_new_tokens=10, timeout=30) as critic,  # type: ignore[arg-type]
        pytest.raises(MalformedResponse, match="more than the 10 asked for") as caught,
    ):
        list(critic.stream_generate(QUESTIONS[0]))
    assert proxy.url in str(caught.value)


def test_tokens_a_native_stream_leaves_out_come_from_a_whole_completion(
    talkative_gguf: Path, llama_server: Any, local: ReflectionCritic
) -> None:
    # llama-server never streams the id of a token that ends inside a UTF-8 character (its text
    # comes with the next token's): its count of generated tokens jumps. Dropping an event
    # makes the same jump; the answer must still be the whole one.
    upstream = llama_server(talkative_gguf).url

    def drop(events: list[bytes]) -> list[bytes]:
        i = _tokens(events)[-3]  # late: text before it is streamed, the rest held back
        return [*events[:i], *events[i + 1 :]]

    with StubServer(_events_changed(upstream, drop)) as proxy:
        pieces = _streamed(proxy.url, "llama.cpp", QUESTIONS[0])
        assert proxy.count("/completion") == 2  # the stream, then the whole completion
    assert len(pieces) > 1 and "".join(pieces) == local.generate(QUESTIONS[0])


def test_a_stopped_stream_the_caller_keeps_holds_no_worker(server: tuple[str, str]) -> None:
    # A chat UI stops a stream after a piece and keeps the response (its history): the stream
    # held one of the critic's workers and its connection until collected, so with every worker
    # held that way the next query waited for good.
    from concurrent.futures import ThreadPoolExecutor

    url, api = server
    options = {"api": api, "max_new_tokens": MAX_NEW, "num_workers": 1, "timeout": 10}
    with ServedReflectionCritic(url, **options) as critic, ThreadPoolExecutor(1) as pool:
        engine = SelfRAGQueryEngine(critic=critic, retriever=FixedRetriever(), mode="no_retrieval")
        expected = engine.query(QUESTIONS[1]).response
        engine.streaming = True
        kept = engine.query(QUESTIONS[0])
        try:
            assert next(iter(kept.response_gen))
            engine.streaming = False
            assert pool.submit(engine.query, QUESTIONS[1]).result(timeout=30).response == expected
        finally:
            kept.response_gen.close()  # (what let the waiting query go)
