"""Where an OpenAI-compatible LlamaIndex LLM sends its requests, read without calling it.

``OpenAILike`` and ``OpenAI(api_base=...)`` keep the server's URL in ``api_base``; the factory
uses it to point a served critic at the same server. Duck-typed, so any LLM class with these
fields works and nothing here imports ``llama-index-llms-openai``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

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
    timeout = getattr(llm, "timeout", None)
    metadata = getattr(llm, "metadata", None)
    return Endpoint(
        base_url=base,
        model=model if isinstance(model, str) else None,
        api_key=key if isinstance(key, str) and key else None,
        timeout=float(timeout) if isinstance(timeout, int | float) and timeout > 0 else None,
        is_chat_model=bool(getattr(metadata, "is_chat_model", False)),
    )
