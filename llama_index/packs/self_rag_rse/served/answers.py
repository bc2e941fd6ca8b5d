"""Reading a served completion as Self-RAG reads it: the answer's text, the reflection
log-prob matrix, and a long-form segment (the completion cut at its boundary, scored).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from llama_index.packs.self_rag_rse.critic.contract import Continuation
from llama_index.packs.self_rag_rse.critic.reflection import (
    GROUNDING_TOKENS,
    NO_RETRIEVAL,
    PARAGRAPH_CLOSE,
    PARAGRAPH_OPEN,
    REFLECTION_TOKENS,
    RETRIEVAL,
    UTILITY_TOKENS,
    ReflectionScores,
    logprobs_from_top_dicts,
    retrieval_probability,
    score_generation,
)
from llama_index.packs.self_rag_rse.served.apis import (
    CompletionAPI,
    ReflectionTokensUnidentifiable,
    ServerInfo,
    TokenIds,
)
from llama_index.packs.self_rag_rse.served.followups import Followups
from llama_index.packs.self_rag_rse.served.greedy import ServerNotGreedy
from llama_index.packs.self_rag_rse.served.wire import Completion, Position, key_id

logger = logging.getLogger(__name__)
T = TypeVar("T")


def reflection_matrix(info: ServerInfo, completion: Completion) -> Any:
    """Log-probs of the reflection tokens at every position (``REFLECTION_TOKENS`` columns)."""
    columns = [info.keys[t] for t in REFLECTION_TOKENS]
    return logprobs_from_top_dicts([p.top for p in completion.positions], columns)


def answer_positions(info: ServerInfo, positions: Sequence[Position]) -> list[int]:
    """Indices of the answer's own tokens: no reflection token, no evidence the model quotes."""
    special = set(info.keys.values())
    keep: list[int] = []
    in_paragraph = False
    for i, position in enumerate(positions):
        if position.key == info.keys[PARAGRAPH_OPEN]:
            in_paragraph = True  # the model quoting evidence is not part of its answer
        elif position.key == info.keys[PARAGRAPH_CLOSE]:
            in_paragraph = False
        elif not in_paragraph and position.key not in special:
            keep.append(i)
    return keep


async def answer_of(
    backend: CompletionAPI, info: ServerInfo, completion: Completion, end: int | None = None
) -> str:
    """The answer without reflection tokens, end-of-generation or quoted evidence (of the
    first ``end`` positions, when given).
    """
    positions = completion.positions
    if end is None:
        end = len(positions) - 1 if backend.ends_with_eog(completion) else len(positions)
    keep = answer_positions(info, positions[:end])
    if not keep:
        return ""
    return await backend.answer_text(info, completion, keep)


def text_so_far(info: ServerInfo, completion: Completion) -> str | None:
    """The answer of a completion still streaming, from all but its newest token (which may be
    the end of generation), as :func:`answer_of` will read it, up to a token named "" (which
    llama-cpp-python streams no text for); ``None`` when a token came without its bytes or text.
    """
    positions = completion.positions[:-1]
    keep = answer_positions(info, positions)
    pieces = [positions[i].piece for i in keep]
    if all(p is not None for p in pieces):
        return b"".join(p for p in pieces if p is not None).decode("utf-8", "ignore").strip()
    keys = [positions[i].key for i in keep]
    if any(key_id(k) is not None for k in keys):
        return None
    return "".join(keys[: keys.index("")] if "" in keys else keys).strip()


async def write_segment(
    backend: CompletionAPI,
    info: ServerInfo,
    followups: Followups,
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
    retrieval, no_retrieval = info.keys[RETRIEVAL], info.keys[NO_RETRIEVAL]
    reach = keys.index(retrieval) if retrieval in keys else len(keys)
    needs = group_needs(info, keys, reach)
    if boundary_threshold is not None:
        needs[1:1] = [(i, "retrieval") for i, k in enumerate(keys[:reach]) if k == no_retrieval]
    details = await followups.complete_positions(backend, info, prompt, completion, needs)
    matrix = reflection_matrix(info, completion)
    stop, end = "length", len(keys)
    for i, key in enumerate(keys):
        boundary = key == retrieval or (
            key == no_retrieval
            and boundary_threshold is not None
            and retrieval_probability(matrix[i : i + 1]) > boundary_threshold
        )
        if boundary:
            stop, end = "boundary", i
            break
    else:
        if backend.ends_with_eog(completion):
            stop, end = "eos", len(keys) - 1
    scores = scores_of(info, completion, end)
    tokens = [_token_id(p) for p in completion.positions[:end]]
    text = await answer_of(backend, info, completion, end)
    return Continuation(
        " ".join(text.split()),
        *scores.as_tuple(),
        details=details,
        tokens=tokens,
        context=(*context, *tokens),
        stop=stop,
    )


def group_needs(info: ServerInfo, keys: list[str], reach: int) -> list[tuple[int, str]]:
    """Where a score reads a whole reflection group: relevance at the first position, support
    and utility where the first of theirs was generated (before position ``reach``).
    """
    needs: list[tuple[int, str]] = [(0, "relevance")] if keys else []
    for group, members in (("support", GROUNDING_TOKENS), ("utility", UTILITY_TOKENS)):
        wanted = {info.keys[t] for t in members}
        first = next((i for i, k in enumerate(keys[:reach]) if k in wanted), None)
        if first is not None:
            needs.append((first, group))
    return needs


def scores_of(info: ServerInfo, completion: Completion, end: int) -> ReflectionScores:
    """The reflection scores of the first ``end`` positions, as the in-process critic reads them."""
    positions = completion.positions[:end]
    return score_generation(
        reflection_matrix(info, completion),
        [p.key for p in positions],
        [p.logprob if p.logprob is not None else 0.0 for p in positions],
        [info.keys[t] for t in REFLECTION_TOKENS],
    )


def _token_id(position: Position) -> int:
    token = key_id(position.key)
    assert token is not None  # only id-keyed APIs write segments
    return token


def paragraph_marks(info: ServerInfo) -> tuple[list[int], list[int]]:
    """The ids around a passage: ``[Retrieval]<paragraph>`` before, ``</paragraph>`` after."""
    ids = [key_id(info.keys[t]) for t in (RETRIEVAL, PARAGRAPH_OPEN, PARAGRAPH_CLOSE)]
    if any(i is None for i in ids):
        raise ValueError("the reflection tokens have no ids on this API")
    return [int(ids[0]), int(ids[1])], [int(ids[2])]  # type: ignore[arg-type]


def token_api(backend: CompletionAPI, url: str) -> TokenIds:
    """What tokenizes for long form, where a path continues from the very tokens the model
    wrote, which only an API that speaks token ids can send back (``url`` for the message).
    """
    tokens = backend.token_ids()
    if tokens is None:
        raise ValueError(
            f"long form over a served model needs prompts and answers as token ids: {url} "
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
        logger.warning("long form: a passage cut by %d tokens to fit n_ctx", len(evidence) - room)
        evidence = [*evidence[: room - 1], evidence[-1]]  # keep </paragraph>
    return [*context, *evidence]


def each_or_error(results: Sequence[T | BaseException], failed: Callable[[int, str], T]) -> list[T]:
    """The results of concurrent requests, one per paragraph: a request that failed on its own
    becomes ``failed(index, error)`` and is logged; a failure that says no answer of this server can
    be trusted (not greedy, reflection tokens unidentifiable), an interrupt, or the first failure
    when every request failed (nothing was judged: a rate limit, a wrong key or model) is raised.
    """
    out: list[T] = []
    for i, result in enumerate(results):
        if isinstance(result, BaseException):
            if not isinstance(result, Exception) or isinstance(
                result, ReflectionTokensUnidentifiable | ServerNotGreedy
            ):
                raise result
            logger.warning("served critic: a paragraph failed: %s", result)
            result = failed(i, f"{type(result).__name__}: {result}")
        out.append(result)
    first = results[0] if results else None
    if isinstance(first, Exception) and all(isinstance(r, Exception) for r in results):
        raise first
    return out
