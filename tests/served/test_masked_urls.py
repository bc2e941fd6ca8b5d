"""A password in a served model's URL (``http://user:secret@host``) is sent, never written: every
error and log line shows ``user:***@`` in its place.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

import pytest
from served.stub import Reply, StubServer
from served.test_openai_api import openai_stub

from llama_index.packs.self_rag_rse import ServedReflectionCritic
from llama_index.packs.self_rag_rse.critic.reflection import SELF_RAG_SPECIAL_TOKENS
from llama_index.packs.self_rag_rse.served import (
    MalformedResponse,
    ReflectionTokensUnidentifiable,
    ServerError,
    ServerHTTPError,
    ServerRedirect,
    ServerTimeout,
    ServerUnavailable,
)

SECRET = "s3cret-pw"
QUERY = "What is the capital of France?"
PARAGRAPHS = ["Paris is the capital and largest city of France.", "Berlin is in Germany."]


def with_password(url: str) -> str:
    """``url`` with a user and a password in it."""
    return url.replace("http://", f"http://user:{SECRET}@", 1)


def masked(url: str) -> str:
    return url.replace("http://", "http://user:***@", 1)


def unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


REPLIES = {
    ServerHTTPError: Reply(500, b'{"error": {"message": "boom"}}'),
    MalformedResponse: Reply(200, b"<html>not json</html>"),
    ServerTimeout: Reply.json({}, delay=2.0),
    ServerRedirect: Reply(302, b"", headers={"Location": f"http://user:{SECRET}@elsewhere/props"}),
}


@pytest.mark.parametrize("error", list(REPLIES), ids=lambda error: error.__name__)
def test_a_server_error_shows_the_url_masked(error: type[ServerError]) -> None:
    # The password was in every ServerError's message (and its url).
    reply = REPLIES[error]
    with (
        StubServer(lambda *_: reply) as stub,
        ServedReflectionCritic(with_password(stub.url), api="llama.cpp", timeout=0.5) as critic,
        pytest.raises(error) as caught,
    ):
        critic.connect()
    assert stub.headers.get("Authorization", "").startswith("Basic ")  # the password was sent
    message = str(caught.value)
    assert SECRET not in message and SECRET not in caught.value.url
    assert f"{masked(stub.url)}/props" in message


def test_a_server_that_is_down_is_named_without_the_password() -> None:
    url = f"http://127.0.0.1:{unused_port()}"
    with (
        ServedReflectionCritic(with_password(url), timeout=5) as critic,
        pytest.raises(ServerUnavailable) as caught,
    ):
        critic.judge(QUERY, PARAGRAPHS)
    assert f"cannot connect to {masked(url)}/props" in str(caught.value)
    assert SECRET not in str(caught.value)


def test_a_url_refused_at_construction_is_shown_masked() -> None:
    with pytest.raises(ValueError, match="base_url must be") as caught:
        ServedReflectionCritic(with_password("http://127.0.0.1:99999"))
    assert "http://user:***@127.0.0.1:99999" in str(caught.value)
    assert SECRET not in str(caught.value)


def test_tokens_that_cannot_be_identified_are_reported_without_the_password() -> None:
    with (
        openai_stub(["", *([""] * len(SELF_RAG_SPECIAL_TOKENS))]) as stub,
        ServedReflectionCritic(with_password(stub.url) + "/v1", model="selfrag") as critic,
        pytest.raises(ReflectionTokensUnidentifiable) as caught,
    ):
        critic.connect()
    assert f"{masked(stub.url)}/v1/completions" in str(caught.value)
    assert SECRET not in str(caught.value)


@pytest.mark.parametrize("api", ["auto", "openai"])
def test_logs_show_the_url_masked(
    llama_server: Any, api: str, caplog: pytest.LogCaptureFixture
) -> None:
    # "served reflection critic: llama.cpp API of llama.cpp at http://user:<password>@..." was
    # logged at INFO, the level the command line prints.
    url = llama_server("user_defined").url
    caplog.set_level(logging.DEBUG)
    with ServedReflectionCritic(with_password(url), api=api, max_new_tokens=20) as critic:  # type: ignore[arg-type]
        judgements = critic.judge(QUERY, PARAGRAPHS)
        critic.decide_retrieval(QUERY, 0.5)
        "".join(critic.stream_generate(QUERY))
    assert all(j.error is None for j in judgements)
    assert masked(url) in caplog.text
    assert SECRET not in caplog.text
