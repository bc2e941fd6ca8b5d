"""llama.cpp's own server (``llama-server``) through its native endpoints: ``/tokenize``,
``/completion``, ``/detokenize``, ``/props``.

Prompts go as token ids that ``/tokenize`` produced exactly as llama-cpp-python tokenizes them in
process (user text with ``parse_special: false``, reflection tokens inserted by id), and
``/completion`` reports token ids, so CONTROL- and USER_DEFINED-typed reflection tokens both work.
Every completion carries llama.cpp's greedy fields (:data:`~.greedy.GREEDY`: a sampler chain of
top-k 1 alone, no penalty, no logit bias), whatever the server was started with. A reflection
group with a token outside the returned top N is fetched exactly: one more request at that
position that lifts the group's tokens by one shared logit bias and returns their probabilities
normalised among themselves (k numbers); if that cannot isolate them, the whole vocabulary's
log-probs. The OpenAI-style API on a llama-server uses the same follow-ups.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import Any

from llama_index.packs.self_rag_rse.common.urls import mask_url
from llama_index.packs.self_rag_rse.critic.reflection import SELF_RAG_SPECIAL_TOKENS
from llama_index.packs.self_rag_rse.served.apis import Layout, Refetched, ServerInfo
from llama_index.packs.self_rag_rse.served.errors import MalformedResponse, ServerError
from llama_index.packs.self_rag_rse.served.greedy import LLAMA_CPP, greedy_options
from llama_index.packs.self_rag_rse.served.http import JSONClient
from llama_index.packs.self_rag_rse.served.wire import (
    Completion,
    MalformedBody,
    Position,
    StreamedCompletion,
    id_key,
    key_id,
    parse_native,
    parse_native_post_sampling,
    positive_count,
    split_tokens,
)

logger = logging.getLogger(__name__)

#: Separator id between texts in one ``/tokenize`` call (llama.cpp copies ids through as given).
_SEPARATOR = -1
#: Logit bias that lifts a reflection group above every other token for an exact follow-up
#: (logits of real models span a few dozen nats; float32 keeps ~1e-5 precision at 200).
_GROUP_BIAS = 200.0


class LlamaCppAPI:
    """llama.cpp's native endpoints: ``/tokenize``, ``/completion``, ``/detokenize``, ``/props``.

    Args:
        client: a client on the server's root URL (``http://host:port``, no ``/v1``).
        request_options: extra fields for every ``/completion`` body.
    """

    name = "llama.cpp"
    endpoint = "/completion"
    can_refetch = True

    def __init__(self, client: JSONClient, request_options: Mapping[str, Any] | None = None):
        self.client = client
        self.sampling = greedy_options(LLAMA_CPP, request_options or {})
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
        parts = await self._tokenize(SELF_RAG_SPECIAL_TOKENS, special=True)
        # A token the model lacks tokenizes into several pieces: it has no id here.
        ids = {
            token: part[0]
            for token, part in zip(SELF_RAG_SPECIAL_TOKENS, parts, strict=True)
            if len(part) == 1
        }
        self._special_ids = frozenset(ids.values())
        n_vocab = None
        with contextlib.suppress(ServerError, KeyError, IndexError, TypeError, AttributeError):
            models = await self.client.get("/v1/models")
            n_vocab = positive_count(models["data"][0].get("meta", {})["n_vocab"])
        if n_vocab is None:
            logger.info(
                "no n_vocab from %s: exact follow-ups are off",
                mask_url(self.client.url("/v1/models")),
            )
            self.can_refetch = False
        alias = props.get("model_alias")
        return ServerInfo(
            api=self.name,
            keys={t: id_key(i) for t, i in ids.items()},
            verified=True,
            n_ctx=positive_count(settings.get("n_ctx")),
            n_vocab=n_vocab,
            model=alias if isinstance(alias, str) else None,
            server=LLAMA_CPP,
            sampling=dict(self.sampling),
        )

    async def _tokenize(self, texts: Sequence[str], special: bool) -> list[list[int]]:
        """Token ids of each of ``texts`` from one ``/tokenize`` call; ``special``: the texts
        are special tokens (parsed as such, no BOS), else user text (BOS first, not parsed).
        """
        # The texts with a separator id between each two: one request for all.
        content = [part for text in texts for part in (text, _SEPARATOR)][:-1]
        body = await self.client.post(
            "/tokenize",
            {"content": content, "add_special": not special, "parse_special": special},
        )
        url = self.client.url("/tokenize")
        try:
            parts = split_tokens(body["tokens"], _SEPARATOR)
        except (MalformedBody, KeyError, TypeError) as exc:
            raise MalformedResponse(f"{url} answered an unexpected body: {exc}", url) from exc
        if len(parts) != len(texts):
            raise MalformedResponse(
                f"{url} split {len(texts)} texts into {len(parts)} parts: the server does not "
                "pass token ids through /tokenize content arrays",
                url,
            )
        return parts

    async def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of ``texts`` in one request: the first with BOS (if the model adds one),
        the rest without; user text is never parsed for special tokens, and Self-RAG tokens
        that llama.cpp still matches in plain text (USER_DEFINED ones) are dropped.
        """
        parts = await self._tokenize(texts, special=False)
        clean = [[t for t in part if t not in self._special_ids] for part in parts]
        dropped = sum(len(p) - len(c) for p, c in zip(parts, clean, strict=True))
        if dropped:
            logger.warning("dropped %d Self-RAG special token(s) found in user text", dropped)
        return clean

    async def prompts(self, info: ServerInfo, prompt: str, layout: Layout) -> list[Any]:
        after_prompt = _ids([info.keys[t] for t in layout.after_prompt])
        after_paragraph = _ids([info.keys[t] for t in layout.after_paragraph])
        tokens = await self.tokenize([prompt, *layout.paragraphs])
        prefix = tokens[0] + after_prompt
        bodies = tokens[1:]
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
        truncated = layout.cuts[:] = [max(0, len(body) - budget) for body in bodies]
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

    def _body(self, prompt: list[int], n_predict: int, top_n: int) -> dict[str, Any]:
        return {  # request_options may turn cache_prompt off, not change what is read back
            "cache_prompt": True,
            **self.sampling,
            "prompt": prompt,
            "n_predict": n_predict,
            "n_probs": top_n,
            # Probabilities of the raw logits (the full-vocabulary softmax), not of what the
            # sampler left: exact, and unchanged by top_k or logit_bias.
            "post_sampling_probs": False,
            "return_tokens": True,
            "stream": False,
        }

    async def complete(
        self, info: ServerInfo, prompt: Any, max_new_tokens: int, top_n: int
    ) -> Completion:
        body = self._body(prompt, max_new_tokens, top_n)
        return await self.client.post_parsed("/completion", body, parse_native)

    def stream(
        self, info: ServerInfo, prompt: Any, max_new_tokens: int, top_n: int
    ) -> AsyncGenerator[Completion, None]:
        body = {**self._body(prompt, max_new_tokens, top_n), "stream": True}
        parse = StreamedCompletion(parse_native, most=max_new_tokens)
        return self.client.stream_parsed("/completion", body, parse, lambda c: c.finished)

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
                "the server did not say its vocabulary size (n_vocab in /v1/models): cannot "
                "fetch a full distribution; pass missing_logprobs='bound', or serve the model "
                "with a llama-server that reports it",
                self.client.url("/v1/models"),
            )
        body = {
            **self._body([*prompt, *_ids(generated)], 1, n),
            "logit_bias": [[force, 1000.0]],
        }
        completion = await self.client.post_parsed("/completion", body, parse_native)
        if not completion.positions or not completion.positions[0].reported:
            url = self.client.url("/completion")
            raise MalformedResponse(f"{url} reported no log-probs for a forced token", url)
        return completion.positions[0]

    async def refetch_group(
        self,
        info: ServerInfo,
        prompt: Any,
        completion: Completion,
        position: int,
        members: Sequence[str],
    ) -> Refetched:
        generated = completion.keys[:position]
        values = await self._group(info, prompt, generated, members)
        if values is not None:
            return Refetched(values=values, requests=1)
        # Another token outranked a biased one: the whole vocabulary at that position.
        top = (await self.refetch(info, prompt, generated, None)).top or {}
        return Refetched(
            values={member: top.get(member, float("-inf")) for member in members}, requests=2
        )

    async def _group(
        self, info: ServerInfo, prompt: Any, generated: Sequence[str], members: Sequence[str]
    ) -> dict[str, float] | None:
        # The group's tokens get one and the same logit bias, large enough to put them above every
        # other token; top_k keeps exactly them and the sampler's softmax normalises them among
        # themselves. A shared bias leaves their differences, hence their ratios, as they were (to
        # float32 rounding at the bias's size: ~1e-5). Response: k numbers, not the vocabulary.
        ids = [key_id(member) for member in members]
        body = {
            **self._body([*prompt, *_ids(generated)], 1, len(ids)),
            "post_sampling_probs": True,
            "logit_bias": [[int(i), _GROUP_BIAS] for i in ids if i is not None],
            "samplers": ["top_k", "temperature"],
            "top_k": len(ids),
            "temperature": 1.0,
            "seed": 0,
        }
        found = await self.client.post_parsed("/completion", body, parse_native_post_sampling)
        # The bias isolated the group when what came back is some of it and nothing else.
        if not any(member in found for member in members) or any(k not in members for k in found):
            return None
        return {member: found.get(member, float("-inf")) for member in members}

    async def answer_text(self, info: ServerInfo, completion: Completion, keep: list[int]) -> str:
        pieces = [completion.positions[i].piece for i in keep]
        if all(piece is not None for piece in pieces):
            return b"".join(p for p in pieces if p is not None).decode("utf-8", "ignore").strip()
        # A token reported without its bytes: the server detokenizes the answer.
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

    def token_ids(self) -> LlamaCppAPI:
        """Prompts are token ids here."""
        return self


def _ids(keys: Sequence[str]) -> list[int]:
    """The ids of the id ``keys`` (text keys have none)."""
    return [i for i in map(key_id, keys) if i is not None]
