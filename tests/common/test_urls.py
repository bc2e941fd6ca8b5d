"""A URL's password never shows where the package writes a URL for people to read."""

from __future__ import annotations

import pytest

from llama_index.packs.self_rag_rse.common.urls import mask_url


@pytest.mark.parametrize(
    ("text", "masked"),
    [
        ("http://user:pw@host/v1#model", "http://user:***@host/v1#model"),
        ("https://user:s3cr%40t@host:8080/v1", "https://user:***@host:8080/v1"),
        # A user name alone is often a token: it is masked whole.
        ("http://sk-abc123@host/v1", "http://***@host/v1"),
        # A password with an unescaped "@": the host is what follows the last one.
        ("http://user:p@ss@host/v1", "http://user:***@host/v1"),
        ("http://user:@host", "http://user:***@host"),
    ],
)
def test_the_userinfo_of_a_url_is_masked(text: str, masked: str) -> None:
    assert mask_url(text) == masked


@pytest.mark.parametrize(
    "text",
    [
        "http://127.0.0.1:8080/v1",
        "http://host/v1?to=a@b",
        "http://host/path/x@y",
        "mail me at someone@example.com",
        "",
        "no URL here",
    ],
)
def test_text_without_userinfo_is_unchanged(text: str) -> None:
    assert mask_url(text) == text


def test_every_url_in_a_message_is_masked() -> None:
    message = (
        "POST http://u:pw@a:1/completion answered HTTP 302, a redirect to "
        "'https://v:pw2@b/x': point base_url at https://v:pw2@b"
    )
    masked = mask_url(message)
    assert "pw" not in masked
    assert masked == (
        "POST http://u:***@a:1/completion answered HTTP 302, a redirect to "
        "'https://v:***@b/x': point base_url at https://v:***@b"
    )
