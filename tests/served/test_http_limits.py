"""A served model's answer is read within bounds: its size (as sent and as decoded), its time
(reading, decoding and parsing), and a client closed under a reader says so.

Hostile bodies a real server does not send (a gzip bomb, a body or stream that never ends) come
from stubs on loopback; the rest from a real llama-server. Every test bounds its time, and the
size tests the memory the client takes while it refuses the body.
"""

from __future__ import annotations

import threading
import time
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import pytest
from served.stub import EndlessServer, Reply, StubServer, forward

from llama_index.packs.self_rag_rse import ServedReflectionCritic
from llama_index.packs.self_rag_rse.common.bridge import run_sync
from llama_index.packs.self_rag_rse.served import MalformedResponse, ServerError
from llama_index.packs.self_rag_rse.served.http import MAX_RESPONSE_BYTES, JSONClient

MIB = 1 << 20
#: What a bomb decodes to: far more than the limit, small enough for a test machine to survive
#: the code that decoded it whole.
BOMB_SIZE = 256 * MIB
JSON_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n"
STREAM_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"


@pytest.fixture(scope="module")
def gzip_bomb() -> bytes:
    """256 MiB of zeros, gzipped into ~260 KB."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = bytes(MIB)
    parts = [packer.compress(block) for _ in range(BOMB_SIZE // MIB)]
    return b"".join([*parts, packer.flush()])


@contextmanager
def bounded(seconds: float) -> Iterator[None]:
    """Fail unless the block ends within ``seconds`` and Python's allocations in it peak below
    three times the limit (the bytes read so far, a copy, and what the test itself holds).
    """
    tracemalloc.start()
    began = time.monotonic()
    try:
        yield
    finally:
        took = time.monotonic() - began
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert took < seconds, f"took {took:.1f} s"
    assert peak < 3 * MAX_RESPONSE_BYTES, f"peak {peak / MIB:.0f} MiB"


def _stream(url: str, timeout: float = 10.0) -> list[Any]:
    client = JSONClient(url, timeout=timeout)

    async def read() -> list[Any]:
        events = client.stream_parsed("/completion", {}, lambda e: e, lambda e: "end" in e)
        return [event async for event in events]

    with closing(client):
        return run_sync(read())


def _connect(url: str, **options: Any) -> None:
    with ServedReflectionCritic(url, api="llama.cpp", **options) as critic:
        critic.connect()


LIMIT = rf"more than max_response_bytes={MAX_RESPONSE_BYTES:,} bytes"


def test_the_default_limit_holds_the_largest_real_answers_many_times(llama_server: Any) -> None:
    # The figures docs/serving.md quotes: the critic's largest completion (50 tokens, 20
    # log-probs each, none stopping early) and a whole-vocabulary follow-up, per entry.
    import httpx

    url = llama_server("user_defined").url
    prompt = "### Instruction:\nWhat is the capital of France?\n\n### Response:\n"
    fields = {"prompt": prompt, "post_sampling_probs": False, "return_tokens": True}
    fields |= {"temperature": 0.0, "ignore_eos": True}
    completion = httpx.post(f"{url}/completion", json={**fields, "n_predict": 50, "n_probs": 20})
    assert len(completion.json()["tokens"]) == 50
    whole = httpx.post(f"{url}/completion", json={**fields, "n_predict": 1, "n_probs": 1 << 20})
    entries = len(whole.json()["completion_probabilities"][0]["top_logprobs"])
    per_entry = len(whole.content) / entries
    assert 50_000 < len(completion.content) < 150_000  # ~88 KB
    assert 50 < per_entry < 100  # ~72 bytes: ~2.3 MB for a 32,000-token vocabulary
    assert 100 * len(completion.content) < MAX_RESPONSE_BYTES
    assert 5 * 32_000 * per_entry < MAX_RESPONSE_BYTES


def test_a_body_that_never_ends_is_refused_quickly_naming_the_url_and_the_limit() -> None:
    # It was read until the timeout (or memory) ran out: a MemoryError or the OOM killer.
    with (
        EndlessServer(JSON_HEAD, b" " * 65536) as flood,
        bounded(seconds=5),
        pytest.raises(MalformedResponse, match=LIMIT) as caught,
    ):
        _connect(flood.url, timeout=2)
    assert f"{flood.url}/props" in str(caught.value)
    assert "raise max_response_bytes" in str(caught.value)


def test_a_gzip_bomb_is_refused_before_it_is_decoded_whole(gzip_bomb: bytes) -> None:
    # 260 KB of gzip were decoded to 256 MiB (1.5 MB to 1.5 GB, 4.7 GB at the peak, in ~35 s
    # with timeout=20: the decoding ran after the timed read) before the JSON parser said no.
    bomb = Reply(200, gzip_bomb, headers={"Content-Encoding": "gzip"})
    with (
        StubServer(lambda *_: bomb) as stub,
        bounded(seconds=5),
        pytest.raises(MalformedResponse, match=LIMIT) as caught,
    ):
        _connect(stub.url, timeout=20)
    assert f"{stub.url}/props" in str(caught.value)


@pytest.mark.parametrize(
    "piece",
    [b"data: " + b"x" * 65530, b"data: " + b"x" * 65529 + b"\n"],
    ids=["one endless line", "one endless event"],
)
def test_a_stream_that_never_ends_is_refused_quickly(piece: bytes) -> None:
    # Either was held in memory until the timeout: gigabytes at loopback speed. (Endless short
    # lines reach the limit too, or the timeout first: read one by one, they are slow to come.)
    with (
        EndlessServer(STREAM_HEAD, piece) as flood,
        bounded(seconds=5),
        pytest.raises(MalformedResponse, match=LIMIT) as caught,
    ):
        _stream(flood.url, timeout=3)
    assert f"{flood.url}/completion" in str(caught.value)


def test_a_gzip_bomb_in_a_stream_is_refused_before_it_is_decoded_whole(gzip_bomb: bytes) -> None:
    headers = {"Content-Encoding": "gzip", "Content-Type": "text/event-stream"}
    with (
        StubServer(lambda *_: Reply(200, gzip_bomb, headers=headers)) as stub,
        bounded(seconds=5),
        pytest.raises(MalformedResponse, match=LIMIT),
    ):
        _stream(stub.url)


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_compressed_answer_within_the_limit_is_read(encoding: str) -> None:
    import json

    events = b'data: {"a": 1}\r\n\r\ndata: {"end": 2}\r\n\r\n'
    body = json.dumps({"default_generation_settings": {"n_ctx": 512}}).encode()
    wbits = 31 if encoding == "gzip" else 15

    def pack(raw: bytes) -> bytes:
        packer = zlib.compressobj(6, zlib.DEFLATED, wbits)
        return packer.compress(raw) + packer.flush()

    def handle(method: str, path: str, _: Any) -> Reply:
        raw = events if path == "/completion" else body
        return Reply(200, pack(raw), headers={"Content-Encoding": encoding})

    with StubServer(handle) as stub:
        assert _stream(stub.url) == [{"a": 1}, {"end": 2}]
        client = JSONClient(stub.url, timeout=5)
        with closing(client):
            assert run_sync(client.get("/props")) == json.loads(body)


@pytest.mark.parametrize("encoding", ["br", "zstd", "compress"])
def test_an_encoding_the_client_did_not_ask_for_is_named(encoding: str) -> None:
    # httpx decoded brotli and zstd whole, where one 64 KB read may hold gigabytes.
    reply = Reply(200, b"\x28\xb5\x2f\xfd" * 8, headers={"Content-Encoding": encoding})
    with (
        StubServer(lambda *_: reply) as stub,
        pytest.raises(
            MalformedResponse, match=rf"encoded '{encoding}' that does not decode as gzip"
        ),
    ):
        _connect(stub.url, timeout=5)


def test_a_body_that_is_not_the_gzip_it_claims_is_malformed() -> None:
    reply = Reply(200, b"{}", headers={"Content-Encoding": "gzip"})
    with (
        StubServer(lambda *_: reply) as stub,
        pytest.raises(
            MalformedResponse, match=r"/props answered a body encoded 'gzip' that does not"
        ),
    ):
        _connect(stub.url, timeout=5)


def test_max_response_bytes_is_the_option_that_raises_the_limit(llama_server: Any) -> None:
    url = llama_server("user_defined").url
    with pytest.raises(MalformedResponse, match=r"more than max_response_bytes=100 bytes"):
        _connect(url, max_response_bytes=100)
    _connect(url, max_response_bytes=MAX_RESPONSE_BYTES)


@pytest.mark.parametrize("value", [0, -1, 2.5, True, None])
def test_max_response_bytes_must_be_a_whole_number_above_zero(value: Any) -> None:
    owner = "JSONClient" if value is None else "ServedReflectionCritic"  # None: no count at all
    message = rf"{owner}: max_response_bytes must be an integer >= 1, got {value!r}"
    with pytest.raises(ValueError, match=message):
        ServedReflectionCritic("http://127.0.0.1:1", max_response_bytes=value)
    with pytest.raises(ValueError, match=r"JSONClient: max_response_bytes must be an integer"):
        JSONClient("http://127.0.0.1:1", max_response_bytes=value)


# --- a client closed under a reader ----------------------------------------------------------


def _paced(upstream: str, pace: float) -> Callable[[str, str, Any], Reply]:
    """A proxy handler: requests go on to ``upstream``; a streamed answer comes back a line
    every ``pace`` seconds.
    """

    def handler(method: str, path: str, body: Any) -> Reply:
        reply = forward(upstream, method, path, body)
        if method == "POST" and body and body.get("stream"):
            reply.pace = pace
        return reply

    return handler


@pytest.mark.parametrize("api", ["llama.cpp", "openai"])
def test_closing_the_critic_under_a_stream_says_the_client_was_closed(
    llama_server: Any, talkative_gguf: Path, api: str
) -> None:
    # The reader got "ServerUnavailable: POST .../completion failed: ReadError: " (nothing
    # after the colon), as if the server had gone away.
    upstream = llama_server(talkative_gguf).url
    with (
        StubServer(_paced(upstream, pace=0.05)) as proxy,
        ServedReflectionCritic(proxy.url, api=api, max_new_tokens=40, timeout=30) as critic,  # type: ignore[arg-type]
    ):
        pieces = critic.stream_generate("Who wrote Hamlet?")
        assert next(pieces)  # the stream is being read
        began = time.monotonic()
        closer = threading.Thread(target=critic.close)  # another thread closes the critic
        closer.start()
        with pytest.raises(ServerError, match="closed") as caught:
            list(pieces)
        closer.join()
    message = str(caught.value)
    assert time.monotonic() - began < 5
    assert f"{proxy.url}/" in message and "close()" in message
