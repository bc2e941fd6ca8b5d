"""Any OpenAI-style ``/v1/completions`` endpoint with ``logprobs``, as the served critic's API.

The kind of server (``/v1/models`` says who owns the model: llama-server, llama-cpp-python's
server, vLLM; anything else is a generic OpenAI-compatible server) decides three things:

* **Greedy fields** sent with every request (:data:`~.greedy.GREEDY`): llama-cpp-python's
  ``repeat_penalty`` 1.1 and vLLM's generation-config defaults are turned off.
* **Token identity.** Top log-probs are keyed by decoded text, so the reflection tokens must
  decode to their own text (USER_DEFINED on llama.cpp, ``skip_special_tokens: false`` or
  ``return_tokens_as_token_ids: true`` on vLLM); an ``echo`` probe checks it. llama-server's
  ``/v1`` entries carry token ids, and its native ``/tokenize`` gives the reflection tokens' ids
  and the prompts' (the same as in process), so CONTROL-typed tokens work there too.
* **Follow-ups** (``missing_logprobs="refetch"``) for a group with a token outside the top N,
  asking for as many log-probs as the server allows (llama-cpp-python: its whole vocabulary;
  vLLM: ``max_logprobs``, its ``--max-logprobs``). Where the keys are token ids (vLLM with
  ``return_tokens_as_token_ids``): one request of ``max_tokens=1`` after the prompt's ids (from
  vLLM's ``/tokenize``) and the generated ids, the group's members lifted by one shared
  ``logit_bias`` (a server that reports log-probs after the bias lists them first; a shared bias
  keeps their ratios). Where the keys are text: continuing the prompt by the generated text would
  re-tokenize it (llama.cpp puts a space before text that follows a special token), so the
  server regenerates the answer up to that position; greedy decoding must give back the same
  tokens and the same reported distribution, or the follow-up is not used. llama-server's
  ``/v1`` uses its native follow-ups. Where none of this works the group is bounded and flagged.
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

from llama_index.packs.self_rag_rse.common.urls import mask_url
from llama_index.packs.self_rag_rse.critic.reflection import (
    SELF_RAG_SPECIAL_TOKENS,
    MissingReflectionTokens,
)
from llama_index.packs.self_rag_rse.served.apis import (
    Layout,
    Refetched,
    ReflectionTokensUnidentifiable,
    ServerInfo,
    clean_user_text,
)
from llama_index.packs.self_rag_rse.served.errors import (
    MalformedResponse,
    ServerHTTPError,
    ServerNotReady,
)
from llama_index.packs.self_rag_rse.served.greedy import (
    LLAMA_CPP,
    LLAMA_CPP_PYTHON,
    OPENAI,
    VLLM,
    greedy_options,
    server_kind,
)
from llama_index.packs.self_rag_rse.served.http import JSONClient
from llama_index.packs.self_rag_rse.served.llamacpp_api import LlamaCppAPI
from llama_index.packs.self_rag_rse.served.wire import (
    Completion,
    MalformedBody,
    Position,
    StreamedCompletion,
    key_id,
    parse_echo_tokens,
    parse_openai,
)

logger = logging.getLogger(__name__)

#: OpenAI caps ``logit_bias`` values at 100 (vLLM clamps to it): the shared lift of a group.
_LIFT = 100.0
#: What "the whole vocabulary" is asked as where the server returns at most its vocabulary.
_WHOLE_VOCABULARY = 1 << 20
#: Largest log-prob difference between a completion's report and a regenerated one for the
#: same position (batch shapes and KV-cache rounding move them ~1e-4; another context by more).
_SAME_CONTEXT = 1e-2


class OpenAIAPI:
    """An OpenAI-style ``/v1/completions`` endpoint.

    Args:
        client: a client on the API's base URL (``http://host:port/v1``).
        model: the ``model`` field of every request.
        request_options: extra fields for every request, over the greedy ones (e.g. vLLM's
            ``{"return_tokens_as_token_ids": True}`` or ``{"skip_special_tokens": False}``).
        root: a client on the server's root (``http://host:port``), for llama-server's and
            vLLM's ``/tokenize``.
        max_logprobs: the most log-probs per position the server returns (vLLM:
            ``--max-logprobs``); ``None``: the whole vocabulary on llama-cpp-python, no more than
            a completion asked for elsewhere.
    """

    name = "openai"
    endpoint = "/completions"

    def __init__(
        self,
        client: JSONClient,
        model: str | None,
        request_options: Mapping[str, Any] | None = None,
        *,
        root: JSONClient | None = None,
        max_logprobs: int | None = None,
    ) -> None:
        self.client = client
        self.model = model
        self.request_options = dict(request_options or {})
        self.root = root
        self.max_logprobs = max_logprobs
        self.can_refetch = False
        self._native: LlamaCppAPI | None = None
        self._prompt_ids: dict[str, list[int]] = {}

    def token_ids(self) -> LlamaCppAPI | None:
        """llama-server's native API behind this one (token ids), when the server is one."""
        return self._native

    def _body(
        self, info: ServerInfo, prompt: Any, max_tokens: int, top_n: int, **extra: Any
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            **info.sampling,  # request_options too: the prompt, length and log-probs are ours
            "prompt": prompt,
            "max_tokens": max_tokens,
            "logprobs": top_n,
            **extra,
        }
        if self.model:
            body["model"] = self.model
        return body

    # --- connecting -------------------------------------------------------------------------------

    async def connect(self) -> ServerInfo:
        kind = await self._kind()
        sampling = greedy_options(kind, self.request_options)
        if kind == LLAMA_CPP and self.root is not None:
            # llama-server: ids from its native /tokenize, the same server's follow-ups.
            self._native = LlamaCppAPI(self.root, self.request_options)
            native = await self._native.connect()
            self.can_refetch = True
            return replace(native, api=self.name, model=self.model, sampling=sampling)
        info = await self._echo_probe(kind, sampling)
        ids = all(key_id(k) is not None for k in info.keys.values())
        lifted = ids and kind == VLLM and self.root is not None
        self.can_refetch = lifted or self._most(info) is not None
        return info

    async def _kind(self) -> str:
        try:
            models = await self.client.get("/models")
        except ServerNotReady:
            raise  # loading its model, restarting, or a proxy's 502: ask again, nothing cached
        except (ServerHTTPError, MalformedResponse) as exc:
            logger.info(
                "%s did not answer (%s): a generic server",
                mask_url(self.client.url("/models")),
                exc,
            )
            return OPENAI
        kind = server_kind(models)
        logger.info("%s is served by %s", mask_url(self.client.base_url), kind)
        return kind

    async def _echo_probe(self, kind: str, sampling: dict[str, Any]) -> ServerInfo:
        # Echo the Self-RAG strings back as prompt tokens: each must come back as one token
        # whose text (or token_id:<id>) names it. Servers without echo cannot be checked.
        probe = "".join(SELF_RAG_SPECIAL_TOKENS)
        info = ServerInfo(
            api=self.name, keys={}, verified=False, model=self.model, server=kind, sampling=sampling
        )
        try:
            body = await self.client.post(
                "/completions", self._body(info, probe, max_tokens=1, top_n=1, echo=True)
            )
            tokens = parse_echo_tokens(body)
            text = body["choices"][0].get("text", "")
            if not (isinstance(text, str) and text.startswith(probe)):
                # llama.cpp's /v1/completions ignores echo and just completes.
                raise MalformedBody("the answer does not echo the prompt")
        except ServerNotReady:
            raise
        except (ServerHTTPError, MalformedResponse, MalformedBody) as exc:
            logger.info(
                "%s cannot echo prompt tokens (%s): the reflection tokens are assumed to decode to "
                "their own text",
                mask_url(self.client.url("/completions")),
                exc,
            )
            info.keys = {t: t for t in SELF_RAG_SPECIAL_TOKENS}
            return info
        return replace(info, keys=self._keys(tokens), verified=True)

    def _keys(self, echoed: Sequence[str]) -> dict[str, str]:
        n = len(SELF_RAG_SPECIAL_TOKENS)
        tail = list(echoed[-n:])
        if len(tail) == n and all(key_id(key) is not None for key in tail):
            return dict(zip(SELF_RAG_SPECIAL_TOKENS, tail, strict=True))
        found = [token for token in SELF_RAG_SPECIAL_TOKENS if token in echoed]
        if len(found) == n:
            return {token: token for token in SELF_RAG_SPECIAL_TOKENS}
        # Most of them echoed as "": they are there, but decode to nothing.
        if len(tail) == n and sum(1 for key in tail if key == "") > n // 2:
            raise ReflectionTokensUnidentifiable(self._unidentifiable())
        raise MissingReflectionTokens(
            [token for token in SELF_RAG_SPECIAL_TOKENS if token not in found], found
        )

    def _unidentifiable(self) -> str:
        return mask_url(
            f"{self.client.url('/completions')} decodes the Self-RAG reflection tokens to empty "
            "strings (the GGUF types them CONTROL, or the server skips special tokens), so its "
            "log-probs, keyed by decoded text, cannot tell them apart: serve the model with "
            "llama.cpp's llama-server, whose log-probs carry token ids; on vLLM pass "
            "request_options={'return_tokens_as_token_ids': True}"
        )

    # --- completions ------------------------------------------------------------------------------

    async def prompts(self, info: ServerInfo, prompt: str, layout: Layout) -> list[Any]:
        if self._native is not None:
            return await self._native.prompts(info, prompt, layout)  # token ids
        head = clean_user_text(prompt) + "".join(layout.after_prompt)
        if not layout.paragraphs:
            return [head]
        closing = "".join(layout.after_paragraph)
        return [head + clean_user_text(p) + closing for p in layout.paragraphs]

    async def complete(
        self, info: ServerInfo, prompt: Any, max_new_tokens: int, top_n: int
    ) -> Completion:
        body = self._body(info, prompt, max_tokens=max_new_tokens, top_n=top_n)
        parse = partial(parse_openai, with_ids=self._native is not None)
        completion = await self.client.post_parsed("/completions", body, parse)
        if completion.positions and not any(p.top for p in completion.positions):
            url = self.client.url("/completions")
            raise MalformedResponse(
                f"{url} returned no top log-probs (asked {top_n}): the server, or a proxy before "
                "it, drops the logprobs field; serve the model with llama.cpp's llama-server, "
                "llama-cpp-python's server or vLLM, which return it",
                url,
            )
        return completion

    def stream(
        self, info: ServerInfo, prompt: Any, max_new_tokens: int, top_n: int
    ) -> AsyncGenerator[Completion, None]:
        body = self._body(info, prompt, max_tokens=max_new_tokens, top_n=top_n, stream=True)
        parse = StreamedCompletion(
            partial(parse_openai, with_ids=self._native is not None, chunk=True),
            most=max_new_tokens,
        )
        return self.client.stream_parsed("/completions", body, parse, lambda c: c.finished)

    async def refetch(
        self, info: ServerInfo, prompt: Any, generated: Sequence[str], top_n: int | None
    ) -> Position:
        if self._native is not None:
            return await self._native.refetch(info, prompt, generated, top_n)
        n = top_n if top_n is not None else (self._most(info) or 1)
        # Text keys: the server regenerates the answer up to the position, which it must report.
        got = await self.complete(info, prompt, len(generated) + 1, n)
        same_tokens = got.keys[: len(generated)] == list(generated)
        if not same_tokens or len(got.positions) <= len(generated):
            url = self.client.url("/completions")
            raise MalformedResponse(
                f"{url} did not regenerate a position it left unreported (greedy decoding gave "
                "other tokens, or fewer): pass missing_logprobs='bound', or serve the model with "
                "llama.cpp's llama-server, whose follow-ups need no regeneration",
                url,
            )
        return got.positions[len(generated)]

    async def refetch_group(
        self,
        info: ServerInfo,
        prompt: Any,
        completion: Completion,
        position: int,
        members: Sequence[str],
    ) -> Refetched:
        if self._native is not None:
            n = len(completion.positions)
            if completion.extra.get("completion_tokens", n) != n:
                return Refetched(
                    values=None, requests=0, why="the server left positions out of its log-probs"
                )
            return await self._native.refetch_group(info, prompt, completion, position, members)
        reported = completion.positions[position]
        shown = len(reported.top or {})
        most = max(self._most(info) or shown, shown)
        id_keyed = all(key_id(member) is not None for member in members)
        if id_keyed and info.server == VLLM and self.root is not None:
            return await self._lifted(info, prompt, completion, position, members, most=most)
        if most <= shown:
            return Refetched(
                values=None, requests=0, why=f"the server returns no more than the {shown} shown"
            )
        # Text keys: continuing the prompt by the generated text would re-tokenize it (llama.cpp
        # puts a space before text that follows a special token), so the server regenerates the
        # answer up to the position instead; greedy decoding must give the same tokens again.
        got = await self.complete(info, prompt, position + 1, most)
        if got.keys[: position + 1] != completion.keys[: position + 1]:
            return Refetched(values=None, requests=1, why="the server regenerated other tokens")
        again = got.positions[position]
        top = again.top or {}
        # Same context, same numbers: the token's own log-prob and the group members shown.
        # (Not every key: keys are decoded text, and tokens that decode alike share one.)
        pairs = [(again.logprob, reported.logprob)]
        pairs += [(top.get(m), value) for m, value in (reported.top or {}).items() if m in members]
        if any(
            now is None or before is None or abs(now - before) > _SAME_CONTEXT
            for now, before in pairs
        ):
            return Refetched(
                values=None, requests=1, why="the server regenerated another distribution"
            )
        if any(member not in top for member in members):
            return Refetched(values=None, requests=1, why=f"the group is not in the top {len(top)}")
        return Refetched(values={member: top[member] for member in members}, requests=1)

    async def _lifted(
        self,
        info: ServerInfo,
        prompt: Any,
        completion: Completion,
        position: int,
        members: Sequence[str],
        *,
        most: int,
    ) -> Refetched:
        """One token after the prompt's ids (vLLM's /tokenize) and the generated ids, the
        group lifted by one shared logit bias: a server that reports log-probs after the bias
        lists the group first; their ratios are the raw ones. ``most``: the log-probs to ask
        for (as many as the server returns, at least as many as the completion showed).
        """
        generated = [key_id(key) for key in completion.keys[:position]]
        if any(i is None for i in generated):
            return Refetched(values=None, requests=0, why="a generated token has no id")
        requests = 0
        continued = prompt
        if generated:
            head = self._prompt_ids.get(prompt)
            if head is None:
                head = await self._tokenize(prompt)
                self._prompt_ids[prompt] = head
                requests += 1
            continued = head + [int(i) for i in generated if i is not None]
        bias = {str(key_id(member)): _LIFT for member in members}
        body = self._body(info, continued, max_tokens=1, top_n=most, logit_bias=bias)
        got = await self.client.post_parsed("/completions", body, parse_openai)
        requests += 1
        top = got.positions[0].top if got.positions else None
        if not top or any(member not in top for member in members):
            return Refetched(
                values=None, requests=requests, why="the lifted group is not in the top reported"
            )
        return Refetched(values={member: top[member] for member in members}, requests=requests)

    async def _tokenize(self, prompt: str) -> list[int]:
        """The prompt's token ids from vLLM's ``/tokenize`` (as its completions tokenize it)."""
        assert self.root is not None
        body: dict[str, Any] = {"prompt": prompt, "add_special_tokens": True}
        if self.model:
            body["model"] = self.model
        answer = await self.root.post("/tokenize", body)
        tokens = answer.get("tokens") if isinstance(answer, Mapping) else None
        if isinstance(tokens, list) and all(
            isinstance(token, int) and not isinstance(token, bool) for token in tokens
        ):
            return tokens
        url = self.root.url("/tokenize")
        raise MalformedResponse(f"{url} answered no 'tokens' list of token ids", url)

    def _most(self, info: ServerInfo) -> int | None:
        """The most log-probs per position this server returns, when known."""
        if self.max_logprobs is not None:
            return self.max_logprobs
        return _WHOLE_VOCABULARY if info.server == LLAMA_CPP_PYTHON else None

    async def answer_text(self, info: ServerInfo, completion: Completion, keep: list[int]) -> str:
        if self._native is not None:
            return await self._native.answer_text(info, completion, keep)
        # Decoded text per token: join the kept ones (keys are text here), unless ids or a token
        # named "" (llama-cpp-python's name for one that ends inside a character) stand there.
        keys = [completion.positions[i].key for i in keep]
        if "" in keys or any(key_id(key) is not None for key in keys):
            return _strip_markup(completion.text)
        return "".join(keys).strip()

    def check(self, info: ServerInfo, completion: Completion) -> None:
        # A Self-RAG answer starts with a reflection token; "" there means it decoded to nothing.
        keys = completion.keys
        if len(keys) > 1 and keys[0] == "" and "" not in info.keys.values():
            raise ReflectionTokensUnidentifiable(self._unidentifiable())

    def ends_with_eog(self, completion: Completion) -> bool:
        """Servers differ in listing the end token: count it only when it looks like one."""
        if not (completion.stopped and completion.positions):
            return False
        if self._native is not None:
            return True  # llama-server lists it last, as natively
        last = completion.positions[-1].key
        # Nothing, or a special token's text, as "</s>" or "<|im_end|>".
        return last == "" or (last.startswith("<") and last.endswith(">") and " " not in last)


def _strip_markup(text: str) -> str:
    """Answer text without quoted evidence or reflection strings (for id-keyed servers)."""
    return clean_user_text(re.sub(r"<paragraph>.*?(</paragraph>|$)", "", text, flags=re.S)).strip()
