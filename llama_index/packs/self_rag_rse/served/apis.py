"""The two completion APIs the served reflection critic speaks, behind one small interface.

* :class:`LlamaCppAPI`: llama.cpp's own server (``llama-server``). Prompts go as token ids that
  ``/tokenize`` produced exactly as llama-cpp-python tokenizes them in process (user text with
  ``parse_special: false``, reflection tokens inserted by id), and ``/completion`` reports token
  ids, so CONTROL- and USER_DEFINED-typed reflection tokens both work. A reflection group with
  a token outside the returned top N is fetched exactly: one more request at that position that
  lifts the group's tokens by one shared logit bias and returns their probabilities normalised
  among themselves (k numbers); if that cannot isolate them, the whole vocabulary's log-probs.
* :class:`OpenAIAPI`: any ``/v1/completions`` endpoint with ``logprobs`` (vLLM, llama-cpp-python's
  server, llama.cpp's ``/v1``). Prompts go as text; top log-probs are keyed by decoded strings,
  so the reflection tokens must decode to their own text (USER_DEFINED on llama.cpp,
  ``skip_special_tokens: false`` or ``return_tokens_as_token_ids: true`` on vLLM). There is no
  exact follow-up for a token outside the top N: its log-prob is bounded by the N-th one, and
  the judgement says so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from llama_index.packs.self_rag_rse.self_rag.reflection import SELF_RAG_SPECIAL_TOKENS
from llama_index.packs.self_rag_rse.served.http import JSONClient, MalformedResponse, ServerError
from llama_index.packs.self_rag_rse.served.wire import (
    Completion,
    MalformedBody,
    Position,
    id_key,
    key_id,
    parse_echo_tokens,
    parse_native,
    parse_native_post_sampling,
    parse_openai,
    split_tokens,
)

logger = logging.getLogger(__name__)

#: Separator id between texts in one ``/tokenize`` call (llama.cpp copies ids through as given).
_SEPARATOR = -1
#: Logit bias that lifts a reflection group above every other token for an exact follow-up
#: (logits of real models span a few dozen nats; float32 keeps ~1e-5 precision at 200).
_GROUP_BIAS = 200.0

T = TypeVar("T")


async def _post(
    client: JSONClient, path: str, body: Mapping[str, Any], parse: Callable[[Any], T]
) -> T:
    """POST ``body`` to ``path`` and ``parse`` the answer; an unexpected body names the URL."""
    answer = await client.post(path, body)
    try:
        return parse(answer)
    except MalformedBody as exc:
        url = client.url(path)
        raise MalformedResponse(f"{url} answered an unexpected body: {exc}", url) from exc


class ReflectionTokensUnidentifiable(ValueError):
    """The server has the reflection tokens but its log-probs cannot tell which token is which."""


@dataclass
class ServerInfo:
    """What the critic learned about the server once, before its first request.

    ``keys`` maps each Self-RAG special string to the key its token has in this API's
    log-probs (``token_id:<id>`` or the string itself); ``verified`` says whether the server
    confirmed them (an OpenAI-style server without ``echo`` cannot).
    """

    api: str
    keys: dict[str, str]
    verified: bool
    n_ctx: int | None = None
    n_vocab: int | None = None
    model: str | None = None


@dataclass
class Layout:
    """Where Self-RAG strings go around user text: ``prompt + after_prompt``, then per
    paragraph ``paragraph + after_paragraph`` (one prompt each; none: one prompt in all).
    ``reserve`` positions are kept free for the answer when a paragraph must be shortened."""

    after_prompt: Sequence[str] = ()
    paragraphs: Sequence[str] = ()
    after_paragraph: Sequence[str] = ()
    reserve: int = 0


class CompletionAPI(Protocol):
    """What the critic needs from a server API."""

    name: str
    client: JSONClient
    #: Whether :meth:`refetch` can return the exact distribution at any position.
    can_refetch: bool

    async def connect(self) -> ServerInfo:
        """Learn the reflection tokens' keys and the context size."""
        ...

    async def prompts(self, info: ServerInfo, prompt: str, layout: Layout) -> list[Any]:
        """The prompts ``layout`` describes around the user text ``prompt``."""
        ...

    async def complete(self, prompt: Any, max_new_tokens: int, top_n: int) -> Completion:
        """Greedy continuation with the top-``top_n`` log-probs of every position."""
        ...

    async def refetch(
        self, info: ServerInfo, prompt: Any, generated: Sequence[str], top_n: int | None
    ) -> Position:
        """The distribution after ``prompt + generated`` (``top_n=None``: the whole vocabulary)."""
        ...

    async def refetch_group(
        self, info: ServerInfo, prompt: Any, generated: Sequence[str], members: Sequence[str]
    ) -> dict[str, float] | None:
        """Log-probs of ``members`` after ``prompt + generated``, normalised among themselves
        (enough for every score, which compares a group's tokens only); ``None`` when the server
        could not isolate them."""
        ...

    async def answer_text(self, info: ServerInfo, completion: Completion, keep: list[int]) -> str:
        """The text of the positions ``keep`` of ``completion``."""
        ...

    def check(self, info: ServerInfo, completion: Completion) -> None:
        """Raise when the completion shows the reflection tokens cannot be identified."""
        ...

    def ends_with_eog(self, completion: Completion) -> bool:
        """Whether the last position is an end-of-generation token (not part of the answer)."""
        ...


def _clean_user_text(text: str) -> str:
    """User text with Self-RAG strings removed, so it cannot steer a text-prompted server."""
    for token in SELF_RAG_SPECIAL_TOKENS:
        text = text.replace(token, "")
    return text


class LlamaCppAPI:
    """llama.cpp's native endpoints: ``/tokenize``, ``/completion``, ``/detokenize``, ``/props``.

    Args:
        client: a client on the server's root URL (``http://host:port``, no ``/v1``).
        request_options: extra fields for every ``/completion`` body.
    """

    name = "llama.cpp"
    can_refetch = True

    def __init__(self, client: JSONClient, request_options: Mapping[str, Any] | None = None):
        self.client = client
        self.request_options = dict(request_options or {})
        self._special_ids: frozenset[int] = frozenset()

    async def connect(self) -> ServerInfo:
        props = await self.client.get("/props")
        settings = props.get("default_generation_settings") if isinstance(props, Mapping) else None
        if not isinstance(settings, Mapping):
            raise MalformedResponse(
                f"{self.client.url('/props')} is not llama.cpp's /props (no "
                "default_generation_settings): use api='openai' for other servers",
                self.client.url("/props"),
            )
        n_ctx = settings.get("n_ctx")
        content: list[Any] = []
        for token in SELF_RAG_SPECIAL_TOKENS:
            content += [token, _SEPARATOR]
        body = await self.client.post(
            "/tokenize", {"content": content[:-1], "add_special": False, "parse_special": True}
        )
        parts = self._split(body, len(SELF_RAG_SPECIAL_TOKENS))
        ids = {t: p[0] for t, p in zip(SELF_RAG_SPECIAL_TOKENS, parts, strict=True) if len(p) == 1}
        self._special_ids = frozenset(ids.values())
        n_vocab = None
        try:
            models = await self.client.get("/v1/models")
            meta = models["data"][0].get("meta", {})
            n_vocab = int(meta["n_vocab"])
        except (ServerError, KeyError, IndexError, TypeError, ValueError, AttributeError):
            logger.info(
                "no n_vocab from %s: exact follow-ups are off", self.client.url("/v1/models")
            )
            self.can_refetch = False
        model = props.get("model_alias") if isinstance(props.get("model_alias"), str) else None
        return ServerInfo(
            api=self.name,
            keys={t: id_key(i) for t, i in ids.items()},
            verified=True,
            n_ctx=int(n_ctx) if isinstance(n_ctx, int) else None,
            n_vocab=n_vocab,
            model=model,
        )

    def _split(self, body: Any, expected: int) -> list[list[int]]:
        url = self.client.url("/tokenize")
        try:
            tokens = body["tokens"]
            parts = split_tokens(tokens, _SEPARATOR)
        except (MalformedBody, KeyError, TypeError) as exc:
            raise MalformedResponse(f"{url} answered an unexpected body: {exc}", url) from exc
        if len(parts) != expected:
            raise MalformedResponse(
                f"{url} split {expected} texts into {len(parts)} parts: the server does not pass "
                "token ids through /tokenize content arrays",
                url,
            )
        return parts

    async def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of ``texts`` in one request: the first with BOS (if the model adds one),
        the rest without; user text is never parsed for special tokens, and Self-RAG tokens
        that llama.cpp still matches in plain text (USER_DEFINED ones) are dropped."""
        content: list[Any] = []
        for text in texts:
            content += [text, _SEPARATOR]
        body = await self.client.post(
            "/tokenize", {"content": content[:-1], "add_special": True, "parse_special": False}
        )
        parts = self._split(body, len(texts))
        clean = [[t for t in part if t not in self._special_ids] for part in parts]
        dropped = sum(len(p) - len(c) for p, c in zip(parts, clean, strict=True))
        if dropped:
            logger.warning("dropped %d Self-RAG special token(s) found in user text", dropped)
        return clean

    async def prompts(self, info: ServerInfo, prompt: str, layout: Layout) -> list[Any]:
        after_prompt = self._ids(info, layout.after_prompt)
        after_paragraph = self._ids(info, layout.after_paragraph)
        tokens = await self.tokenize([prompt, *layout.paragraphs])
        prefix, bodies = tokens[0] + after_prompt, tokens[1:]
        if not layout.paragraphs:
            return [prefix]
        if info.n_ctx is None:
            return [prefix + body + after_paragraph for body in bodies]
        # Like the in-process decoder: shorten paragraphs from their end, never the prompt.
        budget = info.n_ctx - len(prefix) - len(after_paragraph) - layout.reserve
        if budget < 0:
            raise ValueError(
                f"the prompt ({len(prefix)} tokens) and {layout.reserve} new tokens exceed the "
                f"server's n_ctx={info.n_ctx} per slot: shorten the query or raise the server's -c"
            )
        truncated = [max(0, len(body) - budget) for body in bodies]
        feeds = [
            body[: len(body) - cut] + after_paragraph
            for body, cut in zip(bodies, truncated, strict=True)
        ]
        if any(truncated):
            logger.warning(
                "%d of %d paragraph(s) truncated to fit the server's n_ctx=%d per slot: dropped "
                "%s tokens from their ends (raise the server's -c or lower --parallel)",
                sum(1 for c in truncated if c),
                len(truncated),
                info.n_ctx,
                truncated,
            )
        return [prefix + feed for feed in feeds]

    @staticmethod
    def _ids(info: ServerInfo, strings: Sequence[str]) -> list[int]:
        ids = [key_id(info.keys[t]) for t in strings]
        return [int(i) for i in ids if i is not None]

    def _body(self, prompt: list[int], n_predict: int, top_n: int) -> dict[str, Any]:
        return {
            "prompt": prompt,
            "n_predict": n_predict,
            "n_probs": top_n,
            # Probabilities of the raw logits (the full-vocabulary softmax), not of what the
            # sampler left: exact, and unchanged by top_k or logit_bias.
            "post_sampling_probs": False,
            "temperature": 0.0,
            "top_k": 1,
            "return_tokens": True,
            "cache_prompt": True,
            "stream": False,
            **self.request_options,
        }

    async def complete(self, prompt: Any, max_new_tokens: int, top_n: int) -> Completion:
        body = self._body(prompt, max_new_tokens, top_n)
        return await _post(self.client, "/completion", body, parse_native)

    async def refetch(
        self, info: ServerInfo, prompt: Any, generated: Sequence[str], top_n: int | None
    ) -> Position:
        # One generated token, forced with a logit bias to a whole token (</paragraph>) so the
        # server reports it even when the greedy token would end inside a UTF-8 character; the
        # reported probabilities are the raw logits', which the bias does not touch.
        force = key_id(info.keys[SELF_RAG_SPECIAL_TOKENS[-1]])
        n = top_n if top_n is not None else info.n_vocab
        if n is None:
            raise ServerError(
                "the server did not say its vocabulary size: cannot fetch a full distribution",
                self.client.url("/v1/models"),
            )
        ids = [key_id(k) for k in generated]
        body = self._body(list(prompt) + [int(i) for i in ids if i is not None], 1, n)
        body["logit_bias"] = [[force, 1000.0]]
        completion = await _post(self.client, "/completion", body, parse_native)
        if not completion.positions or not completion.positions[0].reported:
            url = self.client.url("/completion")
            raise MalformedResponse(f"{url} reported no log-probs for a forced token", url)
        return completion.positions[0]

    async def refetch_group(
        self, info: ServerInfo, prompt: Any, generated: Sequence[str], members: Sequence[str]
    ) -> dict[str, float] | None:
        # The group's tokens get one and the same logit bias, large enough to put them above
        # every other token; top_k keeps exactly them and the sampler's softmax normalises them
        # among themselves. A shared bias leaves their differences, hence their ratios, as they
        # were (to float32 rounding at the bias's size: ~1e-5). Response: k numbers, not the
        # vocabulary.
        ids = [key_id(m) for m in members]
        gen = [key_id(k) for k in generated]
        body = self._body(list(prompt) + [int(i) for i in gen if i is not None], 1, len(ids))
        body.update(
            {
                "post_sampling_probs": True,
                "logit_bias": [[int(i), _GROUP_BIAS] for i in ids if i is not None],
                "samplers": ["top_k", "temperature"],
                "top_k": len(ids),
                "temperature": 1.0,
                "seed": 0,
            }
        )
        found = await _post(self.client, "/completion", body, parse_native_post_sampling)
        if not any(m in found for m in members) or any(k not in members for k in found):
            return None  # another token outranked a biased one: fetch the whole vocabulary
        return {m: found.get(m, float("-inf")) for m in members}

    async def answer_text(self, info: ServerInfo, completion: Completion, keep: list[int]) -> str:
        pieces = [completion.positions[i].piece for i in keep]
        if all(p is not None for p in pieces):
            raw = b"".join(p for p in pieces if p is not None)
            return raw.decode("utf-8", errors="ignore").strip()
        ids = [key_id(completion.positions[i].key) for i in keep]
        body = await self.client.post("/detokenize", {"tokens": ids})
        content = body.get("content") if isinstance(body, Mapping) else None
        if not isinstance(content, str):
            url = self.client.url("/detokenize")
            raise MalformedResponse(f"{url} answered no 'content'", url)
        return content.strip()

    def check(self, info: ServerInfo, completion: Completion) -> None:
        """Ids identify every token: nothing to check."""

    def ends_with_eog(self, completion: Completion) -> bool:
        """llama.cpp reports the end-of-generation token as the last one (``stop_type: eos``)."""
        return completion.stopped and bool(completion.positions)


class OpenAIAPI:
    """An OpenAI-style ``/v1/completions`` endpoint.

    Args:
        client: a client on the API's base URL (``http://host:port/v1``).
        model: the ``model`` field of every request.
        request_options: extra fields for every request (e.g. vLLM's
            ``{"return_tokens_as_token_ids": True}`` or ``{"skip_special_tokens": False}``).
    """

    name = "openai"
    can_refetch = False

    def __init__(
        self,
        client: JSONClient,
        model: str | None,
        request_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.client = client
        self.model = model
        self.request_options = dict(request_options or {})

    def _body(self, prompt: str, max_tokens: int, top_n: int, **extra: Any) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "logprobs": top_n,
            **extra,
            **self.request_options,
        }
        if self.model:
            body["model"] = self.model
        return body

    async def connect(self) -> ServerInfo:
        # Echo the Self-RAG strings back as prompt tokens: each must come back as one token
        # whose text (or token_id:<id>) names it. Servers without echo cannot be checked.
        probe = "".join(SELF_RAG_SPECIAL_TOKENS)
        try:
            body = await self.client.post("/completions", self._body(probe, 1, 1, echo=True))
            tokens = parse_echo_tokens(body)
            text = body["choices"][0].get("text", "")
            if not (isinstance(text, str) and text.startswith(probe)):
                # llama.cpp's /v1/completions ignores echo and just completes.
                raise MalformedBody("the answer does not echo the prompt")
        except (ServerError, MalformedBody) as exc:
            logger.info(
                "%s cannot echo prompt tokens (%s): the reflection tokens are assumed to decode to "
                "their own text",
                self.client.url("/completions"),
                exc,
            )
            keys = {t: t for t in SELF_RAG_SPECIAL_TOKENS}
            return ServerInfo(api=self.name, keys=keys, verified=False, model=self.model)
        return ServerInfo(api=self.name, keys=self._keys(tokens), verified=True, model=self.model)

    def _keys(self, echoed: Sequence[str]) -> dict[str, str]:
        from llama_index.packs.self_rag_rse.self_rag.reflection_critic import (
            MissingReflectionTokens,
        )

        n = len(SELF_RAG_SPECIAL_TOKENS)
        tail = list(echoed[-n:])
        if len(tail) == n and all(key_id(k) is not None for k in tail):
            return dict(zip(SELF_RAG_SPECIAL_TOKENS, tail, strict=True))
        found = [t for t in SELF_RAG_SPECIAL_TOKENS if t in echoed]
        if len(found) == n:
            return {t: t for t in SELF_RAG_SPECIAL_TOKENS}
        if len(tail) == n and sum(1 for k in tail if k == "") > n // 2:
            raise ReflectionTokensUnidentifiable(self._unidentifiable())
        missing = [t for t in SELF_RAG_SPECIAL_TOKENS if t not in found]
        raise MissingReflectionTokens(missing, found)

    def _unidentifiable(self) -> str:
        return (
            f"{self.client.url('/completions')} decodes the Self-RAG reflection tokens to empty "
            "strings (the GGUF types them CONTROL, or the server skips special tokens), so its "
            "log-probs, keyed by decoded text, cannot tell them apart: serve the model with "
            "llama.cpp's llama-server and use its native API (api='llama.cpp'), which reports "
            "token ids; on vLLM pass request_options={'return_tokens_as_token_ids': True}"
        )

    async def prompts(self, info: ServerInfo, prompt: str, layout: Layout) -> list[Any]:
        head = _clean_user_text(prompt) + "".join(layout.after_prompt)
        if not layout.paragraphs:
            return [head]
        closing = "".join(layout.after_paragraph)
        return [head + _clean_user_text(p) + closing for p in layout.paragraphs]

    async def complete(self, prompt: Any, max_new_tokens: int, top_n: int) -> Completion:
        body = self._body(prompt, max_new_tokens, top_n)
        return await _post(self.client, "/completions", body, parse_openai)

    async def refetch(
        self, info: ServerInfo, prompt: Any, generated: Sequence[str], top_n: int | None
    ) -> Position:
        raise ServerError(
            "an OpenAI-style /v1/completions endpoint cannot score a token outside its top "
            "logprobs: use missing_logprobs='bound'",
            self.client.url("/completions"),
        )

    async def refetch_group(
        self, info: ServerInfo, prompt: Any, generated: Sequence[str], members: Sequence[str]
    ) -> dict[str, float] | None:
        await self.refetch(info, prompt, generated, None)  # raises: no exact follow-up here
        return None

    async def answer_text(self, info: ServerInfo, completion: Completion, keep: list[int]) -> str:
        # Decoded text per token: join the kept ones (keys are text here, unless ids).
        if any(key_id(completion.positions[i].key) is not None for i in keep):
            return _strip_markup(completion.text)
        return "".join(completion.positions[i].key for i in keep).strip()

    def check(self, info: ServerInfo, completion: Completion) -> None:
        # A Self-RAG answer starts with a reflection token; "" there means it decoded to nothing.
        keys = completion.keys
        if len(keys) > 1 and keys[0] == "" and "" not in info.keys.values():
            raise ReflectionTokensUnidentifiable(self._unidentifiable())

    def ends_with_eog(self, completion: Completion) -> bool:
        """Servers differ in listing the end token: count it only when it looks like one."""
        if not (completion.stopped and completion.positions):
            return False
        last = completion.positions[-1].key
        return last == "" or (last.startswith("<") and last.endswith(">") and " " not in last)


def _strip_markup(text: str) -> str:
    """Answer text without quoted evidence or reflection strings (for id-keyed servers)."""
    import re

    text = re.sub(r"<paragraph>.*?(</paragraph>|$)", "", text, flags=re.S)
    return _clean_user_text(text).strip()
