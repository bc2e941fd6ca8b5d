"""The reflection critic over a model server: Self-RAG's own tokens, scored from served log-probs.

Same prompts, same greedy decoding, same formulas and the same scoring code (``score_generation``
and ``retrieval_probability`` of :mod:`..critic.reflection`) as the in-process
:class:`~..llamacpp.reflection_critic.ReflectionCritic`; only the decoding happens elsewhere.
The gate is one request; judging k paragraphs is k concurrent requests (plus one ``/tokenize``
on llama.cpp), at most ``num_workers`` in flight.

Greedy means greedy on every server: each request turns the server's own sampling defaults
off, and a token that is not the most likely one at its position raises
:class:`~.greedy.ServerNotGreedy` (see :mod:`.greedy`).

Servers return the top N log-probs per position only. Scores need, at a few positions, every
token of one reflection group (IsREL: ``[Relevant]``/``[Irrelevant]`` at the first position;
IsSUP and IsUSE: the grounding or utility group where one was generated; the gate: ``[Retrieval]``
/``[No Retrieval]``). When one of them is missing, ``missing_logprobs`` decides:

* ``"refetch"``: one more request at that position reads the group's log-probs exactly (how,
  per server: :mod:`.llamacpp_api`, :mod:`.openai_api`); named in ``details["refetched"]``. A
  follow-up that cannot isolate the group falls back to ``"bound"``.
* ``"bound"``: the missing token's log-prob is taken as the N-th best one, an upper bound
  (it can be no likelier than the least likely token shown); named in ``details["bounded"]``.
* ``"auto"`` (default): ``"refetch"`` where the server can, ``"bound"`` elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Literal

from llama_index.core.instrumentation import get_dispatcher

from llama_index.packs.self_rag_rse.common.bridge import run_sync
from llama_index.packs.self_rag_rse.common.options import require_counts
from llama_index.packs.self_rag_rse.common.streams import unsent_rest
from llama_index.packs.self_rag_rse.common.urls import mask_url
from llama_index.packs.self_rag_rse.critic.contract import (
    BaseCritic,
    Continuation,
    ParagraphJudgement,
    RetrievalDecision,
)
from llama_index.packs.self_rag_rse.critic.reflection import (
    NO_RETRIEVAL,
    PARAGRAPH_CLOSE,
    PARAGRAPH_OPEN,
    PROMPT_TEMPLATE,
    REFLECTION_TOKENS,
    RETRIEVAL,
    MissingReflectionTokens,
    retrieval_probability,
)
from llama_index.packs.self_rag_rse.served.answers import (
    answer_of,
    each_or_error,
    group_needs,
    reflection_matrix,
    scores_of,
    text_so_far,
)
from llama_index.packs.self_rag_rse.served.apis import CompletionAPI, Layout, ServerInfo
from llama_index.packs.self_rag_rse.served.endpoint import endpoint_of, split_url
from llama_index.packs.self_rag_rse.served.errors import (
    MalformedResponse,
    ServerHTTPError,
    ServerNotReady,
)
from llama_index.packs.self_rag_rse.served.followups import Followups
from llama_index.packs.self_rag_rse.served.greedy import check_greedy, request_fields
from llama_index.packs.self_rag_rse.served.http import MAX_RESPONSE_BYTES, JSONClient
from llama_index.packs.self_rag_rse.served.llamacpp_api import LlamaCppAPI
from llama_index.packs.self_rag_rse.served.long_form import token_api, write_segments
from llama_index.packs.self_rag_rse.served.openai_api import OpenAIAPI
from llama_index.packs.self_rag_rse.served.wire import Completion

logger = logging.getLogger(__name__)
dispatcher = get_dispatcher(__name__)


class ServedReflectionCritic(BaseCritic):
    """A Self-RAG model behind a completion server, as a critic
    (:class:`~llama_index.packs.self_rag_rse.critic.contract.BaseCritic`).

    Args:
        base_url: the server, as ``http://host:port`` or its OpenAI base ``http://host:port/v1``.
        model: the ``model`` field of OpenAI-style requests (llama.cpp ignores it).
        api: ``"llama.cpp"`` (native ``/completion``: token ids, exact follow-ups), ``"openai"``
            (``/v1/completions``: tokens known by their decoded text) or ``"auto"`` (llama.cpp
            when ``/props`` answers like llama.cpp, else openai).
        api_key: sent as a bearer token when given.
        max_new_tokens: tokens generated per answer (50, like the in-process critic).
        top_logprobs: candidates returned per position (llama.cpp ``n_probs``, OpenAI
            ``logprobs``). vLLM caps it with ``--max-logprobs`` (20 by default), OpenAI at 5.
            Larger values make follow-ups rarer and responses bigger.
        missing_logprobs: what to do when a reflection token a score needs is outside the top
            ``top_logprobs``: ``"refetch"``, ``"bound"`` or ``"auto"`` (see the module docs).
        max_logprobs: the most log-probs per position the server returns, which follow-ups on
            OpenAI-style servers ask for (vLLM: its ``--max-logprobs``). ``None``: the whole
            vocabulary on llama-cpp-python's server, ``top_logprobs`` elsewhere.
        num_workers: requests in flight at once; match the server's parallel slots.
        timeout: seconds one request may take in all (sending, waiting, reading and decoding
            every byte, parsing).
        max_response_bytes: the most bytes one answer may hold, as sent and as decoded
            (16 MiB: a 50-token completion with 20 log-probs is ~88 KB); a larger answer (a
            gzip bomb, a body that never ends) is ``MalformedResponse`` naming the URL and it.
        n_ctx: positions per server slot, for shortening long paragraphs; llama.cpp reports it,
            other servers reject an over-long prompt instead (the paragraph then has ``error``).
        request_options: extra fields for every completion request, over the greedy ones the
            critic sends for the server's kind (e.g. vLLM's
            ``{"return_tokens_as_token_ids": True}``).

    Each judgement's ``details`` names the ``api`` and the ``server`` kind (``"llama.cpp"``,
    ``"llama-cpp-python"``, ``"vllm"`` or ``"openai"``) and, when it happened, the groups read
    with a follow-up (``refetched``) or a bound (``bounded``), the extra requests
    (``followup_requests``) and positions the server left unreported (``unreported_positions``).
    The engine closes a critic it built from ``llm=``; one passed as ``critic=`` is yours to
    :meth:`close` (it frees HTTP connections; the server keeps running).

    Raises (on first use, or :meth:`connect`):
        MissingReflectionTokens: the served model lacks Self-RAG's tokens.
        ReflectionTokensUnidentifiable: it has them but the API cannot tell them apart.
        ServerNotGreedy (on use): the server did not decode greedily; the message names the
            position and the option to change.
        ServerError: the server is down, too slow, redirects (``ServerRedirect``: use the final
            URL), or answers errors or unexpected bodies; the message names the URL.

    Example::

        critic = ServedReflectionCritic("http://127.0.0.1:8080")
        engine = SelfRAGQueryEngine(retriever=retriever, critic=critic)
    """

    name = "reflection"

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        api: Literal["auto", "llama.cpp", "openai"] = "auto",
        api_key: str | None = None,
        max_new_tokens: int = 50,
        top_logprobs: int = 20,
        missing_logprobs: Literal["auto", "refetch", "bound"] = "auto",
        max_logprobs: int | None = None,
        num_workers: int = 8,
        timeout: float = 120.0,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
        n_ctx: int | None = None,
        request_options: Mapping[str, Any] | None = None,
    ) -> None:
        if api not in ("auto", "llama.cpp", "openai"):
            raise ValueError(f"api must be 'auto', 'llama.cpp' or 'openai', got {api!r}")
        if missing_logprobs not in ("auto", "refetch", "bound"):
            raise ValueError(
                f"missing_logprobs must be 'auto', 'refetch' or 'bound', got {missing_logprobs!r}"
            )
        require_counts(
            "ServedReflectionCritic",
            max_new_tokens=max_new_tokens,
            top_logprobs=top_logprobs,
            n_ctx=n_ctx,
            max_logprobs=max_logprobs,
            max_response_bytes=max_response_bytes,
        )
        if max_logprobs is not None and max_logprobs < top_logprobs:
            raise ValueError(
                f"max_logprobs ({max_logprobs}) must be >= top_logprobs ({top_logprobs}): it is "
                "the most the server returns per position"
            )
        for name, value in (("model", model), ("api_key", api_key)):
            if not isinstance(value, str | None):
                raise TypeError(
                    f"ServedReflectionCritic: {name} must be a string or None, got "
                    f"{type(value).__name__}"
                )
        self.root, self.openai_base = split_url(base_url)
        self.model = model
        self.api = api
        self.max_new_tokens = max_new_tokens
        self.top_logprobs = top_logprobs
        self.missing_logprobs = missing_logprobs
        self.max_logprobs = max_logprobs
        self.n_ctx = n_ctx
        self.request_options = request_fields(request_options)
        client = functools.partial(
            JSONClient,
            timeout=timeout,
            num_workers=num_workers,
            api_key=api_key,
            max_response_bytes=max_response_bytes,
        )
        self._root_client = client(self.root)
        self._openai_client = client(self.openai_base)
        self._followups = Followups(top_logprobs, refetch=missing_logprobs != "bound")
        self._backend: CompletionAPI | None = None
        self._info: ServerInfo | None = None

    @classmethod
    def from_llm(cls, llm: Any, **kwargs: Any) -> ServedReflectionCritic:
        """The critic for the server behind an OpenAI-compatible LlamaIndex LLM.

        Reads ``api_base``, ``model``, ``api_key`` and ``timeout`` from ``llm`` (``OpenAILike``,
        ``OpenAI(api_base=...)``); ``kwargs`` override them and set the other options.
        """
        endpoint = endpoint_of(llm)
        if endpoint is None:
            raise TypeError(
                f"{type(llm).__name__} has no api_base: pass an OpenAI-compatible LLM such as "
                "OpenAILike(api_base='http://127.0.0.1:8080/v1', model=..., is_chat_model=False)"
            )
        options: dict[str, Any] = {
            "model": endpoint.model,
            "api_key": endpoint.api_key,
            **({"timeout": endpoint.timeout} if endpoint.timeout else {}),
            **kwargs,
        }
        return cls(endpoint.base_url, **options)

    # --- connecting -------------------------------------------------------------------------------

    @property
    def requests(self) -> int:
        """HTTP requests sent so far (all endpoints)."""
        return self._root_client.requests + self._openai_client.requests

    @property
    def info(self) -> ServerInfo | None:
        """What :meth:`connect` learned (``None`` before the first request)."""
        return self._info

    async def aconnect(self) -> ServerInfo:
        """Find the API, the reflection tokens' keys and the slot size (once; cached)."""
        if self._info is not None:
            return self._info
        backend = await self._pick_api()
        info = await backend.connect()
        if self.n_ctx is not None:
            info.n_ctx = self.n_ctx
        missing = [
            t for t in (*REFLECTION_TOKENS, PARAGRAPH_OPEN, PARAGRAPH_CLOSE) if t not in info.keys
        ]
        if missing:
            raise MissingReflectionTokens(missing, sorted(info.keys))
        if self.missing_logprobs == "refetch" and not backend.can_refetch:
            raise ValueError(
                f"missing_logprobs='refetch' needs a server that returns more log-probs than "
                f"a completion asks for (llama-server, llama-cpp-python's server, or "
                f"max_logprobs= for another): {mask_url(self.root)} is none; use "
                "missing_logprobs='bound'"
            )
        if not info.verified:
            logger.warning(
                "%s cannot confirm the reflection tokens (no echo): scores assume they decode to "
                "their own text; a CONTROL-typed GGUF needs llama.cpp's native API",
                mask_url(self.openai_base),
            )
        self._backend, self._info = backend, info  # connected: both are set together
        logger.info(
            "served reflection critic: %s API of %s at %s, sending %s",
            info.api,
            info.server,
            mask_url(backend.client.base_url),
            info.sampling,
        )
        return info

    def connect(self) -> ServerInfo:
        """Blocking :meth:`aconnect`."""
        return run_sync(self.aconnect())

    async def _pick_api(self) -> CompletionAPI:
        native = LlamaCppAPI(self._root_client, self.request_options)
        openai = OpenAIAPI(
            self._openai_client,
            self.model,
            self.request_options,
            root=self._root_client,
            max_logprobs=self.max_logprobs,
        )
        if self.api == "llama.cpp":
            return native
        if self.api == "openai":
            return openai
        try:
            props = await self._root_client.get("/props")
        except ServerNotReady:
            raise  # llama-server answers 503 to every path while it loads: not another server
        except (ServerHTTPError, MalformedResponse):  # not llama.cpp (404, an HTML page...)
            return openai
        llama_cpp = isinstance(props, Mapping) and "default_generation_settings" in props
        return native if llama_cpp else openai

    async def _ready(self) -> tuple[CompletionAPI, ServerInfo]:
        info = await self.aconnect()
        assert self._backend is not None
        return self._backend, info

    # --- the critic contract ----------------------------------------------------------------------

    @dispatcher.span
    async def adecide_retrieval(
        self, query: str, threshold: float | None, answer_if_skipped: bool = True
    ) -> RetrievalDecision:
        """Self-RAG's adaptive-retrieval gate, as the in-process critic decides it.

        With a ``threshold``: one request for the first position's distribution, retrieve when
        p([Retrieval]) / (p([Retrieval]) + p([No Retrieval])) exceeds it. With ``None``: the greedy
        continuation decides (retrieve when it contains ``[Retrieval]``). When retrieval is skipped
        and ``answer_if_skipped``, a second request writes the answer after ``[No Retrieval]``.
        """
        backend, info = await self._ready()
        prompt = await self._prompt(backend, info, query, Layout())
        new_tokens = 1 if threshold is not None else self.max_new_tokens
        completion = await backend.complete(info, prompt, new_tokens, self.top_logprobs)
        backend.check(info, completion)
        keys = completion.keys
        retrieval_key = info.keys[RETRIEVAL]
        if threshold is None and retrieval_key in keys:
            del completion.positions[keys.index(retrieval_key) + 1 :]
        probability = 0.0
        retrieve = False
        if completion.positions:
            await self._followups.complete_positions(
                backend, info, prompt, completion, [(0, "retrieval")]
            )
            probability = retrieval_probability(reflection_matrix(info, completion))
            # Without a threshold, the greedy continuation decides.
            retrieve = retrieval_key in keys if threshold is None else probability > threshold
        answer = None
        if not retrieve and answer_if_skipped:
            answer = await self.agenerate(query)
        logger.debug(
            "retrieval gate: p=%.4f threshold=%s retrieve=%s", probability, threshold, retrieve
        )
        return RetrievalDecision(retrieve=retrieve, probability=probability, answer=answer)

    @dispatcher.span
    async def ajudge(self, query: str, paragraphs: Sequence[str]) -> list[ParagraphJudgement]:
        """Answer from every paragraph (concurrent requests) and score each answer.

        Prompts are ``### Instruction:\\n{query}\\n\\n### Response:\\n[Retrieval]<paragraph>``
        + paragraph + ``</paragraph>``, as in process. A paragraph whose request failed comes
        back with ``error`` set (naming the URL) and zero scores; the others are kept.
        """
        if not paragraphs:
            return []
        backend, info = await self._ready()
        layout = Layout(
            after_prompt=(RETRIEVAL, PARAGRAPH_OPEN),
            paragraphs=list(paragraphs),
            after_paragraph=(PARAGRAPH_CLOSE,),
            reserve=self.max_new_tokens,
        )
        prompts = await backend.prompts(info, PROMPT_TEMPLATE.format(query=query), layout)
        results = await asyncio.gather(
            *(self._judge_one(backend, info, p) for p in prompts), return_exceptions=True
        )
        judgements = each_or_error(results, _failed_judgement)
        for judgement, cut in zip(judgements, layout.cuts, strict=False):
            if cut:  # the paragraph's tokens left out to fit n_ctx, shown in its row
                judgement.details["passage_cut"] = cut
        return judgements

    @dispatcher.span
    async def agenerate(self, query: str) -> str:
        """Answer with no evidence: greedy continuation after ``[No Retrieval]``."""
        backend, info = await self._ready()
        prompt = await self._prompt(backend, info, query, Layout(after_prompt=(NO_RETRIEVAL,)))
        completion = await backend.complete(info, prompt, self.max_new_tokens, 1)
        await self._followups.complete_positions(backend, info, prompt, completion, [])
        return await answer_of(backend, info, completion)

    async def astream_generate(self, query: str) -> AsyncIterator[str]:
        """:meth:`agenerate` through the server's streaming API: the answer's text as the server
        writes it, checked greedy token by token (``ServerNotGreedy`` stops the stream). Text
        is held back while the newest token may still be the end of generation, or when the
        server sends no bytes for a token (the rest then comes when the answer is complete).

        A stream cut short, or one that repeats an event, raises ``MalformedResponse`` naming
        the URL. When the server generated tokens it did not stream (llama-server holds back a
        token that ends inside a UTF-8 character), text is held back from there and the rest
        comes from one non-streamed request, so the pieces still join to :meth:`agenerate`'s
        answer.
        """
        backend, info = await self._ready()
        prompt = await self._prompt(backend, info, query, Layout(after_prompt=(NO_RETRIEVAL,)))
        url = backend.client.url(backend.endpoint)
        completion = Completion([], "", stopped=False)
        emitted = ""
        # Closed with this stream: a reader that stops early stops the request at once.
        async with contextlib.aclosing(
            backend.stream(info, prompt, self.max_new_tokens, 1)
        ) as chunks:
            async for chunk in chunks:
                start = len(completion.positions)
                completion.extend(chunk)
                check_greedy(
                    completion, server=info.server, url=url, sent=info.sampling, start=start
                )
                if completion.extra.get("left_out"):
                    continue
                text = text_so_far(info, completion)
                if text is not None and len(text) > len(emitted) and text.startswith(emitted):
                    yield text[len(emitted) :]
                    emitted = text
        # A token named "" (llama-cpp-python's for one ending inside a character) streamed no text.
        if completion.extra.get("left_out") or "" in completion.keys[:-1]:
            completion = await backend.complete(info, prompt, self.max_new_tokens, 1)
        await self._followups.complete_positions(backend, info, prompt, completion, [])
        final = await answer_of(backend, info, completion)
        if rest := unsent_rest(emitted, final):
            yield rest

    # --- long form ------------------------------------------------------------------------------

    writes_segments = True

    async def astart_path(self, query: str) -> tuple[int, ...]:
        """The prompt's token ids (long form needs an API that speaks token ids)."""
        backend, info = await self._ready()
        token_api(backend, self.openai_base)
        return tuple(await self._prompt(backend, info, query, Layout()))

    @dispatcher.span
    async def awrite_segments(
        self, branches: Sequence[tuple[tuple[int, ...], str]], boundary_threshold: float | None
    ) -> list[Continuation]:
        """One segment per ``(context, paragraph)``, all requests concurrent (see
        :func:`~.long_form.write_segments`); a branch whose request failed comes back with
        ``error`` set.
        """
        if not branches:
            return []
        backend, info = await self._ready()
        return await write_segments(
            backend,
            info,
            self._followups,
            branches,
            url=self.openai_base,
            max_new_tokens=self.max_new_tokens,
            top_n=self.top_logprobs,
            boundary_threshold=boundary_threshold,
        )

    def close(self) -> None:
        """Close the HTTP connections (the server, and the model on it, keep running)."""
        self._root_client.close()
        self._openai_client.close()

    # --- one paragraph ----------------------------------------------------------------------------

    async def _judge_one(
        self, backend: CompletionAPI, info: ServerInfo, prompt: Any
    ) -> ParagraphJudgement:
        completion = await backend.complete(info, prompt, self.max_new_tokens, self.top_logprobs)
        backend.check(info, completion)
        needs = group_needs(info, completion.keys, len(completion.positions))
        details = await self._followups.complete_positions(backend, info, prompt, completion, needs)
        scores = scores_of(info, completion, len(completion.positions))
        answer = await answer_of(backend, info, completion)
        return ParagraphJudgement(
            answer=answer,
            relevance=scores.relevance,
            support=scores.support,
            utility=scores.utility,
            seq_score=scores.seq_score,
            details=details,
        )

    async def _prompt(
        self, backend: CompletionAPI, info: ServerInfo, query: str, layout: Layout
    ) -> Any:
        (prompt,) = await backend.prompts(info, PROMPT_TEMPLATE.format(query=query), layout)
        return prompt


def _failed_judgement(index: int, error: str) -> ParagraphJudgement:
    """The row of a paragraph whose request failed: no answer, zero scores, the error."""
    return ParagraphJudgement(answer="", relevance=0.0, support=0.0, utility=0.0, error=error)
