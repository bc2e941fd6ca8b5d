"""Self-RAG reflection scores from log-probabilities: the numeric heart of the reflection critic.

Everything here is plain numpy. The inputs are what any decoder can produce for one generated
answer:

* ``logprobs``: an array ``[n_generated, len(REFLECTION_TOKENS)]`` holding, at every generated
  position, the log-probability of each reflection token under the model's *full-vocabulary*
  softmax. Column ``j`` belongs to ``REFLECTION_TOKENS[j]``.
* ``generated``: the generated tokens, either as token ids (then pass ``column_ids``, the ids of
  ``REFLECTION_TOKENS`` in the same order) or as token strings (the default ``column_ids`` are the
  strings themselves), so the grounding and utility positions can be located.
* ``token_logprobs``: the log-probability of each generated token, for the sequence score.

Callers that only have llama-cpp-python/OpenAI-style top-N dicts build ``logprobs`` with
:func:`logprobs_from_top_dicts`, which gives a token missing from the dict the log-prob -100, as the
Self-RAG reference code does.

Probabilities within a token group are normalised over that group only (e.g. IsREL compares
``[Relevant]`` with ``[Irrelevant]`` and ignores the rest of the vocabulary), and every ratio is
computed in log space, so log-probs of -100 or -1e4 neither underflow nor divide by zero.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

# --- reflection vocabulary (exact strings of the Self-RAG checkpoints) --------------------------

NO_RETRIEVAL = "[No Retrieval]"
RETRIEVAL = "[Retrieval]"
CONTINUE_EVIDENCE = "[Continue to Use Evidence]"
RETRIEVAL_TOKENS: tuple[str, ...] = (NO_RETRIEVAL, RETRIEVAL, CONTINUE_EVIDENCE)

IRRELEVANT = "[Irrelevant]"
RELEVANT = "[Relevant]"
RELEVANCE_TOKENS: tuple[str, ...] = (IRRELEVANT, RELEVANT)

FULLY_SUPPORTED = "[Fully supported]"
PARTIALLY_SUPPORTED = "[Partially supported]"
NO_SUPPORT = "[No support / Contradictory]"
GROUNDING_TOKENS: tuple[str, ...] = (FULLY_SUPPORTED, PARTIALLY_SUPPORTED, NO_SUPPORT)

UTILITY_TOKENS: tuple[str, ...] = tuple(f"[Utility:{i}]" for i in range(1, 6))
#: Weight of ``[Utility:1]`` .. ``[Utility:5]`` in IsUSE, as in the paper.
UTILITY_WEIGHTS: tuple[float, ...] = (-1.0, -0.5, 0.0, 0.5, 1.0)

PARAGRAPH_OPEN = "<paragraph>"
PARAGRAPH_CLOSE = "</paragraph>"
PARAGRAPH_TOKENS: tuple[str, ...] = (PARAGRAPH_OPEN, PARAGRAPH_CLOSE)

#: The 13 reflection tokens; also the column order of every ``logprobs`` array in this module.
REFLECTION_TOKENS: tuple[str, ...] = (
    RETRIEVAL_TOKENS + RELEVANCE_TOKENS + GROUNDING_TOKENS + UTILITY_TOKENS
)
#: Every special string a Self-RAG GGUF must hold as a single token.
SELF_RAG_SPECIAL_TOKENS: tuple[str, ...] = REFLECTION_TOKENS + PARAGRAPH_TOKENS

#: Self-RAG's instruction format (``retrieval_lm/utils.py`` in the reference code).
PROMPT_TEMPLATE = "### Instruction:\n{query}\n\n### Response:\n"


class MissingReflectionTokens(ValueError):
    """The model's vocabulary lacks some (or all) Self-RAG special tokens."""

    def __init__(self, missing: Sequence[str], found: Sequence[str]) -> None:
        self.missing = list(missing)
        self.found = list(found)
        if not found:
            what = f"{RETRIEVAL} token (nor any of the {len(missing)} Self-RAG special tokens)"
        else:
            tokens = "tokens" if len(missing) > 1 else "token"
            what = f"{', '.join(missing)} {tokens}"
        super().__init__(f"model has no {what}: pass a Self-RAG GGUF or use critic='prompted'")


#: Log-prob the Self-RAG reference code gives a token absent from a top-N dict.
MISSING_LOGPROB = -100.0

_COLUMN = {token: j for j, token in enumerate(REFLECTION_TOKENS)}
_RETRIEVAL_COLS = [_COLUMN[t] for t in (RETRIEVAL, NO_RETRIEVAL)]
_RELEVANCE_COLS = [_COLUMN[t] for t in (RELEVANT, IRRELEVANT)]
_GROUNDING_COLS = [_COLUMN[t] for t in GROUNDING_TOKENS]
_UTILITY_COLS = [_COLUMN[t] for t in UTILITY_TOKENS]


@dataclass(frozen=True)
class ReflectionScores:
    """The scores of one answer: IsREL, IsSUP, IsUSE and the sequence score.

    ``relevance`` and ``support`` lie in [0, 1], ``utility`` in [-1, 1]; ``seq_score`` is
    exp(mean generated-token log-prob) in [0, 1].
    """

    relevance: float
    support: float
    utility: float
    seq_score: float


# --- building the log-prob array -----------------------------------------------------------------


def logprobs_from_top_dicts(
    top_logprobs: Sequence[Mapping[str, float] | None],
    tokens: Sequence[str] = REFLECTION_TOKENS,
    missing: float = MISSING_LOGPROB,
) -> NDArray[np.float64]:
    """Build a ``[n_generated, len(tokens)]`` array from per-position top-N log-prob dicts.

    ``top_logprobs[i]`` maps token strings to log-probs at generated position ``i`` (the
    ``top_logprobs`` of an OpenAI-style or llama-cpp-python completion). A token the dict does not
    hold gets ``missing`` (-100 like the Self-RAG reference code): a token outside the top N is
    treated as practically impossible, which biases group ratios only when *every* token of a
    group is missing (then the group splits evenly).
    """
    out = np.full((len(top_logprobs), len(tokens)), missing, dtype=np.float64)
    for i, top in enumerate(top_logprobs):
        if not top:
            continue
        for j, token in enumerate(tokens):
            value = top.get(token)
            if value is not None:
                out[i, j] = value
    return out


# --- the scores ----------------------------------------------------------------------------------


def logsumexp(values: Iterable[float]) -> float:
    """log Σ exp(v), stable; ``-inf`` for no values (a ``+inf`` or NaN surfaces, not hidden)."""
    values = [float(v) for v in values]
    top = max(values, default=-math.inf)
    if not math.isfinite(top):
        return top
    return top + math.log(sum(math.exp(v - top) for v in values))


def _group(
    logprobs: ArrayLike,
    cols: Sequence[int],
    generated: Sequence[Hashable] | None = None,
    column_ids: Sequence[Hashable] = REFLECTION_TOKENS,
) -> NDArray[np.float64] | None:
    """Probabilities of the group ``cols`` normalised among themselves, at the first position
    (with ``generated``: the first where the model generated one of them); ``None`` when there
    is no such position or the group has no mass there.
    """
    rows = np.asarray(logprobs, dtype=np.float64)
    if rows.ndim == 1:
        rows = rows[None, :]
    if rows.ndim != 2 or rows.shape[1] < len(REFLECTION_TOKENS):
        raise ValueError(
            f"logprobs must have shape [n_generated, {len(REFLECTION_TOKENS)}] "
            f"(columns in REFLECTION_TOKENS order), got {rows.shape}"
        )
    pos: int | None = 0
    if generated is not None:
        if len(column_ids) != len(REFLECTION_TOKENS):
            raise ValueError(
                f"column_ids must name the {len(REFLECTION_TOKENS)} REFLECTION_TOKENS in order, "
                f"got {len(column_ids)}"
            )
        wanted = {column_ids[j] for j in cols}
        pos = next((i for i, token in enumerate(generated) if token in wanted), None)
    if pos is None or pos >= rows.shape[0]:
        return None
    group = rows[pos][list(cols)]
    total = logsumexp(group)
    return None if total == -np.inf else np.exp(group - total)


def retrieval_probability(logprobs: ArrayLike) -> float:
    """p([Retrieval]) / (p([Retrieval]) + p([No Retrieval])) at the first generated position.

    This is the adaptive-retrieval gate: the engine retrieves when it exceeds its threshold
    (Self-RAG uses 0.2 for PopQA). ``[Continue to Use Evidence]`` does not take part. Returns 0.0
    for an empty generation or when both tokens have probability 0.
    """
    probs = _group(logprobs, _RETRIEVAL_COLS)
    return 0.0 if probs is None else float(probs[0])


def relevance_score(logprobs: ArrayLike) -> float:
    """IsREL: p([Relevant]) / (p([Relevant]) + p([Irrelevant])) at the first generated position.

    Self-RAG emits the relevance token right after ``</paragraph>``, so only position 0 counts,
    whatever was generated there. Returns 0.0 for an empty generation.
    """
    probs = _group(logprobs, _RELEVANCE_COLS)
    return 0.0 if probs is None else float(probs[0])


def support_score(
    logprobs: ArrayLike,
    generated: Sequence[Hashable],
    column_ids: Sequence[Hashable] = REFLECTION_TOKENS,
) -> float:
    """IsSUP: (p(Fully) + 0.5·p(Partially)) / (sum of the 3 grounding tokens).

    Read at the first position where the model *generated* a grounding token; 0.0 when it
    generated none (an answer that never claims support earns none). ``column_ids`` identifies
    the reflection tokens in ``generated`` (ids or strings, in ``REFLECTION_TOKENS`` order).
    """
    probs = _group(logprobs, _GROUNDING_COLS, generated, column_ids)
    return 0.0 if probs is None else float(probs[0] + 0.5 * probs[1])


def utility_score(
    logprobs: ArrayLike,
    generated: Sequence[Hashable],
    column_ids: Sequence[Hashable] = REFLECTION_TOKENS,
) -> float:
    """IsUSE: Σ w_i·p(Utility:i) / Σ p(Utility:i), w = UTILITY_WEIGHTS = (-1, -0.5, 0, 0.5, 1).

    Read at the first position where the model generated a utility token (the Self-RAG code uses
    the first; LlamaIndex's old pack used the last); 0.0 when it generated none, which is also the
    weight of a neutral ``[Utility:3]``.
    """
    probs = _group(logprobs, _UTILITY_COLS, generated, column_ids)
    return 0.0 if probs is None else float(np.dot(probs, UTILITY_WEIGHTS))


def sequence_score(token_logprobs: ArrayLike) -> float:
    """exp(Σ log p(token) / n): the geometric-mean probability of the generated tokens.

    Length-normalised, so long and short answers compare fairly. 0.0 for an empty generation
    (nothing was said, nothing to be confident about).
    """
    values = np.asarray(token_logprobs, dtype=np.float64).reshape(-1)
    if values.size == 0:
        return 0.0
    return float(np.exp(np.sum(values) / values.size))


def score_generation(
    logprobs: ArrayLike,
    generated: Sequence[Hashable],
    token_logprobs: ArrayLike,
    column_ids: Sequence[Hashable] = REFLECTION_TOKENS,
) -> ReflectionScores:
    """All four scores of one answer generated after ``...</paragraph>``."""
    return ReflectionScores(
        relevance=relevance_score(logprobs),
        support=support_score(logprobs, generated, column_ids),
        utility=utility_score(logprobs, generated, column_ids),
        seq_score=sequence_score(token_logprobs),
    )
