"""Greedy multi-sequence decoding on llama.cpp, with exact log-probs of chosen tokens.

llama-cpp-python's high-level ``Llama`` decodes one sequence at a time and builds log-probs by
sorting the whole vocabulary and detokenizing every entry, behind ``logits_all=True``. This module
talks to llama.cpp's low-level API instead, on a second context over the weights an existing
``Llama`` already holds:

* a shared prefix (the instruction) is evaluated **once** and handed to every sequence with
  ``llama_memory_seq_cp`` (a unified KV cache just tags its cells with more sequence ids; a
  split cache copies them into each sequence's stream);
* the sequences' suffixes (the paragraphs) and then one new token per live sequence go through
  ``llama_decode`` together, so k paragraphs cost roughly one pass over the weights per step;
* a suffix asked several questions (``tails``) is evaluated once too and copied the same way to
  one sequence per question;
* at every generated position the raw logits of that sequence are turned into an exact
  full-vocabulary log-softmax in numpy, from which the log-probs of a few *tracked* token ids are
  read (reflection tokens, Yes/No labels...). Nothing is sorted, nothing is detokenized.

"Exact" means exactly the softmax of the logits llama.cpp computed. Those logits depend a little
on how tokens were batched when the weights are quantized: on SmolLM2-135M Q4_1, llama.cpp's own
prefill and token-by-token paths differ by up to ~0.2 nats on likely tokens, so batched and serial
greedy decoding can part ways at a near tie. With F32 weights (the tests' model) batched, serial
and a ``logits_all`` reference agree to ~1e-5.

The module knows nothing about Self-RAG; :mod:`.reflection_critic` builds the prompts.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from llama_index.packs.self_rag_rse.llamacpp import compat

if TYPE_CHECKING:
    import llama_cpp

logger = logging.getLogger(__name__)

#: Context sizes are rounded up to this many KV cells (llama.cpp pads to 256 internally anyway).
_CELL_ROUNDING = 256

#: Context parameters copied from the ``Llama`` so our context computes what the user's does.
_INHERITED_PARAMS = (
    "rope_scaling_type",
    "rope_freq_base",
    "rope_freq_scale",
    "yarn_ext_factor",
    "yarn_attn_factor",
    "yarn_beta_fast",
    "yarn_beta_slow",
    "yarn_orig_ctx",
    "type_k",
    "type_v",
    "offload_kqv",
    "op_offload",
    "swa_full",
)


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


class DecodeError(RuntimeError):
    """``llama_decode`` (or context creation) failed; ``code`` is llama.cpp's return value."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class _Slot:
    """Book-keeping of one live sequence inside a group."""

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


class BatchedDecoder:
    """Greedy decoding of many sequences that share a prefix, in one llama.cpp context.

    Args:
        llm: a loaded ``llama_cpp.Llama``; its weights are shared, its own context is untouched.
            Close this decoder before closing ``llm`` (closing ``llm`` closes it too).
        n_seq_max: sequences decoded together. More sequences are processed in chunks of this
            size after one shared prefix evaluation. Higher values use the CPU/GPU better per step
            but need a KV cache holding all of them at once.
        n_ctx: maximum positions of one sequence (prefix + suffix + generated tokens); a suffix
            that would exceed it is truncated with a warning. Defaults to ``llm.n_ctx()``.
        n_batch: maximum tokens per ``llama_decode`` call (also the physical micro-batch).
        n_threads: threads for generation steps; defaults to the ``Llama``'s setting.
        n_threads_batch: threads for prompt evaluation; defaults to the ``Llama``'s setting.
        kv_unified: KV-cache layout. ``True``: one buffer for all sequences; the prefix is
            shared without a copy and memory follows the tokens held, but without flash attention
            every token also attends to (then masks out) the other sequences' cells. ``False``:
            one stream per sequence (memory: sequences × the longest one; the prefix is copied
            into each stream); attention stays within a sequence, and llama.cpp splits batches
            by stream. ``None`` (default) picks unified when flash attention is on or layers are
            offloaded to a GPU (the masked work is skipped or cheap there), split on a CPU
            without flash attention, where it was measured 21% faster for 10 paragraphs of
            SmolLM2-135M (8.2 s vs 10.4 s; the masked attention is ~1/3 of unified prompt time).
        flash_attn: flash attention for this context; ``None`` (default) inherits the ``Llama``'s
            setting (off unless ``Llama(flash_attn=True)``). llama.cpp's CPU kernel computes in
            F16, which moves log-probs by up to ~1e-2: keep it off on CPU for exact scores.

    The KV cache is sized lazily to what a call needs (prefix + the chunk's suffixes and new
    tokens), kept between calls and recreated only when a call needs more cells. Calls are
    serialised by a lock, so one decoder may be shared by threads.
    """

    def __init__(
        self,
        llm: llama_cpp.Llama,
        *,
        n_seq_max: int = 8,
        n_ctx: int | None = None,
        n_batch: int = 512,
        n_threads: int | None = None,
        n_threads_batch: int | None = None,
        kv_unified: bool | None = None,
        flash_attn: bool | None = None,
    ) -> None:
        self._llama_cpp = compat.import_llama_cpp("the batched decoder")
        if n_seq_max < 1:
            raise ValueError(f"n_seq_max must be >= 1, got {n_seq_max}")
        if n_batch < n_seq_max:
            raise ValueError(f"n_batch ({n_batch}) must be >= n_seq_max ({n_seq_max})")
        self._llm = llm
        self._model = compat.model_pointer(llm)
        self._vocab = self._llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab: int = int(llm.n_vocab())
        self.n_seq_max = n_seq_max
        self.n_ctx = int(n_ctx if n_ctx is not None else llm.n_ctx())
        self.n_batch = n_batch
        base = compat.context_params(llm)
        self._n_threads = int(n_threads or base.n_threads)
        self._n_threads_batch = int(n_threads_batch or base.n_threads_batch)
        self._inherited = {name: getattr(base, name) for name in _INHERITED_PARAMS}
        lib = self._llama_cpp
        self._flash_attn_type = {
            None: base.flash_attn_type,
            True: lib.LLAMA_FLASH_ATTN_TYPE_ENABLED,
            False: lib.LLAMA_FLASH_ATTN_TYPE_DISABLED,
        }[flash_attn]
        if kv_unified is None:
            flash = self._flash_attn_type != lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
            offloaded = compat.model_params(llm).n_gpu_layers != 0 and lib.llama_supports_gpu_offload()
            kv_unified = bool(flash or offloaded)
        #: The KV-cache layout in use (see ``kv_unified`` above).
        self.kv_unified: bool = kv_unified
        # Re-entrant so code inside a ``session`` block may also call ``generate``; the epoch
        # (bumped whenever the KV cache is wiped) tells a session its prompt must be re-read.
        self._lock = threading.RLock()
        self._epoch = 0
        self._ctx: Any = None
        self._n_cells = 0  # unified: cells in all; split: cells per sequence stream
        self._n_streams = 0  # sequence ids the context accepts (split: KV streams allocated)
        self._batch: Any = None
        self._batch_allocated = False
        # Free our context before llama-cpp-python frees the model it points to (the Llama's
        # exit stack runs callbacks last-in first-out). A weak reference keeps the Llama from
        # keeping this decoder alive.
        ref = weakref.ref(self)

        def _close_before_model() -> None:
            decoder = ref()
            if decoder is not None:
                decoder.close()

        compat.on_close(llm, _close_before_model)

    # --- public API ----------------------------------------------------------------------------

    def is_eog(self, token: int) -> bool:
        """Whether ``token`` ends generation (EOS, EOT, ... as the GGUF declares them)."""
        return bool(self._llama_cpp.llama_vocab_is_eog(self._vocab, token))

    def generate(
        self,
        prefix: Sequence[int],
        suffixes: Sequence[Sequence[int]],
        *,
        max_new_tokens: int | Sequence[int],
        track_ids: Sequence[int] = (),
        suffix_tail: Sequence[int] = (),
        stop_ids: Sequence[int] = (),
        tails: Sequence[Sequence[int]] = ((),),
    ) -> list[SequenceOutput]:
        """Greedily continue ``prefix + suffixes[i] + suffix_tail + tails[j]`` for every ``i, j``.

        The prefix is evaluated once and shared by all sequences; ``suffix_tail`` (e.g. a closing
        ``</paragraph>``) is appended to every suffix and is never truncated, whereas a suffix
        too long for ``n_ctx`` loses its last tokens. With several ``tails`` (questions asked of
        one paragraph) each suffix is evaluated once, up to its last token, and copied to one
        sequence per tail, which then feeds that last token and its tail: a suffix costs one
        evaluation however many tails it has, and ``n_seq_max`` sequences hold
        ``n_seq_max // len(tails)`` suffixes. Each sequence stops at its own end-of-generation
        token, at a token in ``stop_ids``, or after ``max_new_tokens`` (one number, or one per
        tail). ``track_ids`` selects the columns of ``tracked_logprobs``. Results come back
        suffix-major: the output of suffix ``i`` and tail ``j`` is at ``i * len(tails) + j``; a
        sequence whose decoding fails carries ``error`` and does not affect the others.
        """
        prefix = [int(t) for t in prefix]
        if not prefix:
            raise ValueError("prefix must hold at least one token (usually BOS)")
        tail_feeds = [[int(t) for t in tail] for tail in tails]
        n_tails = len(tail_feeds)
        if not 1 <= n_tails <= self.n_seq_max:
            raise ValueError(
                f"tails must hold 1 to n_seq_max={self.n_seq_max} tails, got {n_tails}"
            )
        max_new = (
            [max_new_tokens] * n_tails if isinstance(max_new_tokens, int) else list(max_new_tokens)
        )
        if len(max_new) != n_tails or min(max_new) < 0:
            raise ValueError(
                f"max_new_tokens must be >= 0, one number or one per tail, got {max_new_tokens}"
            )
        track = self._track_array(track_ids)
        tail = [int(t) for t in suffix_tail]
        reserve = max(len(t) + n for t, n in zip(tail_feeds, max_new, strict=True))
        feeds, truncated = self._fit_suffixes(len(prefix), suffixes, tail, reserve)
        if not feeds:
            return []
        # Several tails: the suffix's last token goes with each tail, so that every sequence
        # reads its first logits from its own batch row.
        shared = [feed[:-1] if n_tails > 1 else [] for feed in feeds]
        stops = frozenset(int(t) for t in stop_ids)
        outputs: list[SequenceOutput | None] = [None] * (len(feeds) * n_tails)
        per_group = self.n_seq_max // n_tails
        with self._lock:
            groups = deque(
                list(range(start, min(start + per_group, len(feeds))))
                for start in range(0, len(feeds), per_group)
            )
            cells = max(
                self._cells_needed(
                    len(prefix),
                    [
                        (
                            len(shared[i]),
                            [
                                len(feeds[i]) - len(shared[i]) + len(t) + n
                                for t, n in zip(tail_feeds, max_new, strict=True)
                            ],
                        )
                        for i in group
                    ],
                )
                for group in groups
            )
            widest = max(len(group) for group in groups) * n_tails
            prefix_logits: NDArray[np.float32] | None = None
            while groups:
                group = groups.popleft()
                slots = [
                    _Slot(
                        i * n_tails + j,
                        s * n_tails + j,
                        feeds[i][len(shared[i]) :] + tail_feeds[j] if max_new[j] else [],
                        len(prefix) + len(shared[i]),
                        max_new[j],
                        truncated[i],
                    )
                    for s, i in enumerate(group)
                    for j in range(n_tails)
                ]
                try:
                    if prefix_logits is None:
                        self._ensure_context(cells, widest)
                        self._memory_clear()
                        prefix_logits = self._eval_prefix(prefix)
                    self._share_prefix(len(group) * n_tails, len(prefix))
                    if n_tails > 1:
                        self._branch(group, shared, n_tails, len(prefix), prefix_logits)
                    self._run(slots, prefix_logits, track, stops)
                except DecodeError as exc:
                    # The KV cache may hold half-evaluated batches: rebuild it before going on.
                    prefix_logits = None
                    self._collect(slots, outputs, track)
                    remaining = [
                        i
                        for i in group
                        if any(outputs[i * n_tails + j] is None for j in range(n_tails))
                    ]
                    if len(remaining) > 1:
                        half = (len(remaining) + 1) // 2
                        groups.appendleft(remaining[half:])
                        groups.appendleft(remaining[:half])
                        logger.warning(
                            "llama_decode failed for a group of %d sequences (%s); "
                            "retrying the %d unfinished ones in smaller groups",
                            len(group),
                            exc,
                            len(remaining),
                        )
                    else:
                        for i in remaining:
                            for k in range(i * n_tails, (i + 1) * n_tails):
                                if outputs[k] is None:
                                    outputs[k] = _failed(str(exc), len(track), truncated[i])
                            logger.warning("suffix %d failed: %s", i, exc)
                    continue
                self._collect(slots, outputs, track)
        return [out if out is not None else _failed("not decoded", len(track)) for out in outputs]

    @contextmanager
    def session(self, prompt: Sequence[int]) -> Iterator[PromptSession]:
        """Hold the decoder for one prompt: read first-position log-probs, then maybe continue.

        Inside the ``with`` block the prompt stays in the KV cache, so
        ``session.logprobs(ids)`` followed by ``session.generate(..., forced=[tok])`` evaluates
        the prompt once (the Self-RAG gate reads p([Retrieval]) and, when it does not retrieve,
        answers after ``[No Retrieval]`` from the same cache). Other calls wait meanwhile.
        """
        tokens = [int(t) for t in prompt]
        if not tokens:
            raise ValueError("prompt must hold at least one token (usually BOS)")
        if len(tokens) >= self.n_ctx:
            raise ValueError(
                f"prompt has {len(tokens)} tokens but n_ctx is {self.n_ctx}: "
                "shorten it or raise n_ctx"
            )
        with self._lock:
            session = PromptSession(self, tokens)
            try:
                yield session
            finally:
                session._closed = True

    def close(self) -> None:
        """Free the native context and batch; the decoder can still be used (it re-creates them)."""
        lib = getattr(self, "_llama_cpp", None)
        if lib is None:
            return
        if getattr(self, "_batch_allocated", False):
            lib.llama_batch_free(self._batch)
            self._batch_allocated = False
            self._batch = None
        if getattr(self, "_ctx", None) is not None:
            lib.llama_free(self._ctx)
            self._ctx = None
            self._n_cells = 0
            self._n_streams = 0

    def __enter__(self) -> BatchedDecoder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        # At interpreter shutdown the llama_cpp module may already be gone.
        with contextlib.suppress(Exception):
            self.close()

    # --- context, batch and KV cache -----------------------------------------------------------

    def _cells_needed(self, prefix_len: int, branches: Sequence[tuple[int, Sequence[int]]]) -> int:
        """KV cells (per stream when split) for a prefix shared by ``(shared, own)`` branches:
        ``shared`` cells common to the branch's sequences, then ``own[j]`` cells of sequence j."""
        if self.kv_unified:
            return prefix_len + sum(shared + sum(own) for shared, own in branches)
        return prefix_len + max((shared + max(own) for shared, own in branches), default=0)

    def _ensure_context(self, cells: int, sequences: int = 1) -> bool:
        """Make sure the context holds ``cells`` KV cells (per stream when split) and accepts
        ``sequences`` sequence ids; returns True if it had to be (re)created."""
        if self._ctx is not None and self._n_cells >= cells and self._n_streams >= sequences:
            return False
        lib = self._llama_cpp
        n_cells = -(-max(cells, self._n_cells, 1) // _CELL_ROUNDING) * _CELL_ROUNDING
        # A unified cache costs nothing per sequence id; split streams are allocated as needed.
        streams = self.n_seq_max if self.kv_unified else max(sequences, self._n_streams, 1)
        self.close()
        params = lib.llama_context_default_params()
        for name, value in self._inherited.items():
            setattr(params, name, value)
        params.n_ctx = n_cells if self.kv_unified else n_cells * streams
        params.n_batch = self.n_batch
        params.n_ubatch = self.n_batch
        params.n_seq_max = streams
        params.n_threads = self._n_threads
        params.n_threads_batch = self._n_threads_batch
        params.flash_attn_type = self._flash_attn_type
        params.embeddings = False
        params.no_perf = True
        # Unified: seq_cp only tags the prefix cells with more sequence ids (no copy) and each
        # sequence uses as many cells as it needs. Split: one stream of n_cells per sequence.
        params.kv_unified = self.kv_unified
        ctx = lib.llama_init_from_model(self._model, params)
        if ctx is None:
            raise DecodeError(f"llama_init_from_model failed for a context of {n_cells} cells")
        self._ctx = ctx
        self._n_cells = n_cells
        self._n_streams = streams
        self._epoch += 1
        self._batch = lib.llama_batch_init(self.n_batch, 0, 1)
        self._batch_allocated = True
        logger.debug(
            "created llama.cpp context: %d cells%s, %d sequences, %s KV cache",
            n_cells,
            "" if self.kv_unified else " per stream",
            streams,
            "unified" if self.kv_unified else "split",
        )
        return True

    def _memory(self) -> Any:
        return self._llama_cpp.llama_get_memory(self._ctx)

    def _memory_clear(self) -> None:
        self._llama_cpp.llama_memory_clear(self._memory(), True)
        self._epoch += 1

    def _share_prefix(self, n_sequences: int, prefix_len: int) -> None:
        """Reset sequences ``0..n-1`` to the prefix held by sequence 0."""
        lib, mem = self._llama_cpp, self._memory()
        lib.llama_memory_seq_rm(mem, 0, prefix_len, -1)
        for seq_id in range(1, self._n_streams):
            lib.llama_memory_seq_rm(mem, seq_id, -1, -1)
        for seq_id in range(1, n_sequences):
            lib.llama_memory_seq_cp(mem, 0, seq_id, -1, -1)

    def _branch(
        self,
        group: list[int],
        shared: list[list[int]],
        n_tails: int,
        prefix_len: int,
        prefix_logits: NDArray[np.float32],
    ) -> None:
        """Evaluate each suffix's shared tokens into its first sequence, then copy them to the
        suffix's other sequences (``s * n_tails + j`` for the ``s``-th suffix of the group)."""
        prefills = [
            _Slot(-1, s * n_tails, list(shared[i]), prefix_len, 0) for s, i in enumerate(group)
        ]
        self._run(prefills, prefix_logits, np.empty(0, dtype=np.intp), frozenset())
        lib, mem = self._llama_cpp, self._memory()
        for s in range(len(group)):
            for j in range(1, n_tails):
                lib.llama_memory_seq_cp(mem, s * n_tails, s * n_tails + j, -1, -1)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """Evaluate ``(token, pos, seq_id, want_logits)`` entries in one ``llama_decode`` call."""
        batch = self._batch
        for i, (token, pos, seq_id, want_logits) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq_id
            batch.logits[i] = want_logits
        batch.n_tokens = len(entries)
        code = self._llama_cpp.llama_decode(self._ctx, batch)
        if code != 0:
            raise DecodeError(f"llama_decode returned {code}", code)

    def _logits(self, i: int) -> NDArray[np.float32]:
        ptr = self._llama_cpp.llama_get_logits_ith(self._ctx, i)
        if not ptr:
            raise DecodeError(f"llama.cpp returned no logits for batch index {i}")
        return np.ctypeslib.as_array(
            ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,)
        ).copy()

    def _eval_prefix(self, prefix: Sequence[int]) -> NDArray[np.float32]:
        """Evaluate ``prefix`` into sequence 0; returns the logits after its last token."""
        for start in range(0, len(prefix), self.n_batch):
            chunk = prefix[start : start + self.n_batch]
            last = start + len(chunk) == len(prefix)
            self._decode(
                [(tok, start + j, 0, last and j == len(chunk) - 1) for j, tok in enumerate(chunk)]
            )
        return self._logits(-1)

    # --- the decoding loop ---------------------------------------------------------------------

    def _run(
        self,
        slots: list[_Slot],
        start_logits: NDArray[np.float32],
        track: NDArray[np.intp],
        stops: frozenset[int],
    ) -> None:
        """Decode every slot to completion; a slot with nothing to feed uses ``start_logits``.

        A slot with ``max_new == 0`` only evaluates its feed into the KV cache (no logits).
        """
        for slot in slots:
            if slot.feed:
                continue
            if slot.max_new == 0:
                slot.finish_reason = "length"
            else:
                self._choose(slot, start_logits, track, stops)
        while True:
            live = [s for s in slots if s.finish_reason is None]
            if not live:
                return
            entries: list[tuple[int, int, int, bool]] = []
            readers: list[tuple[_Slot, int]] = []
            for slot in live:
                room = self.n_batch - len(entries)
                if room <= 0:
                    break
                if not self.kv_unified and entries and len(slot.feed) > room:
                    # llama.cpp cuts a split-cache batch into micro-batches with as many tokens
                    # from each stream: a suffix's last few tokens would make one tiny pass.
                    continue
                take = slot.feed[:room]
                del slot.feed[: len(take)]
                for j, tok in enumerate(take):
                    want = not slot.feed and j == len(take) - 1 and slot.max_new > 0
                    if want:
                        readers.append((slot, len(entries)))
                    entries.append((tok, slot.pos, slot.seq_id, want))
                    slot.pos += 1
                if not slot.feed and slot.max_new == 0:
                    slot.finish_reason = "length"
            self._decode(entries)
            for slot, batch_index in readers:
                self._choose(slot, self._logits(batch_index), track, stops)

    def _choose(
        self,
        slot: _Slot,
        logits: NDArray[np.float32],
        track: NDArray[np.intp],
        stops: frozenset[int],
    ) -> None:
        """Greedy step: record the exact log-probs, append the argmax, decide whether to stop."""
        row = logits.astype(np.float64)
        token = int(np.argmax(row))  # first maximum, like llama.cpp's greedy sampler
        top = row[token]
        log_z = top + np.log(np.sum(np.exp(row - top)))
        slot.tokens.append(token)
        slot.token_logprobs.append(float(top - log_z))
        slot.tracked.append(row[track] - log_z)
        if self.is_eog(token) or token in stops:
            slot.finish_reason = "stop"
        elif len(slot.tokens) >= slot.max_new:
            slot.finish_reason = "length"
        else:
            slot.feed = [token]

    def _collect(
        self,
        slots: list[_Slot],
        outputs: list[SequenceOutput | None],
        track: NDArray[np.intp],
    ) -> None:
        """Move finished slots into ``outputs``."""
        for slot in slots:
            if slot.finish_reason is None:
                continue
            outputs[slot.index] = SequenceOutput(
                tokens=slot.tokens,
                token_logprobs=np.asarray(slot.token_logprobs, dtype=np.float64),
                tracked_logprobs=(
                    np.vstack(slot.tracked) if slot.tracked else np.empty((0, len(track)))
                ),
                finish_reason=slot.finish_reason,
                truncated=slot.truncated,
            )

    # --- input checks --------------------------------------------------------------------------

    def _track_array(self, track_ids: Sequence[int]) -> NDArray[np.intp]:
        track = np.asarray([int(t) for t in track_ids], dtype=np.intp)
        if track.size and (track.min() < 0 or track.max() >= self.n_vocab):
            raise ValueError(f"track_ids must lie in [0, {self.n_vocab}), got {track.tolist()}")
        return track

    def _fit_suffixes(
        self,
        prefix_len: int,
        suffixes: Sequence[Sequence[int]],
        tail: list[int],
        reserve: int,
    ) -> tuple[list[list[int]], list[int]]:
        """Append ``tail`` to each suffix, truncating suffixes that would overflow ``n_ctx``
        once ``reserve`` positions (the longest of tails + new tokens) are kept after them."""
        budget = self.n_ctx - prefix_len - len(tail) - reserve
        if budget < 0:
            raise ValueError(
                f"prefix ({prefix_len} tokens) + tail ({len(tail)}) + tails and max_new_tokens "
                f"({reserve}) exceed n_ctx={self.n_ctx}: shorten the query or raise n_ctx"
            )
        feeds: list[list[int]] = []
        truncated: list[int] = []
        for suffix in suffixes:
            tokens = [int(t) for t in suffix]
            cut = max(0, len(tokens) - budget)
            feeds.append(tokens[: len(tokens) - cut] + tail)
            truncated.append(cut)
        if any(truncated):
            message = (
                f"{sum(1 for c in truncated if c)} of {len(truncated)} sequence(s) truncated to "
                f"fit n_ctx={self.n_ctx} (prefix {prefix_len} tokens, {reserve} after the suffix):"
                f" dropped {truncated} tokens from the end of each suffix"
            )
            logger.warning(message)
            warnings.warn(message, stacklevel=3)
        return feeds, truncated


class PromptSession:
    """One prompt held in the decoder's KV cache (see :meth:`BatchedDecoder.session`)."""

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
        decoder._ensure_context(decoder._cells_needed(len(self._prompt), [(0, [extra_cells])]))
        if self._logits is None or self._epoch != decoder._epoch:
            decoder._memory_clear()
            self._epoch = decoder._epoch
            self._logits = None  # stays None if evaluation fails
            self._logits = decoder._eval_prefix(self._prompt)
        return self._logits

    def logprobs(self, track_ids: Sequence[int]) -> NDArray[np.float64]:
        """Full-vocabulary log-probs of ``track_ids`` for the token after the prompt."""
        track = self._decoder._track_array(track_ids)
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
        openings. Raises :class:`DecodeError` when llama.cpp fails.
        """
        decoder = self._decoder
        forced_tokens = [int(t) for t in forced]
        if len(self._prompt) + len(forced_tokens) + max_new_tokens > decoder.n_ctx:
            raise ValueError(
                f"prompt ({len(self._prompt)}) + forced ({len(forced_tokens)}) + max_new_tokens "
                f"({max_new_tokens}) exceed n_ctx={decoder.n_ctx}"
            )
        track = decoder._track_array(track_ids)
        start_logits = self._ready(len(forced_tokens) + max_new_tokens)
        decoder._share_prefix(1, len(self._prompt))
        slot = _Slot(0, 0, forced_tokens, len(self._prompt), max_new_tokens)
        try:
            decoder._run([slot], start_logits, track, frozenset(int(t) for t in stop_ids))
        except DecodeError:
            self._logits = None  # the cache may hold half a batch: re-read the prompt next time
            raise
        outputs: list[SequenceOutput | None] = [None]
        decoder._collect([slot], outputs, track)
        assert outputs[0] is not None
        return outputs[0]


def _failed(error: str, n_tracked: int, truncated: int = 0) -> SequenceOutput:
    return SequenceOutput(
        tokens=[],
        token_logprobs=np.empty(0),
        tracked_logprobs=np.empty((0, n_tracked)),
        finish_reason="error",
        truncated=truncated,
        error=error,
    )
