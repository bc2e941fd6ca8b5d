"""Where an OpenAI-compatible LlamaIndex LLM sends its requests, read without calling it.

``OpenAILike`` and ``OpenAI(api_base=...)`` keep the server's URL in ``api_base``; the factory
uses it to point a served critic at the same server. Duck-typed, so any LLM class with these
fields works and nothing here imports ``llama-index-llms-openai``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from llama_index.packs.self_rag_rse.common.urls import mask_url

#: Hosts never probed for reflection tokens: the hosted APIs serve no Self-RAG model.
HOSTED_APIS = ("api.openai.com",)


@dataclass(frozen=True)
class Endpoint:
    """An LLM's server: base URL, model name, key, timeout and whether it is a chat model."""

    base_url: str
    model: str | None
    api_key: str | None
    timeout: float | None
    is_chat_model: bool

    @property
    def hosted(self) -> bool:
        """Whether this is a hosted API (no Self-RAG model there; not worth a probe)."""
        return (urlparse(self.base_url).hostname or "") in HOSTED_APIS


def endpoint_of(llm: Any) -> Endpoint | None:
    """The server behind ``llm``, or ``None`` when it has no http(s) ``api_base``."""
    base = getattr(llm, "api_base", None)
    if not isinstance(base, str) or urlparse(base).scheme not in ("http", "https"):
        return None
    model = getattr(llm, "model", None)
    key = getattr(llm, "api_key", None)
    return Endpoint(
        base_url=base,
        model=model if isinstance(model, str) else None,
        api_key=key if isinstance(key, str) and key else None,
        timeout=_seconds(getattr(llm, "timeout", None)),
        is_chat_model=bool(getattr(getattr(llm, "metadata", None), "is_chat_model", False)),
    )


def _seconds(value: Any) -> float | None:
    """An LLM's timeout when it is a finite number of seconds > 0; else ``None`` (the critic's
    default applies: an infinite or missing timeout would let one request hang for ever).
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value > 0 else None


def split_url(url: str) -> tuple[str, str]:
    """``(root, openai_base)`` of a server URL given either way (``http://h:p`` or ``.../v1``)."""
    try:  # a port out of range or not a number would fail deep in the first connection
        url = url.rstrip("/")
        parsed = urlparse(url)
        reachable = parsed.scheme in ("http", "https") and parsed.hostname and parsed.port != 0
        # An endpoint's URL, a query or a space would be pasted into every request's path.
        bare = url == url.strip() and not (parsed.query or parsed.fragment)
        valid = reachable and bare and not parsed.path.endswith(("/completions", "/completion"))
    except (AttributeError, TypeError, ValueError):  # no text at all: None, 42, bytes
        valid = False
    if not valid:
        raise ValueError(
            f"base_url must be an http(s) URL with a host and a port in 1-65535, such as "
            f"http://127.0.0.1:8080, got {mask_url(repr(url))} (the server's root or its /v1: "
            "no endpoint, query or spaces)"
        )
    if parsed.path.endswith("/v1"):
        return url[: -len("/v1")], url
    return url, f"{url}/v1"
