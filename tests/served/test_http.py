"""Failures of a served model: each gives an error naming the URL, or fails one paragraph only.

A fault-injecting proxy (a stub on loopback) stands between the critic and a real llama-server:
it passes requests on, except the /completion requests the test picks, which get HTTP 500, a
body that is not JSON, a JSON body without the promised fields, or an answer slower than the
critic's timeout. Every test bounds its requests in number and time.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import socket
from contextlib import closing
from typing import Any

import pytest
from served.stub import DripServer, Reply, StubServer, forward

from llama_index.packs.self_rag_rse import ServedReflectionCritic
from llama_index.packs.self_rag_rse.served import (
    MalformedResponse,
    ServerHTTPError,
    ServerRedirect,
    ServerTimeout,
    ServerUnavailable,
)
from llama_index.packs.self_rag_rse.served.http import JSONClient

PARAGRAPHS = [
    "Paris is the capital and largest city of France.",
    "Hamlet is a tragedy written by William Shakespeare.",
    "Berlin is the capital of Germany.",
    "Mount Everest is the highest mountain above sea level.",
    "Rayleigh scattering makes the sky look blue.",
]
QUERY = "What is the capital of France?"


def unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def faulty_proxy(upstream: str, faults: dict[int, Reply]) -> StubServer:
    """Forward everything to ``upstream``; the n-th /completion request gets ``faults[n]``."""
    seen = {"completion": 0}

    def handle(method: str, path: str, body: Any) -> Reply:
        if path == "/completion":
            n = seen["completion"]
            seen["completion"] += 1
            if n in faults:
                return faults[n]
        return forward(upstream, method, path, body)

    return StubServer(handle)


def test_a_server_that_is_down_is_named() -> None:
    url = f"http://127.0.0.1:{unused_port()}"
    with ServedReflectionCritic(url, timeout=5) as critic:
        with pytest.raises(ServerUnavailable, match=rf"cannot connect to {url}/props"):
            critic.judge(QUERY, PARAGRAPHS)
        with pytest.raises(ServerUnavailable, match=url):
            critic.decide_retrieval(QUERY, 0.5)
    assert critic.requests == 2  # one try each: a server that is down is reported, not retried


def test_an_engine_on_a_server_that_is_down_fails_at_construction() -> None:
    from llama_index.llms.openai_like import OpenAILike
    from retrievers import FixedRetriever

    from llama_index.packs.self_rag_rse import SelfRAGQueryEngine

    url = f"http://127.0.0.1:{unused_port()}/v1"
    llm = OpenAILike(api_base=url, model="m", is_chat_model=False, api_key="none", timeout=5)
    with pytest.raises(ServerUnavailable, match=url.removesuffix("/v1")):
        SelfRAGQueryEngine(llm=llm, retriever=FixedRetriever(), critic="reflection")


@pytest.mark.parametrize("url", [None, 42, b"http://127.0.0.1:8080"])
def test_a_url_that_is_no_text_is_refused_at_construction(url: Any) -> None:
    # These used to fail with AttributeError: 'NoneType' object has no attribute 'rstrip' (or
    # "a bytes-like object is required, not 'str'").
    message = re.escape(
        "base_url must be an http(s) URL with a host and a port in 1-65535, such as "
        f"http://127.0.0.1:8080, got {url!r} (the server's root or its /v1"
    )
    with pytest.raises(ValueError, match=message):
        ServedReflectionCritic(url)


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:99999",
        "http://127.0.0.1:0",
        "http://127.0.0.1:port/v1",
        # Each used to pass construction, then every request went to a path that does not
        # exist (".../v1/completions/v1/completions", "h:p?x=1/v1/completions"), or failed
        # with "Request URL is missing an 'http://'" although it had one.
        "http://127.0.0.1:8080/v1/completions",
        "http://127.0.0.1:8080/completion",
        "http://127.0.0.1:8080?key=1",
        " http://127.0.0.1:8080",
    ],
)
def test_a_url_with_no_usable_port_is_refused_at_construction(url: str) -> None:
    # A port out of range used to pass construction and fail at the first request with an
    # ExceptionGroup from the connection library (OverflowError: port must be 0-65535).
    with pytest.raises(ValueError, match=r"base_url must be an http\(s\) URL .* port in 1-65535"):
        ServedReflectionCritic(url, timeout=5)
    from llama_index.llms.openai_like import OpenAILike
    from retrievers import FixedRetriever

    from llama_index.packs.self_rag_rse import SelfRAGQueryEngine

    llm = OpenAILike(api_base=url, model="m", is_chat_model=False, api_key="none", timeout=5)
    with pytest.raises(ValueError, match=r"port in 1-65535, such as http://127.0.0.1:8080"):
        SelfRAGQueryEngine(llm=llm, retriever=FixedRetriever(), critic="reflection")


@pytest.mark.parametrize("status", [503, 502, 429])
@pytest.mark.parametrize("api", ["auto", "openai"])
def test_a_server_not_ready_yet_is_not_taken_for_another_server(api: str, status: int) -> None:
    # llama-server answers HTTP 503 to every path while it loads its model, a proxy before a
    # restarting server 502, a rate limiter 429. Each used to read as "not llama.cpp" or "no
    # echo": the critic settled on the text API, unverified, for good, and an engine with
    # critic="auto" quietly judged with prompts instead of reflection tokens.
    from llama_index.packs.self_rag_rse.served.errors import ServerNotReady

    body = {"error": {"code": status, "message": "Loading model"}}
    message = rf"answered HTTP {status} \(not ready: loading, restarting or overloaded\).*Loading"
    with (
        StubServer(lambda method, path, _: Reply.json(body, status=status)) as stub,
        ServedReflectionCritic(stub.url, api=api, timeout=5) as critic,  # type: ignore[arg-type]
    ):
        with pytest.raises(ServerNotReady, match=message) as caught:
            critic.connect()
        assert isinstance(caught.value, ServerHTTPError) and caught.value.status == status
        assert critic.info is None  # nothing learned: the next try asks again
    from llama_index.llms.openai_like import OpenAILike
    from retrievers import FixedRetriever

    from llama_index.packs.self_rag_rse import SelfRAGQueryEngine

    with StubServer(lambda method, path, _: Reply.json(body, status=status)) as stub:
        llm = OpenAILike(
            api_base=f"{stub.url}/v1", model="m", is_chat_model=False, api_key="none", timeout=5
        )
        with pytest.raises(ServerNotReady, match=message):
            SelfRAGQueryEngine(llm=llm, retriever=FixedRetriever())  # critic="auto"


def test_a_slow_setup_times_out_with_the_url() -> None:
    with StubServer(lambda method, path, body: Reply.json({}, delay=3.0)) as stub:
        with (
            ServedReflectionCritic(stub.url, timeout=0.5) as critic,
            pytest.raises(ServerTimeout, match=rf"{stub.url}/props timed out after 0.5 s"),
        ):
            critic.connect()
        assert stub.in_flight == 1  # the client gave up while the server was still working
        assert len(stub.requests) == 1


def test_faults_fail_one_paragraph_each_and_keep_the_others(llama_server: Any) -> None:
    upstream = llama_server("user_defined").url
    faults = {
        0: Reply(500, b'{"error": {"code": 500, "message": "boom"}}'),
        1: Reply(200, b"<html>not json</html>"),
        2: Reply.json({"content": "no tokens field"}),
        3: Reply.json({}, delay=3.0),
    }
    with (
        ServedReflectionCritic(upstream, max_new_tokens=20) as reference,
        faulty_proxy(upstream, faults) as proxy,
        # One request at a time, so the n-th /completion belongs to the n-th paragraph.
        ServedReflectionCritic(proxy.url, max_new_tokens=20, num_workers=1, timeout=1.5) as critic,
    ):
        judgements = critic.judge(QUERY, PARAGRAPHS)
        expected = reference.judge(QUERY, PARAGRAPHS)
        # One per paragraph, plus exact follow-ups for the one that succeeded (at most 3 groups).
        assert len(PARAGRAPHS) <= proxy.count("/completion") <= len(PARAGRAPHS) + 3
    errors = [j.error or "" for j in judgements]
    assert ServerHTTPError.__name__ in errors[0] and "HTTP 500" in errors[0] and "boom" in errors[0]
    assert MalformedResponse.__name__ in errors[1] and "not JSON" in errors[1]
    assert MalformedResponse.__name__ in errors[2] and "'tokens'" in errors[2]
    assert ServerTimeout.__name__ in errors[3] and "timed out after 1.5 s" in errors[3]
    for error in errors[:4]:
        assert f"{proxy.url}/completion" in error
    for j in judgements[:4]:
        assert (j.relevance, j.support, j.utility, j.answer) == (0.0, 0.0, 0.0, "")
    kept, same = judgements[4], expected[4]
    assert kept.error is None and kept.answer == same.answer
    assert kept.relevance == pytest.approx(same.relevance, abs=1e-6)


def test_requests_in_flight_are_bounded_by_num_workers(llama_server: Any) -> None:
    upstream = llama_server("user_defined").url

    def slow(method: str, path: str, body: Any) -> Reply:
        reply = forward(upstream, method, path, body)
        if path == "/completion":
            reply.delay = 0.2
        return reply

    with StubServer(slow) as proxy:
        with ServedReflectionCritic(proxy.url, max_new_tokens=10, num_workers=2) as critic:
            judgements = critic.judge(QUERY, PARAGRAPHS)
        assert all(j.error is None for j in judgements)
        assert proxy.max_in_flight == 2


def _answer(body: bytes, status: str = "200 OK") -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
    return head.encode() + b"\r\n\r\n" + body


@pytest.mark.parametrize("dripped", ["everything", "the body"])
def test_the_timeout_bounds_the_whole_request_not_each_read(dripped: str) -> None:
    # A byte every 25 ms never leaves a read waiting for 1 s: a per-read timeout never fires,
    # and a request would take as long as the server likes (before: ~3 s per request here).
    body = json.dumps({"default_generation_settings": {"n_ctx": 512}, "pad": "x" * 60}).encode()
    answer = _answer(body)
    at_once = 0 if dripped == "everything" else len(answer) - len(body)
    with DripServer(answer, interval=0.025, at_once=at_once) as drip:
        with (
            ServedReflectionCritic(drip.url, api="llama.cpp", timeout=1.0) as critic,
            pytest.raises(ServerTimeout, match=rf"{drip.url}/props timed out after 1 s"),
        ):
            critic.connect()
        assert drip.sent < len(answer)  # given up before the answer's last byte


@pytest.mark.parametrize("api", ["auto", "llama.cpp", "openai"])
def test_a_redirect_is_reported_as_a_redirect_with_the_fix(api: str) -> None:
    def moved(method: str, path: str, body: Any) -> Reply:
        return Reply(302, b"", headers={"Location": f"https://models.example/selfrag{path}"})

    with StubServer(moved) as stub:
        with (
            ServedReflectionCritic(stub.url, api=api, timeout=5) as critic,
            pytest.raises(ServerRedirect) as caught,
        ):  # type: ignore[arg-type]
            critic.connect()
        assert len(stub.requests) == 1  # reported at once, not retried elsewhere
    message = str(caught.value)
    assert "HTTP 302" in message and "not JSON" not in message
    assert caught.value.status == 302
    # The OpenAI API's first request asks /v1/models which kind of server it is.
    path = "/v1/models" if api == "openai" else "/props"
    assert caught.value.location == f"https://models.example/selfrag{path}"
    fixed = "https://models.example/selfrag" + ("/v1" if api == "openai" else "")
    assert f"{stub.url}{path}" in message and f"point base_url at {fixed}" in message


def test_a_new_event_loop_per_query_does_not_keep_the_old_loops_connections(
    llama_server: Any,
) -> None:
    # asyncio.run(engine.aquery(...)) per request (a sync web handler) kept every finished
    # loop's client and its keep-alive sockets: 90 more open files after 30 runs, then "Too
    # many open files". A closed loop's client is now dropped when the next loop asks for one.
    import gc
    import os

    def open_files() -> int:  # where the system lists them (Linux); else the cache alone
        fds = f"/proc/{os.getpid()}/fd"
        return len(os.listdir(fds)) if os.path.isdir(fds) else 0

    client = JSONClient(llama_server("user_defined").url, timeout=30)
    asyncio.run(client.get("/health"))
    gc.collect()
    before = open_files()
    for _ in range(20):
        asyncio.run(client.get("/health"))
    gc.collect()
    assert len(client._clients) <= 2
    assert open_files() - before < 5
    client.close()


def test_a_redirect_without_a_location_says_so() -> None:
    with (
        StubServer(lambda method, path, body: Reply(307, b"")) as stub,
        ServedReflectionCritic(stub.url, api="llama.cpp", timeout=5) as critic,
        pytest.raises(ServerRedirect, match=r"HTTP 307 .*no Location"),
    ):
        critic.connect()


@pytest.mark.parametrize("timeout", [0, -1, math.nan, math.inf])
def test_a_timeout_must_be_a_finite_number_of_seconds(timeout: float) -> None:
    with pytest.raises(ValueError, match="timeout"):
        ServedReflectionCritic("http://127.0.0.1:1", timeout=timeout)


@pytest.mark.parametrize("timeout", [None, "30", True])
def test_a_timeout_that_is_no_number_is_named(timeout: Any) -> None:
    # None and "30" used to fail with "'>' not supported between instances of ..." from the
    # comparison; True was read as 1 second.
    message = rf"timeout must be a finite number of seconds > 0, got {timeout!r}"
    with pytest.raises(ValueError, match=message):
        ServedReflectionCritic("http://127.0.0.1:1", timeout=timeout)
    from llama_index.packs.self_rag_rse.served.http import JSONClient

    with pytest.raises(ValueError, match=message):
        JSONClient("http://127.0.0.1:1", timeout=timeout)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("n_ctx", 0),
        ("n_ctx", 2.5),
        ("max_new_tokens", 2.5),
        ("top_logprobs", True),
        ("max_logprobs", 0),
        ("num_workers", 0),
    ],
)
def test_a_size_that_is_no_whole_number_above_zero_is_refused(option: str, value: Any) -> None:
    # These used to be accepted: n_ctx=0 as the size of the server's context, 2.5 new tokens,
    # True log-probs per position, and so on.
    owner = "JSONClient" if option == "num_workers" else "ServedReflectionCritic"
    message = re.escape(f"{owner}: {option} must be an integer >= 1, got {value!r}")
    with pytest.raises(ValueError, match=message):
        ServedReflectionCritic("http://127.0.0.1:1", **{option: value})


@pytest.mark.parametrize(
    "options",
    [{"n_predict": 2}, {"n_probs": 3, "temperature": 0.0}, {"logprobs": 1}, {"echo": True}],
)
def test_request_options_that_set_the_critics_own_fields_are_refused(options: dict) -> None:
    # They were ignored without a word (the critic's fields win in every request body).
    with pytest.raises(ValueError, match=r"request_options sets \[.*\], which the critic sets"):
        ServedReflectionCritic("http://127.0.0.1:1", request_options=options)


@pytest.mark.parametrize(
    ("option", "value"),
    [("request_options", [1, 2]), ("request_options", "x"), ("model", 42), ("api_key", b"k")],
)
def test_options_of_the_wrong_type_are_refused_at_construction(option: str, value: Any) -> None:
    # A list was dict()'s own TypeError, a string its ValueError; a model of 42 and a bytes key
    # were sent as they were (the server answered 400 or 401).
    kind = type(value).__name__
    with pytest.raises(TypeError, match=rf"ServedReflectionCritic: {option} must be .*got {kind}"):
        ServedReflectionCritic("http://127.0.0.1:1", **{option: value})


def test_sampling_request_options_are_kept() -> None:
    options = {"repeat_penalty": 1.1, "cache_prompt": False}
    critic = ServedReflectionCritic("http://127.0.0.1:1", request_options=options)
    assert critic.request_options == options
    critic.close()


@pytest.mark.parametrize("timeout", [math.inf, math.nan, True, -3.0])
def test_an_llm_timeout_that_is_no_timeout_leaves_the_default(timeout: Any) -> None:
    from types import SimpleNamespace

    from llama_index.packs.self_rag_rse.served.endpoint import endpoint_of

    llm = SimpleNamespace(api_base="http://127.0.0.1:1/v1", model="m", timeout=timeout)
    endpoint = endpoint_of(llm)
    assert endpoint is not None and endpoint.timeout is None
    critic = ServedReflectionCritic.from_llm(llm)  # constructs: the default timeout applies
    critic.close()


# --- streamed answers -----------------------------------------------------------------------------


def _stream(url: str, timeout: float = 10.0) -> list[Any]:
    from llama_index.packs.self_rag_rse.common.bridge import run_sync
    from llama_index.packs.self_rag_rse.served.http import JSONClient

    client = JSONClient(url, timeout=timeout)

    async def read() -> list[Any]:
        events = client.stream_parsed("/completion", {}, lambda e: e, lambda e: "end" in e)
        return [event async for event in events]

    with closing(client):
        return run_sync(read())


def _events(*lines: str) -> Reply:
    return Reply(200, "".join(f"{line}\n" for line in lines).encode())


def test_a_stream_yields_its_events_until_done() -> None:
    reply = _events(": a comment", "event: x", 'data: {"a": 1}', "", 'data: {"a": 2}', "")
    reply.body += b'data: [DONE]\n\ndata: {"after": 3}\n\n'
    with StubServer(lambda *_: reply) as stub:
        assert _stream(stub.url) == [{"a": 1}, {"a": 2}]


def test_an_event_whose_data_spans_several_lines_is_one_event() -> None:
    # SSE joins an event's data lines with newlines; JSON may be split anywhere whitespace goes.
    reply = _events('data: {"a":', "data:  [1,", "data: 2]}", "", 'data: {"end": 1}', "")
    with StubServer(lambda *_: reply) as stub:
        assert _stream(stub.url) == [{"a": [1, 2]}, {"end": 1}]


def test_a_stream_answered_with_one_json_body_says_the_server_does_not_stream() -> None:
    # A server or proxy that ignores stream: true answers one JSON body; the error used to
    # blame a connection cut after 0 events.
    json_reply = Reply.json({"content": "Paris"})
    with (
        StubServer(lambda *_: json_reply) as stub,
        pytest.raises(MalformedResponse, match="'application/json', not an event stream"),
    ):
        _stream(stub.url)


@pytest.mark.parametrize("tail", [[], ['data: {"a": 2}', ""], ['data: {"en']])
def test_a_stream_cut_before_its_end_is_an_error_naming_the_url(tail: list[str]) -> None:
    reply = _events('data: {"a": 1}', "", *tail)
    with StubServer(lambda *_: reply) as stub, pytest.raises(MalformedResponse) as caught:
        _stream(stub.url)
    assert stub.url in str(caught.value)
    assert "ended its stream" in str(caught.value) or "not JSON" in str(caught.value)


@pytest.mark.parametrize(
    "reply, error, match",
    [
        (_events('data: {"error": {"message": "no slot"}}'), ServerHTTPError, "streamed an error"),
        (_events("data: {not json"), MalformedResponse, "streamed an event that is not JSON"),
        # Valid JSON nested past Python's recursion limit: RecursionError escaped the query.
        (_events("data: " + "[" * 100_000 + "]" * 100_000), MalformedResponse, "not JSON"),
        (Reply(500, b"model crashed"), ServerHTTPError, "answered HTTP 500: model crashed"),
    ],
)
def test_a_stream_that_fails_names_the_url(reply: Reply, error: type, match: str) -> None:
    with StubServer(lambda *_: reply) as stub, pytest.raises(error, match=match) as caught:
        _stream(stub.url)
    assert stub.url in str(caught.value)


def test_the_timeout_bounds_the_whole_stream_not_each_event() -> None:
    events = b'data: {"a": 1}\n\n' * 40
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"
    with DripServer(head + events, interval=0.02, at_once=len(head)) as drip:
        with pytest.raises(ServerTimeout, match="timed out after 2 s"):
            _stream(drip.url, timeout=2)
        assert drip.sent < len(head + events)  # given up before the stream's last byte


def test_a_body_nested_past_the_recursion_limit_is_a_malformed_response() -> None:
    deep = Reply(200, b"[" * 100_000 + b"]" * 100_000, headers={"Content-Type": "application/json"})
    with (
        StubServer(lambda *_: deep) as stub,
        ServedReflectionCritic(stub.url, api="llama.cpp", timeout=5) as critic,
        pytest.raises(MalformedResponse, match=r"/props answered HTTP 200 .*nests too deep"),
    ):
        critic.connect()
