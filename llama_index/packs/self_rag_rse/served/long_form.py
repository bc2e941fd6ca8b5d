"""Long-form Self-RAG over a served model: one segment per (path, passage), written by the server.

A path continues from the very tokens the model wrote, which only an API that speaks token ids
can send back (:func:`token_api`). Each passage is wrapped as ``[Retrieval]<paragraph>...
</paragraph>`` and cut from its end to fit the server's slot (:func:`fit_passage`); the greedy
completion is cut at its first boundary and scored as the in-process critic scores it
(:func:`write_segment`). Every segment of a depth is one concurrent request
(:func:`write_segments`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from llama_index.packs.self_rag_rse.common.urls import mask_url
from llama_index.packs.self_rag_rse.critic.contract import Continuation
from llama_index.packs.self_rag_rse.critic.reflection import (
    NO_RETRIEVAL,
    PARAGRAPH_CLOSE,
    PARAGRAPH_OPEN,
    RETRIEVAL,
    retrieval_probability,
)
from llama_index.packs.self_rag_rse.served.answers import (
    answer_of,
    each_or_error,
    group_needs,
    reflection_matrix,
    scores_of,
)
from llama_index.packs.self_rag_rse.served.apis import CompletionAPI, ServerInfo, TokenIds
from llama_index.packs.self_rag_rse.served.followups import Followups
from llama_index.packs.self_rag_rse.served.wire import Position, key_id

logger = logging.getLogger(__name__)


async def write_segments(
    backend: CompletionAPI,
    info: ServerInfo,
    followups: Followups,
    branches: Sequence[tuple[tuple[int, ...], str]],
    *,
    url: str,
    max_new_tokens: int,
    top_n: int,
    boundary_threshold: float | None,
) -> list[Continuation]:
    """One segment per ``(context, paragraph)`` branch, all requests concurrent (``url`` for
    the messages); a branch whose request failed comes back with ``error`` set, and one whose
    passage was cut to fit the slot says by how many tokens in ``details["passage_cut"]``.
    """
    before, after = paragraph_marks(info)
    texts = ["", *(paragraph for _, paragraph in branches)]  # the first gets BOS
    tokenized = await token_api(backend, url).tokenize(texts)
    passages = [[*before, *body, *after] for body in tokenized[1:]]
    prompts = [
        fit_passage(info, context, passage, max_new_tokens)
        for (context, _), passage in zip(branches, passages, strict=True)
    ]
    writes = [
        write_segment(
            backend,
            info,
            followups,
            prompt=prompt,
            context=context,
            max_new_tokens=max_new_tokens,
            top_n=top_n,
            boundary_threshold=boundary_threshold,
        )
        for (context, _), prompt in zip(branches, prompts, strict=True)
    ]
    results = await asyncio.gather(*writes, return_exceptions=True)

    def failed(index: int, error: str) -> Continuation:
        return Continuation(
            answer="",
            relevance=0.0,
            support=0.0,
            utility=0.0,
            error=error,
            context=branches[index][0],
            stop="error",
        )

    segments = each_or_error(results, failed)
    for segment, (context, _), passage, prompt in zip(
        segments, branches, passages, prompts, strict=True
    ):
        if cut := len(context) + len(passage) - len(prompt):
            segment.details["passage_cut"] = cut  # shown in the segment's row
    return segments


async def write_segment(
    backend: CompletionAPI,
    info: ServerInfo,
    followups: Followups,
    *,
    prompt: list[int],
    context: tuple[int, ...],
    max_new_tokens: int,
    top_n: int,
    boundary_threshold: float | None,
) -> Continuation:
    """One long-form segment: the greedy completion of ``prompt`` (a path's ``context`` and a
    passage), cut at its first boundary (``[Retrieval]``, or ``[No Retrieval]`` where
    p([Retrieval]) / (p([Retrieval]) + p([No Retrieval])) exceeds ``boundary_threshold``), and
    scored as the in-process critic scores it. The server cannot stop at a token id, so it
    writes up to ``max_new_tokens`` and the rest past the boundary is dropped (greedy decoding
    makes the kept part the same).
    """
    completion = await backend.complete(info, prompt, max_new_tokens, top_n)
    keys = completion.keys
    retrieval = info.keys[RETRIEVAL]
    no_retrieval = info.keys[NO_RETRIEVAL]
    # The segment ends at the first [Retrieval] at the latest: nothing after it is scored.
    reach = keys.index(retrieval) if retrieval in keys else len(keys)
    needs = group_needs(info, keys, reach)
    if boundary_threshold is not None:
        # Each [No Retrieval] may be a boundary: its gate reads the whole retrieval group.
        needs[1:1] = [(i, "retrieval") for i, key in enumerate(keys[:reach]) if key == no_retrieval]
    details = await followups.complete_positions(backend, info, prompt, completion, needs)
    matrix = reflection_matrix(info, completion)
    # Where the segment ends, and why: at the first boundary, else at the end of generation.
    stop = "length"
    end = len(keys)
    if backend.ends_with_eog(completion):
        stop = "eos"
        end = len(keys) - 1
    for i, key in enumerate(keys):
        gate_opens = (
            key == no_retrieval
            and boundary_threshold is not None
            and retrieval_probability(matrix[i : i + 1]) > boundary_threshold
        )
        if key == retrieval or gate_opens:
            stop = "boundary"
            end = i
            break
    scores = scores_of(info, completion, end)
    tokens = [_token_id(position) for position in completion.positions[:end]]
    text = await answer_of(backend, info, completion, end)
    return Continuation(
        answer=" ".join(text.split()),
        relevance=scores.relevance,
        support=scores.support,
        utility=scores.utility,
        seq_score=scores.seq_score,
        details=details,
        tokens=tokens,
        context=(*context, *tokens),
        stop=stop,
    )


def _token_id(position: Position) -> int:
    token = key_id(position.key)
    assert token is not None  # only id-keyed APIs write segments
    return token


def paragraph_marks(info: ServerInfo) -> tuple[list[int], list[int]]:
    """The ids around a passage: ``[Retrieval]<paragraph>`` before, ``</paragraph>`` after."""
    retrieval, opening, closing = [
        key_id(info.keys[token]) for token in (RETRIEVAL, PARAGRAPH_OPEN, PARAGRAPH_CLOSE)
    ]
    if retrieval is None or opening is None or closing is None:
        raise ValueError(
            f"the reflection tokens have no ids on this API ({info.api}), and long form sends "
            "token ids: serve the model with llama.cpp's llama-server (native or /v1 API), or "
            "use the short form"
        )
    return [retrieval, opening], [closing]


def token_api(backend: CompletionAPI, url: str) -> TokenIds:
    """What tokenizes for long form, where a path continues from the very tokens the model
    wrote, which only an API that speaks token ids can send back (``url`` for the message).
    """
    tokens = backend.token_ids()
    if tokens is None:
        raise ValueError(
            f"long form over a served model needs prompts and answers as token ids: "
            f"{mask_url(url)} "
            f"({backend.name}) speaks text, and a segment sent back as text is re-tokenized "
            "into other tokens than the model wrote. Serve the model with llama.cpp's "
            "llama-server (native or /v1 API), or use the short form"
        )
    return tokens


def fit_passage(
    info: ServerInfo, context: tuple[int, ...], evidence: list[int], max_new_tokens: int
) -> list[int]:
    """``context + evidence`` (``[Retrieval]<paragraph>...</paragraph>``), the passage cut from
    its end to leave ``max_new_tokens`` positions in the server's slot, when its size is known.
    """
    if info.n_ctx is None:
        return [*context, *evidence]
    room = info.n_ctx - len(context) - max_new_tokens
    if room < 4:
        raise ValueError(
            f"the path's context ({len(context)} tokens) leaves no room for a passage and "
            f"{max_new_tokens} new tokens in the server's n_ctx={info.n_ctx}: raise the "
            "server's -c, or lower max_segments or max_new_tokens"
        )
    if len(evidence) > room:
        logger.warning(
            "long form: a passage cut by %d tokens to fit the server's n_ctx=%d (raise the "
            "server's -c to keep whole passages)",
            len(evidence) - room,
            info.n_ctx,
        )
        evidence = [*evidence[: room - 1], evidence[-1]]  # keep </paragraph>
    return [*context, *evidence]
