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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from llama_index.packs.self_rag_rse.llamacpp import compat
from llama_index.packs.self_rag_rse.llamacpp.session import (
    PromptSession,
    SequenceOutput,
    Slot,
    collect,
    failed,
    fit_suffixes,
    greedy_step,
    track_array,
)

if TYPE_CHECKING:
    import llama_cpp

__all__ = [
    "BatchedDecoder",
    "ContextCreationError",
    "DecodeError",
    "PromptSession",
    "SequenceOutput",
]

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


class DecodeError(RuntimeError):
    """``llama_decode`` (or context creation) failed; ``code`` is llama.cpp's return value."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class ContextCreationError(DecodeError):
    """llama.cpp could not create a context (``llama_init_from_model`` returned NULL), usually
    because the KV cache does not fit in memory, even for the smallest group of sequences.

    ``cells`` is the KV-cache size that was requested (all streams together) and ``sequences``
    the sequences it was for.
    """

    def __init__(self, cells: int, sequences: int) -> None:
        tails = ", fewer tails per suffix" if sequences > 1 else ""
        super().__init__(
            f"llama.cpp could not create a context of {cells} KV cells for {sequences} "
            "sequence(s) (llama_init_from_model returned NULL; usually the KV cache does not fit "
            f"in memory): free memory, or ask for less: a lower n_ctx (longer suffixes are then "
            f"truncated), fewer max_new_tokens{tails}, or a smaller KV cache type "
            "(Llama(type_k=..., type_v=...))"
        )
        self.cells = cells
        self.sequences = sequences


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
    tokens), kept between calls and recreated only when a call needs more cells. When llama.cpp
    cannot create a context that large (not enough memory), a call decodes fewer sequences at a
    time, down to one suffix, and raises :class:`ContextCreationError` only if even that fails.

    Calls are serialised by a lock, so one decoder may be shared by threads; :meth:`close` and
    ``Llama.close()`` wait for the running call. Once the ``Llama``'s model is closed every call
    raises :class:`~.compat.ModelClosedError` (see :meth:`check_open`).
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
            offloaded = (
                compat.model_params(llm).n_gpu_layers != 0 and lib.llama_supports_gpu_offload()
            )
            kv_unified = bool(flash or offloaded)
        #: The KV-cache layout in use (see ``kv_unified`` above).
        self.kv_unified: bool = kv_unified
        # Re-entrant so code inside a ``session`` block may also call ``generate``; the epoch
        # (bumped whenever the KV cache is wiped) tells a session its prompt must be re-read.
        # Every use of the native context or batch, and freeing them, happens under this lock.
        self._lock = threading.RLock()
        self._epoch = 0
        self._ctx: Any = None
        self._n_cells = 0  # unified: cells in all; split: cells per sequence stream
        self._n_streams = 0  # sequence ids the context accepts (split: KV streams allocated)
        self._batch: Any = None
        self._batch_allocated = False
        self._closed_model = False
        # Free our context before llama-cpp-python frees the model it points to (its exit
        # stacks run callbacks last-in first-out). A weak reference keeps the Llama from
        # keeping this decoder alive.
        ref = weakref.ref(self)

        def _before_model_is_freed() -> None:
            decoder = ref()
            if decoder is not None:
                decoder._model_closing()

        compat.on_close(llm, _before_model_is_freed)

    # --- public API ----------------------------------------------------------------------------

    @property
    def closed_model(self) -> bool:
        """Whether the ``Llama`` this decoder runs on has closed (or is closing) its model."""
        return self._closed_model or compat.is_closed(self._llm)

    def check_open(self) -> None:
        """Raise :class:`~.compat.ModelClosedError` if the ``Llama``'s model was closed.

        Every public method of the decoder and of its sessions checks this first. Code that
        calls the ``Llama`` itself (``tokenize``, ``detokenize``, ``token_eos``...) should call
        it before: llama-cpp-python reads the freed model there and crashes the process.
        """
        if self.closed_model:
            raise compat.ModelClosedError()

    @contextmanager
    def hold(self) -> Iterator[None]:
        """Hold the decoder (and so the model's lifetime) for a block of work on the ``Llama``.

        Inside the block the model is known to be open and cannot be closed by another thread
        (``Llama.close()`` waits for the block), so code may call ``tokenize``/``detokenize``
        and the decoder safely. Other decoder calls wait meanwhile.
        """
        with self._lock:
            self.check_open()
            yield

    def is_eog(self, token: int) -> bool:
        """Whether ``token`` ends generation (EOS, EOT, ... as the GGUF declares them)."""
        self.check_open()
        return self._is_eog(token)

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

        Raises :class:`ContextCreationError` when no llama.cpp context fits even one suffix, and
        :class:`~.compat.ModelClosedError` when the model is (or gets, from another thread,
        mid-call) closed.
        """
        self.check_open()
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
        track = track_array(track_ids, self.n_vocab)
        tail = [int(t) for t in suffix_tail]
        reserve = max(len(t) + n for t, n in zip(tail_feeds, max_new, strict=True))
        feeds, truncated = fit_suffixes(self.n_ctx, len(prefix), suffixes, tail, reserve)
        if any(truncated):
            message = (
                f"{sum(1 for c in truncated if c)} of {len(truncated)} sequence(s) truncated to "
                f"fit n_ctx={self.n_ctx} (prefix {len(prefix)} tokens, {reserve} after the "
                f"suffix): dropped {truncated} tokens from the end of each suffix"
            )
            logger.warning(message)
            warnings.warn(message, stacklevel=2)
        if not feeds:
            return []
        # Several tails: the suffix's last token goes with each tail, so that every sequence
        # reads its first logits from its own batch row.
        shared = [feed[:-1] if n_tails > 1 else [] for feed in feeds]
        stops = frozenset(int(t) for t in stop_ids)
        outputs: list[SequenceOutput | None] = [None] * (len(feeds) * n_tails)
        per_group = self.n_seq_max // n_tails

        def cells_of(group: list[int]) -> int:
            branches = [
                (
                    len(shared[i]),
                    [
                        len(feeds[i]) - len(shared[i]) + len(t) + n
                        for t, n in zip(tail_feeds, max_new, strict=True)
                    ],
                )
                for i in group
            ]
            return self._cells_needed(len(prefix), branches)

        with self._lock:
            self.check_open()  # again: the model may have been closed while we waited
            groups = _chunks(list(range(len(feeds))), per_group)
            prefix_logits: NDArray[np.float32] | None = None
            while groups:
                if prefix_logits is None:
                    groups = self._fit_context(groups, cells_of, n_tails)
                group = groups.popleft()
                slots = [
                    Slot(
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
                        self._memory_clear()
                        prefix_logits = self._eval_prefix(prefix)
                    self._share_prefix(len(group) * n_tails, len(prefix))
                    if n_tails > 1:
                        self._branch(group, shared, n_tails, len(prefix), prefix_logits)
                    self._run(slots, prefix_logits, track, stops)
                except DecodeError as exc:
                    # The KV cache may hold half-evaluated batches: rebuild it before going on.
                    prefix_logits = None
                    collect(slots, outputs, len(track))
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
                                    outputs[k] = failed(str(exc), len(track), truncated[i])
                            logger.warning("suffix %d failed: %s", i, exc)
                    continue
                collect(slots, outputs, len(track))
        return [out if out is not None else failed("not decoded", len(track)) for out in outputs]

    @contextmanager
    def session(self, prompt: Sequence[int]) -> Iterator[PromptSession]:
        """Hold the decoder for one prompt: read first-position log-probs, then maybe continue.

        Inside the ``with`` block the prompt stays in the KV cache, so
        ``session.logprobs(ids)`` followed by ``session.generate(..., forced=[tok])`` evaluates
        the prompt once (the Self-RAG gate reads p([Retrieval]) and, when it does not retrieve,
        answers after ``[No Retrieval]`` from the same cache). Other calls, :meth:`close` and
        ``Llama.close()`` from other threads wait meanwhile (``Llama.close()`` makes the
        session's next call raise :class:`~.compat.ModelClosedError` so the block ends soon).
        """
        self.check_open()
        tokens = [int(t) for t in prompt]
        if not tokens:
            raise ValueError("prompt must hold at least one token (usually BOS)")
        if len(tokens) >= self.n_ctx:
            raise ValueError(
                f"prompt has {len(tokens)} tokens but n_ctx is {self.n_ctx}: "
                "shorten it or raise n_ctx"
            )
        with self._lock:
            self.check_open()
            session = PromptSession(self, tokens)
            try:
                yield session
            finally:
                session._closed = True

    def close(self) -> None:
        """Free the native context and batch, once the call running in another thread ends.

        The decoder stays usable: its next call creates them again (unless the ``Llama``'s model
        was closed; then it raises :class:`~.compat.ModelClosedError`). Inside a ``session``
        block of the same thread, it frees them at once (the lock is re-entrant) and the
        session's next call recreates the context and re-reads its prompt. Do not call it from a
        thread that a running call waits on: it would wait forever.
        """
        lock = getattr(self, "_lock", None)
        if lock is None:  # __init__ failed before there was anything to free
            return
        with lock:
            self._free_native()

    def __enter__(self) -> BatchedDecoder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Unreachable, so no thread can be using it: free without waiting for the lock, which a
        # garbage collection running inside another call of this thread must not block on. At
        # interpreter shutdown the llama_cpp module may already be gone.
        with contextlib.suppress(Exception):
            self._free_native()

    # --- lifetime ------------------------------------------------------------------------------

    def _is_eog(self, token: int) -> bool:
        return bool(self._llama_cpp.llama_vocab_is_eog(self._vocab, token))

    def _model_closing(self) -> None:
        """The ``Llama`` is about to free its model: free our context first.

        The flag is set before taking the lock, so a call running in another thread stops at
        its next ``llama_decode`` (raising ModelClosedError) instead of finishing work nobody
        can use; taking the lock then holds the model's release until that call has left.
        """
        self._closed_model = True
        try:
            self.close()
        except Exception:
            # The model is freed whatever happens here; raising would only make the user's
            # Llama.close() fail.
            logger.exception("could not free the batched decoder's llama.cpp context")

    def _free_native(self) -> None:
        """Free the context and batch (the caller holds the lock or owns the last reference)."""
        lib = getattr(self, "_llama_cpp", None)
        if lib is None:
            return
        if getattr(self, "_batch_allocated", False):
            lib.llama_batch_free(self._batch)
            self._batch_allocated = False
            self._batch = None
        if getattr(self, "_ctx", None) is not None:
            if compat.is_closed(self._llm):
                # The model was freed without telling us (no exit stack to hook): llama_free
                # would read it. Leaking the context is the safe choice.
                logger.warning(
                    "the llama.cpp model was freed before the batched decoder's context; "
                    "the context is leaked: close the decoder before the Llama"
                )
            else:
                lib.llama_free(self._ctx)
            self._ctx = None
            self._n_cells = 0
            self._n_streams = 0

    # --- context, batch and KV cache -----------------------------------------------------------

    def _cells_needed(self, prefix_len: int, branches: Sequence[tuple[int, Sequence[int]]]) -> int:
        """KV cells (per stream when split) for a prefix shared by ``(shared, own)`` branches:
        ``shared`` cells common to the branch's sequences, then ``own[j]`` cells of sequence j."""
        if self.kv_unified:
            return prefix_len + sum(shared + sum(own) for shared, own in branches)
        return prefix_len + max((shared + max(own) for shared, own in branches), default=0)

    def _fit_context(
        self,
        groups: deque[list[int]],
        cells_of: Callable[[list[int]], int],
        n_tails: int,
    ) -> deque[list[int]]:
        """Ensure a context for the largest of ``groups`` (suffix indices decoded together).

        When llama.cpp cannot create it (usually: not enough memory for the KV cache), the
        groups are cut in half and the smaller context is tried, down to one suffix per group;
        returns the groups that fit. Raises :class:`ContextCreationError` if even one does not.
        """
        width = max(len(group) for group in groups)
        first_width = width
        while True:
            try:
                self._ensure_context(max(cells_of(g) for g in groups), width * n_tails)
                break
            except ContextCreationError as exc:
                if width == 1:
                    raise
                failure = exc
                width = (width + 1) // 2
                groups = _chunks([i for group in groups for i in group], width)
        if width < first_width:
            logger.warning(
                "%s; decoding %d suffix(es) at a time instead of %d, which is slower: "
                "lower n_seq_max to skip the failed attempt, or free memory",
                failure,
                width,
                first_width,
            )
        return groups

    def _ensure_context(self, cells: int, sequences: int = 1) -> bool:
        """Make sure the context holds ``cells`` KV cells (per stream when split) and accepts
        ``sequences`` sequence ids; returns True if it had to be (re)created.

        Raises :class:`ContextCreationError` when llama.cpp cannot create it.
        """
        if self._ctx is not None and self._n_cells >= cells and self._n_streams >= sequences:
            return False
        # Grown to cover the current context too, so that calls of alternating shapes do not
        # recreate it each time; if that much memory is not there, the bare request may be.
        wanted = (_round_cells(cells), self._streams(sequences))
        grown = (
            _round_cells(max(cells, self._n_cells)),
            self._streams(max(sequences, self._n_streams)),
        )
        self._free_native()
        for n_cells, streams in dict.fromkeys([grown, wanted]):
            ctx = self._create_context(n_cells, streams)
            if ctx is not None:
                break
        else:
            n_cells, streams = wanted
            raise ContextCreationError(self._total_cells(n_cells, streams), sequences)
        self._ctx = ctx
        self._n_cells = n_cells
        self._n_streams = streams
        self._epoch += 1
        self._batch = self._llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self._batch_allocated = True
        logger.debug(
            "created llama.cpp context: %d cells%s, %d sequences, %s KV cache",
            n_cells,
            "" if self.kv_unified else " per stream",
            streams,
            "unified" if self.kv_unified else "split",
        )
        return True

    def _streams(self, sequences: int) -> int:
        # A unified cache costs nothing per sequence id; split streams are allocated as needed.
        return self.n_seq_max if self.kv_unified else max(sequences, 1)

    def _total_cells(self, n_cells: int, streams: int) -> int:
        return n_cells if self.kv_unified else n_cells * streams

    def _create_context(self, n_cells: int, streams: int) -> Any:
        """A new llama.cpp context, or None when llama.cpp cannot create it."""
        lib = self._llama_cpp
        params = lib.llama_context_default_params()
        for name, value in self._inherited.items():
            setattr(params, name, value)
        params.n_ctx = self._total_cells(n_cells, streams)
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
        return lib.llama_init_from_model(self._model, params)

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
            Slot(-1, s * n_tails, list(shared[i]), prefix_len, 0) for s, i in enumerate(group)
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
        if self._closed_model:  # Llama.close() waits for us: stop now
            raise compat.ModelClosedError()
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
        slots: list[Slot],
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
                greedy_step(slot, start_logits, track, stops, self._is_eog)
        while True:
            live = [s for s in slots if s.finish_reason is None]
            if not live:
                return
            entries: list[tuple[int, int, int, bool]] = []
            readers: list[tuple[Slot, int]] = []
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
                greedy_step(slot, self._logits(batch_index), track, stops, self._is_eog)


def _round_cells(cells: int) -> int:
    return -(-max(cells, 1) // _CELL_ROUNDING) * _CELL_ROUNDING


def _chunks(indices: list[int], size: int) -> deque[list[int]]:
    """``indices`` cut into consecutive groups of at most ``size``."""
    return deque(indices[start : start + size] for start in range(0, len(indices), size))
