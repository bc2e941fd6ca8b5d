"""Sequences of the batched decoder: their inputs, what one holds while decoding, what it
returns, and a prompt held open in the KV cache between calls.

These pieces need no llama.cpp call of their own: :class:`PromptSession` drives its decoder, and
the greedy step works on logits the decoder already copied out. They live apart from
:mod:`.decoder` so that module stays about the native context and the batching.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

if TYPE_CHECKING:
    from llama_index.packs.self_rag_rse.llamacpp.decoder import BatchedDecoder


@dataclass
class SequenceOutput:
    """What one sequence produced.

    ``tokens`` are the generated ids; when generation ended on an end-of-generation (or stop)
    token, that token is the last one, as in the Self-RAG reference code, so it counts in
    ``token_logprobs`` and in the sequence score. ``tracked_logprobs[i, j]`` is the log-prob of
    ``track_ids[j]`` at generated position ``i`` under the full-vocabulary softmax.
    ``finish_reason`` is ``"stop"`` (end-of-generation or a stop id), ``"length"``
    (``max_new_tokens`` reached) or ``"error"`` (then ``error`` says why and the arrays are
    empty). ``truncated`` counts suffix tokens dropped to fit the context.
    """

    tokens: list[int]
    token_logprobs: NDArray[np.float64]
    tracked_logprobs: NDArray[np.float64]
    finish_reason: str
    truncated: int = 0
    error: str | None = None


@dataclass
class Slot:
    """Book-keeping of one live sequence inside a group (internal to the decoder)."""

    index: int  # position in the caller's list
    seq_id: int
    feed: list[int]  # tokens still to be evaluated before the next logits are needed
    pos: int  # position of feed[0]
    max_new: int
    truncated: int = 0
    tokens: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    tracked: list[NDArray[np.float64]] = field(default_factory=list)
    finish_reason: str | None = None


def track_array(track_ids: Sequence[int], n_vocab: int) -> NDArray[np.intp]:
    """``track_ids`` as an index array, checked against the vocabulary size."""
    track = np.asarray([int(t) for t in track_ids], dtype=np.intp)
    if track.size and (track.min() < 0 or track.max() >= n_vocab):
        raise ValueError(f"track_ids must lie in [0, {n_vocab}), got {track.tolist()}")
    return track


def fit_suffixes(
    n_ctx: int,
    prefix_len: int,
    suffixes: Sequence[Sequence[int]],
    tail: list[int],
    reserve: int,
) -> tuple[list[list[int]], list[int]]:
    """Append ``tail`` to each suffix, cutting the end of suffixes that would overflow ``n_ctx``
    once ``reserve`` positions (the longest of tails + new tokens) are kept after them.

    Returns the feeds and how many tokens each suffix lost.
    """
    budget = n_ctx - prefix_len - len(tail) - reserve
    if budget < 0:
        raise ValueError(
            f"prefix ({prefix_len} tokens) + tail ({len(tail)}) + tails and max_new_tokens "
            f"({reserve}) exceed n_ctx={n_ctx}: shorten the query or raise n_ctx"
        )
    feeds: list[list[int]] = []
    truncated: list[int] = []
    for suffix in suffixes:
        tokens = [int(t) for t in suffix]
        cut = max(0, len(tokens) - budget)
        feeds.append(tokens[: len(tokens) - cut] + tail)
        truncated.append(cut)
    return feeds, truncated


def greedy_step(
    slot: Slot,
    logits: NDArray[np.float32],
    track: NDArray[np.intp],
    stops: frozenset[int],
    is_eog: Callable[[int], bool],
) -> None:
    """Record the exact log-probs at this position, append the argmax, decide whether to stop."""
    row = logits.astype(np.float64)
    token = int(np.argmax(row))  # first maximum, like llama.cpp's greedy sampler
    top = row[token]
    log_z = top + np.log(np.sum(np.exp(row - top)))
    slot.tokens.append(token)
    slot.token_logprobs.append(float(top - log_z))
    slot.tracked.append(row[track] - log_z)
    if is_eog(token) or token in stops:
        slot.finish_reason = "stop"
    elif len(slot.tokens) >= slot.max_new:
        slot.finish_reason = "length"
    else:
        slot.feed = [token]


def collect(slots: list[Slot], outputs: list[SequenceOutput | None], n_tracked: int) -> None:
    """Move finished slots into ``outputs`` (at each slot's ``index``)."""
    for slot in slots:
        if slot.finish_reason is None:
            continue
        outputs[slot.index] = SequenceOutput(
            tokens=slot.tokens,
            token_logprobs=np.asarray(slot.token_logprobs, dtype=np.float64),
            tracked_logprobs=(
                np.vstack(slot.tracked) if slot.tracked else np.empty((0, n_tracked))
            ),
            finish_reason=slot.finish_reason,
            truncated=slot.truncated,
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


class PromptSession:
    """One prompt held in the decoder's KV cache (see :meth:`BatchedDecoder.session`).

    Every call raises :class:`~llama_index.packs.self_rag_rse.llamacpp.compat.ModelClosedError`
    once the ``Llama`` was closed, also when that happened inside the session's ``with`` block.
    """

    def __init__(self, decoder: BatchedDecoder, prompt: list[int]) -> None:
        self._decoder = decoder
        self._prompt = prompt
        self._logits: NDArray[np.float32] | None = None
        self._epoch = -1
        self._closed = False

    def _ready(self, extra_cells: int) -> NDArray[np.float32]:
        """Evaluate the prompt unless the KV cache still holds it from this session."""
        if self._closed:
            raise RuntimeError("the session is closed: use it inside its `with` block only")
        decoder = self._decoder
        decoder.check_open()
        decoder._ensure_context(decoder._cells_needed(len(self._prompt), [(0, [extra_cells])]))
        if self._logits is None or self._epoch != decoder._epoch:
            decoder._memory_clear()
            self._epoch = decoder._epoch
            self._logits = None  # stays None if evaluation fails
            self._logits = decoder._eval_prefix(self._prompt)
        return self._logits

    def logprobs(self, track_ids: Sequence[int]) -> NDArray[np.float64]:
        """Full-vocabulary log-probs of ``track_ids`` for the token after the prompt."""
        track = track_array(track_ids, self._decoder.n_vocab)
        row = self._ready(1).astype(np.float64)
        top = row.max()
        return row[track] - (top + np.log(np.sum(np.exp(row - top))))

    def generate(
        self,
        max_new_tokens: int,
        track_ids: Sequence[int] = (),
        *,
        forced: Sequence[int] = (),
        stop_ids: Sequence[int] = (),
    ) -> SequenceOutput:
        """Greedy continuation after the prompt and the ``forced`` tokens (not part of the output).

        Each call starts again from the bare prompt, so a session can try several forced
        openings. Raises :class:`~.decoder.DecodeError` when llama.cpp fails.
        """
        decoder = self._decoder
        forced_tokens = [int(t) for t in forced]
        if len(self._prompt) + len(forced_tokens) + max_new_tokens > decoder.n_ctx:
            raise ValueError(
                f"prompt ({len(self._prompt)}) + forced ({len(forced_tokens)}) + max_new_tokens "
                f"({max_new_tokens}) exceed n_ctx={decoder.n_ctx}"
            )
        track = track_array(track_ids, decoder.n_vocab)
        start_logits = self._ready(len(forced_tokens) + max_new_tokens)
        decoder._share_prefix(1, len(self._prompt))
        slot = Slot(0, 0, forced_tokens, len(self._prompt), max_new_tokens)
        try:
            decoder._run([slot], start_logits, track, frozenset(int(t) for t in stop_ids))
        except BaseException:
            self._logits = None  # the cache may hold half a batch: re-read the prompt next time
            raise
        outputs: list[SequenceOutput | None] = [None]
        collect([slot], outputs, len(track))
        assert outputs[0] is not None
        return outputs[0]
