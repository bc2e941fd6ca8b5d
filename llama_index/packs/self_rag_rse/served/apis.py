"""What the served reflection critic needs from a server API, and what the APIs share.

Two implementations: :class:`~.llamacpp_api.LlamaCppAPI` (llama.cpp's native ``/completion``:
token ids, exact follow-ups) and :class:`~.openai_api.OpenAIAPI` (any ``/v1/completions``:
llama-server's, llama-cpp-python's, vLLM's, others). The critic talks to them through
:class:`CompletionAPI` only. Both send the greedy fields of :mod:`.greedy` for their server
kind, which :class:`ServerInfo` records.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from llama_index.packs.self_rag_rse.critic.reflection import SELF_RAG_SPECIAL_TOKENS
from llama_index.packs.self_rag_rse.served.http import JSONClient
from llama_index.packs.self_rag_rse.served.wire import Completion, Position


class ReflectionTokensUnidentifiable(ValueError):
    """The server has the reflection tokens but its log-probs cannot tell which token is which."""


@dataclass
class ServerInfo:
    """What the critic learned about the server once, before its first request.

    ``keys`` maps each Self-RAG special string to the key its token has in this API's
    log-probs (``token_id:<id>`` or the string itself); ``verified`` says whether the server
    confirmed them (an OpenAI-style server without ``echo`` cannot). ``server`` is the kind of
    server (:func:`~.greedy.server_kind`) and ``sampling`` the fields every completion request
    carries to decode greedily there (``request_options`` included).
    """

    api: str
    keys: dict[str, str]
    verified: bool
    n_ctx: int | None = None
    n_vocab: int | None = None
    model: str | None = None
    server: str = "openai"
    sampling: dict[str, Any] = field(default_factory=dict)


@dataclass
class Layout:
    """Where Self-RAG strings go around user text: ``prompt + after_prompt``, then per
    paragraph ``paragraph + after_paragraph`` (one prompt each; none: one prompt in all).
    ``reserve`` positions are kept free for the answer when a paragraph must be shortened;
    ``cuts``: the tokens each paragraph lost that way (set by the API that shortened it).
    """

    after_prompt: Sequence[str] = ()
    paragraphs: Sequence[str] = ()
    after_paragraph: Sequence[str] = ()
    reserve: int = 0
    cuts: list[int] = field(default_factory=list)


@dataclass
class Refetched:
    """What a follow-up request found at one position: the log-probs of a group's members
    (their ratios exact), or ``None`` with the reason when the server could not tell them.
    """

    values: dict[str, float] | None
    requests: int
    why: str | None = None


class TokenIds(Protocol):
    """An API that tokenizes user text into the ids its completions take as prompts."""

    async def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of ``texts``: the first with BOS (if the model adds one), the rest without."""


class CompletionAPI(Protocol):
    """What the critic needs from a server API."""

    name: str
    client: JSONClient
    #: Path of the completion endpoint on ``client`` (for messages).
    endpoint: str
    #: Whether :meth:`refetch_group` can ask the server for more than a completion reported.
    can_refetch: bool

    async def connect(self) -> ServerInfo:
        """Learn the server kind, the reflection tokens' keys and the context size."""

    async def prompts(self, info: ServerInfo, prompt: str, layout: Layout) -> list[Any]:
        """The prompts ``layout`` describes around the user text ``prompt``."""

    async def complete(
        self, info: ServerInfo, prompt: Any, max_new_tokens: int, top_n: int
    ) -> Completion:
        """Greedy continuation with the top-``top_n`` log-probs of every position."""

    def stream(
        self, info: ServerInfo, prompt: Any, max_new_tokens: int, top_n: int
    ) -> AsyncGenerator[Completion, None]:
        """:meth:`complete` through the server's streaming API: the completion's pieces (each
        with its positions' log-probs) as the server sends them; they join to the whole.
        """

    async def refetch(
        self, info: ServerInfo, prompt: Any, generated: Sequence[str], top_n: int | None
    ) -> Position:
        """The distribution after ``prompt + generated`` (``top_n=None``: the whole vocabulary)."""

    async def refetch_group(
        self,
        info: ServerInfo,
        prompt: Any,
        completion: Completion,
        position: int,
        members: Sequence[str],
    ) -> Refetched:
        """Log-probs of ``members`` at ``position`` of ``completion`` (after ``prompt`` and the
        tokens generated before it), from one or two more requests.
        """

    async def answer_text(self, info: ServerInfo, completion: Completion, keep: list[int]) -> str:
        """The text of the positions ``keep`` of ``completion``."""

    def check(self, info: ServerInfo, completion: Completion) -> None:
        """Raise when the completion shows the reflection tokens cannot be identified."""

    def ends_with_eog(self, completion: Completion) -> bool:
        """Whether the last position is an end-of-generation token (not part of the answer)."""

    def token_ids(self) -> TokenIds | None:
        """What tokenizes for prompts sent as ids (long form continues a path from the very
        tokens the model wrote), or ``None`` when this server only takes text.
        """


def clean_user_text(text: str) -> str:
    """User text with Self-RAG strings removed, so it cannot steer a text-prompted server."""
    for token in SELF_RAG_SPECIAL_TOKENS:
        text = text.replace(token, "")
    return text
