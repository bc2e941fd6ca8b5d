"""The served critic streams a no-evidence answer through the server's streaming API.

On the talkative tiny GGUF, over llama-server (native ``/completion`` and ``/v1/completions``)
and llama-cpp-python's server: the pieces arrive one server event at a time, join to the
non-streamed answer (which equals the in-process critic's), a server that does not decode
greedily stops the stream with ``ServerNotGreedy``, and the engine streams over a served critic.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from retrievers import FixedRetriever
from served.stub import Reply, StubServer

from llama_index.packs.self_rag_rse import SelfRAGQueryEngine
from llama_index.packs.self_rag_rse.llamacpp.reflection_critic import ReflectionCritic
from llama_index.packs.self_rag_rse.served import ServedReflectionCritic, ServerNotGreedy

QUESTIONS = ["What does the while statement do?", "Who wrote Hamlet?"]
MAX_NEW = 40


@pytest.fixture(scope="module")
def local(talkative_gguf: Path) -> Iterator[ReflectionCritic]:
    from conftest import _llama

    llm = _llama(talkative_gguf)
    critic = ReflectionCritic(llm, max_new_tokens=MAX_NEW)
    yield critic
    critic.close()
    llm.close()


@pytest.fixture(
    scope="module", params=["llama-server native", "llama-server openai", "llama-cpp-python"]
)
def served(
    request: pytest.FixtureRequest,
    talkative_gguf: Path,
    llama_server: Any,
    llama_cpp_python_server: Any,
) -> Iterator[ServedReflectionCritic]:
    if request.param == "llama-cpp-python":
        url, api = llama_cpp_python_server(talkative_gguf).url, "openai"
    else:
        url, api = llama_server(talkative_gguf).url, request.param.split()[1]
    api = "llama.cpp" if api == "native" else api
    critic = ServedReflectionCritic(url, api=api, max_new_tokens=MAX_NEW, timeout=30)
    yield critic
    critic.close()


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
    with StubServer(penalise) as proxy:
        critic = ServedReflectionCritic(proxy.url, api="openai", max_new_tokens=MAX_NEW)
        try:
            with pytest.raises(ServerNotGreedy) as caught:
                list(critic.stream_generate(QUESTIONS[0]))
        finally:
            critic.close()
    assert f"at generated position {caught.value.position}" in str(caught.value)
