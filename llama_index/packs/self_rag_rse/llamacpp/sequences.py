"""Sequences of the batched decoder: what is asked (:class:`Request`), what one holds while
decoding (:class:`Slot`), what it returns (:class:`SequenceOutput`), and the greedy step.

These pieces need no llama.cpp call of their own: the greedy step works on logits already
copied out of the context.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

#: A stop condition on the generated token and the tracked log-probs at its position.
StopIf = Callable[[int, NDArray[np.float64]], bool]


@dataclass
class Request:
    """One prompt to decode: continue ``tokens`` greedily for at most ``max_new_tokens``.

    ``track_ids`` select the columns of the output's ``tracked_logprobs``; generation stops at
    an end-of-generation token or at one of ``stop_ids``. ``max_new_tokens=0`` only evaluates
    the prompt into the KV cache; ``1`` reads the log-probs after it (a label). ``keep`` holds
    the sequence (prompt and generated tokens) for the conversation's later calls, unchanged:
    they copy from it. Other sequences stay in the cache too while there is room, and a later
    call may continue one of them in place. ``truncated`` is handed back in the output (tokens
    the caller cut to fit). ``on_token``, when given, is called with each generated token as it
    is chosen (on the decoding thread: keep it short), for streaming.
    ``stop_if(token, tracked)``, when given, also stops generation at ``token`` when it returns
    true; ``tracked`` holds the log-probs of ``track_ids`` at that position.
    """

    tokens: Sequence[int]
    max_new_tokens: int = 0
    track_ids: Sequence[int] = ()
    stop_ids: Sequence[int] = ()
    keep: bool = False
    truncated: int = 0
    on_token: Callable[[int], None] | None = None
    stop_if: StopIf | None = None


@dataclass
class SequenceOutput:
    """What one sequence produced.

    ``tokens`` are the generated ids; when generation ended on an end-of-generation (or stop)
    token, that token is the last one, as in the Self-RAG reference code, so it counts in
    ``token_logprobs`` and in the sequence score. ``tracked_logprobs[i, j]`` is the log-prob of
    ``track_ids[j]`` at generated position ``i`` under the full-vocabulary softmax.
    ``finish_reason`` is ``"stop"`` (end-of-generation or a stop id), ``"length"``
    (``max_new_tokens`` reached) or ``"error"`` (then ``error`` says why and the arrays are
    empty). ``truncated`` counts suffix tokens dropped to fit the context. ``prompt_tokens``
    counts the prompt tokens evaluated for this sequence: a prefix it shares with others of the
    call counts once, on the first of them; one the KV cache held, not at all.
    """

    tokens: list[int]
    token_logprobs: NDArray[np.float64]
    tracked_logprobs: NDArray[np.float64]
    finish_reason: str
    truncated: int = 0
    error: str | None = None
    prompt_tokens: int = 0


@dataclass
class Slot:
    """Book-keeping of one sequence being decoded (internal to the decoder)."""

    index: int  # position in the caller's list (-1: an edge no caller sees)
    seq_id: int
    feed: list[int]  # tokens still to be evaluated before the next logits are needed
    pos: int  # position of feed[0]
    request: Request = field(default_factory=lambda: Request(()))  # default: evaluate only
    track: NDArray[np.intp] = field(default_factory=lambda: np.empty(0, dtype=np.intp))
    tokens: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    tracked: list[NDArray[np.float64]] = field(default_factory=list)
    finish_reason: str | None = None
    fed: int = 0  # generated tokens evaluated back into the sequence
    prompt_tokens: int = 0  # prompt tokens evaluated for it (see SequenceOutput)
    logits: NDArray[np.float32] | None = None  # the last logits read (after all fed tokens)

    @property
    def max_new(self) -> int:
        return self.request.max_new_tokens


def track_array(track_ids: Sequence[int], n_vocab: int) -> NDArray[np.intp]:
    """``track_ids`` as an index array, checked against the vocabulary size."""
    track = np.asarray([int(t) for t in track_ids], dtype=np.intp)
    if track.size and (track.min() < 0 or track.max() >= n_vocab):
        raise ValueError(f"track_ids must lie in [0, {n_vocab}), got {track.tolist()}")
    return track


def fit_suffixes(
    n_ctx: int, prefix_len: int, suffixes: Sequence[Sequence[int]], tail: list[int], reserve: int
) -> tuple[list[list[int]], list[int]]:
    """Append ``tail`` to each suffix, cutting the end of suffixes that would overflow ``n_ctx``
    once ``reserve`` positions (the new tokens) are kept after them.

    Returns the feeds and how many tokens each suffix lost.
    """
    budget = n_ctx - prefix_len - len(tail) - reserve
    if budget < 0:
        raise ValueError(
            f"prefix ({prefix_len} tokens) + tail ({len(tail)}) + max_new_tokens "
            f"({reserve}) exceed n_ctx={n_ctx}: shorten the query, lower max_new_tokens or raise "
            "n_ctx"
        )
    feeds: list[list[int]] = []
    truncated: list[int] = []
    for suffix in suffixes:
        tokens = [int(t) for t in suffix]
        cut = max(0, len(tokens) - budget)
        feeds.append(tokens[: len(tokens) - cut] + tail)
        truncated.append(cut)
    return feeds, truncated


def greedy_step(slot: Slot, logits: NDArray[np.float32], is_eog: Callable[[int], bool]) -> None:
    """Record the exact log-probs at this position, append the argmax, decide whether to stop."""
    slot.logits = logits
    token = int(np.argmax(logits))  # first maximum, like llama.cpp's greedy sampler
    top = float(logits[token])
    # The exponentials in float32 (relative rounding ~1e-7, far below what batching moves the
    # logits), summed in float64: a quarter of the time of the whole row in float64, once
    # per generated token of every sequence.
    log_z = top + math.log(float(np.sum(np.exp(logits - logits[token]), dtype=np.float64)))
    slot.tokens.append(token)
    slot.token_logprobs.append(top - log_z)
    tracked = logits[slot.track].astype(np.float64) - log_z
    slot.tracked.append(tracked)
    request = slot.request
    if request.on_token is not None:
        request.on_token(token)
    if (
        is_eog(token)
        or token in request.stop_ids
        or (request.stop_if is not None and request.stop_if(token, tracked))
    ):
        slot.finish_reason = "stop"
    elif len(slot.tokens) >= slot.max_new:
        slot.finish_reason = "length"
    else:
        slot.feed = [token]


def output(slot: Slot) -> SequenceOutput:
    """What a finished slot produced."""
    assert slot.finish_reason is not None
    return SequenceOutput(
        tokens=slot.tokens,
        token_logprobs=np.asarray(slot.token_logprobs, dtype=np.float64),
        tracked_logprobs=(
            np.vstack(slot.tracked) if slot.tracked else np.empty((0, len(slot.track)))
        ),
        finish_reason=slot.finish_reason,
        truncated=slot.request.truncated,
        prompt_tokens=slot.prompt_tokens,
    )


def failed(error: str, n_tracked: int, truncated: int = 0) -> SequenceOutput:
    """The output of a sequence whose decoding failed."""
    return SequenceOutput(
        tokens=[],
        token_logprobs=np.empty(0),
        tracked_logprobs=np.empty((0, n_tracked)),
        finish_reason="error",
        truncated=truncated,
        error=error,
    )
