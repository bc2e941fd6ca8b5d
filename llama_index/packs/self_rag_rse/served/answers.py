"""Reading a served completion as Self-RAG reads it: the answer's text, the reflection
log-prob matrix and the scores (a long-form segment, cut from a completion: :mod:`.long_form`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from llama_index.packs.self_rag_rse.critic.reflection import (
    GROUNDING_TOKENS,
    PARAGRAPH_CLOSE,
    PARAGRAPH_OPEN,
    REFLECTION_TOKENS,
    UTILITY_TOKENS,
    ReflectionScores,
    logprobs_from_top_dicts,
    score_generation,
)
from llama_index.packs.self_rag_rse.served.apis import (
    CompletionAPI,
    ReflectionTokensUnidentifiable,
    ServerInfo,
)
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
        # The end-of-generation token is no part of the answer.
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
    if any(key_id(key) is not None for key in keys):
        return None
    return "".join(keys[: keys.index("")] if "" in keys else keys).strip()


def group_needs(info: ServerInfo, keys: list[str], reach: int) -> list[tuple[int, str]]:
    """Where a score reads a whole reflection group: relevance at the first position, support
    and utility where the first of theirs was generated (before position ``reach``).
    """
    needs: list[tuple[int, str]] = [(0, "relevance")] if keys else []
    for group, members in (("support", GROUNDING_TOKENS), ("utility", UTILITY_TOKENS)):
        wanted = {info.keys[token] for token in members}
        first = next((i for i, key in enumerate(keys[:reach]) if key in wanted), None)
        if first is not None:
            needs.append((first, group))
    return needs


def scores_of(info: ServerInfo, completion: Completion, end: int) -> ReflectionScores:
    """The reflection scores of the first ``end`` positions, as the in-process critic reads them."""
    positions = completion.positions[:end]
    return score_generation(
        reflection_matrix(info, completion),
        generated=[p.key for p in positions],
        # A position the server reported without its own log-prob counts as certain.
        token_logprobs=[p.logprob if p.logprob is not None else 0.0 for p in positions],
        column_ids=[info.keys[token] for token in REFLECTION_TOKENS],
    )


def each_or_error(results: Sequence[T | BaseException], failed: Callable[[int, str], T]) -> list[T]:
    """The results of concurrent requests, one per paragraph: a request that failed on its own
    becomes ``failed(index, error)`` and is logged; a failure that says no answer of this server can
    be trusted (not greedy, reflection tokens unidentifiable), an interrupt, or the first failure
    when every request failed (nothing was judged: a rate limit, a wrong key or model) is raised.
    """
    out: list[T] = []
    for i, result in enumerate(results):
        if isinstance(result, BaseException):
            # An interrupt, or a failure that no answer of this server escapes, stops them all.
            if not isinstance(result, Exception) or isinstance(
                result, ReflectionTokensUnidentifiable | ServerNotGreedy
            ):
                raise result
            logger.warning("served critic: a paragraph failed: %s", result)
            result = failed(i, f"{type(result).__name__}: {result}")
        out.append(result)
    first = results[0] if results else None
    if isinstance(first, Exception) and all(isinstance(result, Exception) for result in results):
        raise first
    return out
