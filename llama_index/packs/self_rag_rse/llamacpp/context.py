"""The native llama.cpp context behind the batched decoder: creation, the KV cache, one decode.

Everything here is a thin layer over llama.cpp's low-level API (``llama_init_from_model``,
``llama_decode``, ``llama_memory_seq_cp``/``seq_rm``...) on the weights of a loaded ``Llama``. It
knows nothing about prompts or sequences' meaning; :mod:`.conversation` decides what to evaluate
where, :mod:`.decoder` owns the lock and the lifetime.

Two KV-cache layouts (``kv_unified``), and what they mean for the callers:

* **unified**: one buffer; copying a sequence only tags cells with one more sequence id (any
  range of positions), and a batch may mix any sequences.
* **split**: one stream per sequence id. A copy duplicates the whole stream (llama.cpp copies
  full streams only; :meth:`NativeContext.fork` trims the copy afterwards), and llama.cpp cuts a
  batch into micro-batches of *consecutive* sequence ids with as many tokens each: sequences
  decoded together should hold consecutive ids, in increasing order within the batch.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from llama_index.packs.self_rag_rse.llamacpp import compat

if TYPE_CHECKING:
    import llama_cpp

logger = logging.getLogger(__name__)

#: Context sizes are rounded up to this many KV cells (llama.cpp pads to 256 internally anyway).
CELL_ROUNDING = 256

#: Context parameters copied from the ``Llama`` so our context computes what the user's does.
INHERITED_PARAMS = (
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

#: For this long after llama.cpp failed to create a context of some size, no context at least
#: that large is tried again (the call goes straight to fewer sequences at a time); after it,
#: memory may have been freed and the full size is tried once more.
RETRY_FAILED_SIZE_AFTER_S = 60.0

#: One token of a batch: (token id, position, sequence id, whether its logits are wanted).
Entry = tuple[int, int, int, bool]


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


@dataclass
class DecodeStats:
    """What a decoder asked of llama.cpp since the last :meth:`reset` (cheap counters).

    ``prompt_tokens`` are prompt tokens evaluated; ``reused_tokens`` prompt tokens that were not,
    because the KV cache already held them (a prefix shared by several prompts, or kept from an
    earlier call of a conversation). ``generated_tokens`` were chosen by greedy steps;
    ``fed_tokens`` of them were evaluated again to continue (the last one of a sequence never
    is). ``steps`` counts the ``llama_decode`` calls that only continued generations;
    ``decode_seconds`` the time spent inside ``llama_decode``; ``kv_copies`` the sequence
    copies (whole streams with a split KV cache); ``contexts`` the llama.cpp contexts created.
    """

    decode_calls: int = 0
    decode_seconds: float = 0.0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    generated_tokens: int = 0
    fed_tokens: int = 0
    steps: int = 0
    kv_copies: int = 0
    contexts: int = 0

    def reset(self) -> None:
        """Zero every counter."""
        for name, value in asdict(DecodeStats()).items():
            setattr(self, name, value)


class NativeContext:
    """A llama.cpp context and batch on a model's weights, (re)created on demand.

    Not thread-safe: the owning decoder serialises every call. ``epoch`` changes whenever the KV
    cache is emptied (cleared, recreated or freed), so holders of sequences know to forget them.

    It keeps no reference to the ``Llama`` (only to the native model and a check of whether it
    was freed), so the callback that frees it before the model (:func:`.compat.on_close`) may
    hold it without keeping the ``Llama`` alive.
    """

    def __init__(
        self,
        llm: llama_cpp.Llama,
        *,
        n_batch: int,
        n_threads: int,
        kv_unified: bool,
        flash_attn_type: int,
        n_seq_max: int,
    ) -> None:
        self.lib = compat.import_llama_cpp("the batched decoder")
        #: Whether the Llama's model was freed (see :func:`.compat.closed_check`).
        self.model_closed = compat.closed_check(llm)
        self.model = compat.model_pointer(llm)
        # Bound now: at interpreter exit the llama_cpp module's globals may be gone when the
        # context is freed.
        self._llama_free = self.lib.llama_free
        self._llama_batch_free = self.lib.llama_batch_free
        self.vocab = self.lib.llama_model_get_vocab(self.model)
        self.n_vocab = int(llm.n_vocab())
        self.n_batch = n_batch
        self.n_threads = n_threads
        self.kv_unified = kv_unified
        self.flash_attn_type = flash_attn_type
        self.n_seq_max = n_seq_max
        base = compat.context_params(llm)
        self.inherited = {name: getattr(base, name) for name in INHERITED_PARAMS}
        self.stats = DecodeStats()
        #: Set by the decoder when the model is about to be freed: the next decode raises.
        self.closing = False
        self.ctx: Any = None
        self.n_cells = 0  # unified: cells in all; split: cells per sequence stream
        self.n_streams = 0  # sequence ids the context accepts (split: KV streams allocated)
        self.epoch = 0
        self._batch: Any = None
        #: The smallest context (total KV cells) llama.cpp failed to create, and when.
        self._failed: tuple[int, float] | None = None
        #: Whether decoding fewer sequences at a time was already reported (once per context).
        self.narrowing_reported = False

    # --- creation ---------------------------------------------------------------------------------

    def fits(self, cells: int, sequences: int) -> bool:
        """Whether the current context holds ``cells`` (per stream when split) and ``sequences``."""
        return self.ctx is not None and self.n_cells >= cells and self.n_streams >= sequences

    def ensure(self, cells: int, sequences: int = 1, room: tuple[int, int] | None = None) -> None:
        """Replace the context, which does not :meth:`fits` the call (the caller checked), by one
        that holds ``cells`` KV cells (per stream when split) and accepts ``sequences`` sequence
        ids; the new one (its KV cache empty, :attr:`epoch` moved on) is made big enough for
        ``room`` (cells, sequences) too, and for the current one, when that much memory is
        there; else for the bare request.

        Raises :class:`ContextCreationError` when llama.cpp cannot create it.
        """
        room_cells, room_sequences = room if room is not None else (cells, sequences)
        # Grown to cover the current context too, so that calls of alternating shapes do not
        # recreate it each time; if that much memory is not there, the bare request may be.
        wanted = (round_cells(cells), self._streams(sequences))
        grown = (
            round_cells(max(cells, room_cells, self.n_cells)),
            self._streams(max(sequences, room_sequences, self.n_streams)),
        )
        # Sizes llama.cpp just failed to create are not tried again, and when nothing is left
        # to try the current context (and the KV cache it holds) stays as it is.
        shapes = [s for s in dict.fromkeys([grown, wanted]) if not self._known_to_fail(*s)]
        if not shapes:
            raise ContextCreationError(self._total_cells(*wanted), sequences)
        self.free()
        for n_cells, streams in shapes:
            ctx = self._create(n_cells, streams)
            if ctx is not None:
                break
            # Only sizes below a recorded failure are tried, so this one is the new smallest.
            self._failed = (self._total_cells(n_cells, streams), time.monotonic())
        else:
            raise ContextCreationError(self._total_cells(*wanted), sequences)
        self.ctx = ctx
        self.n_cells = n_cells
        self.n_streams = streams
        self.epoch += 1
        self.stats.contexts += 1
        self._batch = self.lib.llama_batch_init(self.n_batch, 0, 1)
        logger.debug(
            "created llama.cpp context: %d cells%s, %d sequences, %s KV cache",
            n_cells,
            "" if self.kv_unified else " per stream",
            streams,
            "unified" if self.kv_unified else "split",
        )

    def free(self) -> None:
        """Free the context and batch (the KV cache with them)."""
        if self._batch is not None:
            self._llama_batch_free(self._batch)
            self._batch = None
        if self.ctx is not None:
            if self.model_closed():
                # The model was freed without telling us (no exit stack to hook): llama_free
                # would read it. Leaking the context is the safe choice; at interpreter exit
                # the process frees it a moment later, so only a leak during the program's
                # life is worth a warning.
                report = logger.debug if sys.is_finalizing() else logger.warning
                report(
                    "the llama.cpp model was freed before the batched decoder's context; "
                    "the context is leaked: close the decoder before the Llama"
                )
            else:
                self._llama_free(self.ctx)
            self.ctx = None
            self.n_cells = 0
            self.n_streams = 0
            self.epoch += 1

    def _streams(self, sequences: int) -> int:
        # A unified cache costs nothing per sequence id; split streams are allocated as needed.
        return self.n_seq_max if self.kv_unified else max(sequences, 1)

    def _total_cells(self, n_cells: int, streams: int) -> int:
        return n_cells if self.kv_unified else n_cells * streams

    def _known_to_fail(self, n_cells: int, streams: int) -> bool:
        """Whether a context this large failed to be created within the last
        :data:`RETRY_FAILED_SIZE_AFTER_S` seconds (a larger one would fail too).
        """
        if self._failed is None:
            return False
        cells, when = self._failed
        if time.monotonic() - when >= RETRY_FAILED_SIZE_AFTER_S:
            self._failed = None
            return False
        return self._total_cells(n_cells, streams) >= cells

    def _create(self, n_cells: int, streams: int) -> Any:
        """A new llama.cpp context, or None when llama.cpp cannot create it."""
        params = self.lib.llama_context_default_params()
        for name, value in self.inherited.items():
            setattr(params, name, value)
        params.n_ctx = self._total_cells(n_cells, streams)
        params.n_batch = self.n_batch
        params.n_ubatch = self.n_batch
        params.n_seq_max = streams
        params.n_threads = self.n_threads
        params.n_threads_batch = self.n_threads
        params.flash_attn_type = self.flash_attn_type
        params.embeddings = False
        params.no_perf = True
        # Unified: seq_cp only tags cells with more sequence ids (no copy) and each sequence
        # uses as many cells as it needs. Split: one stream of n_cells per sequence.
        params.kv_unified = self.kv_unified
        return self.lib.llama_init_from_model(self.model, params)

    # --- the KV cache ---------------------------------------------------------------------------

    def _memory(self) -> Any:
        return self.lib.llama_get_memory(self.ctx)

    def clear(self) -> None:
        """Forget every sequence (metadata only: cells no sequence holds are never read)."""
        self.lib.llama_memory_clear(self._memory(), False)
        self.epoch += 1

    def trim(self, seq_id: int, length: int) -> None:
        """Keep only positions ``[0, length)`` of ``seq_id`` (0: drop the sequence)."""
        self.lib.llama_memory_seq_rm(self._memory(), seq_id, length if length > 0 else -1, -1)

    def fork(self, src: int, dst: int, length: int) -> None:
        """Make ``dst`` hold positions ``[0, length)`` of ``src`` (``dst`` is overwritten).

        A unified cache tags those cells with ``dst``; a split one copies ``src``'s whole stream
        (on the next decode: llama.cpp copies full streams only) and drops the rest from ``dst``.
        """
        memory = self._memory()
        # llama.cpp's (memory, seq_id, p0, p1) and (memory, src, dst, p0, p1): positions
        # [p0, p1), -1 for an open end.
        self.lib.llama_memory_seq_rm(memory, dst, -1, -1)
        if self.kv_unified:
            self.lib.llama_memory_seq_cp(memory, src, dst, 0, length)
        else:
            self.lib.llama_memory_seq_cp(memory, src, dst, -1, -1)
            self.lib.llama_memory_seq_rm(memory, dst, length, -1)
        self.stats.kv_copies += 1

    # --- decoding ---------------------------------------------------------------------------------

    def decode(self, entries: list[Entry]) -> None:
        """Evaluate ``(token, pos, seq_id, want_logits)`` entries in one ``llama_decode`` call."""
        batch = self._batch
        for i, (token, pos, seq_id, want_logits) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq_id
            batch.logits[i] = want_logits
        batch.n_tokens = len(entries)
        if self.closing:  # Llama.close() waits for us: stop now
            raise compat.ModelClosedError()
        start = time.perf_counter()
        code = self.lib.llama_decode(self.ctx, batch)
        self.stats.decode_seconds += time.perf_counter() - start
        self.stats.decode_calls += 1
        if code != 0:
            raise DecodeError(f"llama_decode returned {code}", code)

    def logits(self, i: int) -> NDArray[np.float32]:
        """A copy of the logits of batch row ``i`` of the last decode."""
        ptr = self.lib.llama_get_logits_ith(self.ctx, i)
        if not ptr:
            raise DecodeError(f"llama.cpp returned no logits for batch index {i}")
        return np.ctypeslib.as_array(
            ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,)
        ).copy()

    def is_eog(self, token: int) -> bool:
        """Whether ``token`` ends generation (EOS, EOT, ... as the GGUF declares them)."""
        return bool(self.lib.llama_vocab_is_eog(self.vocab, token))


def round_cells(cells: int) -> int:
    """``cells`` rounded up to :data:`CELL_ROUNDING`."""
    return -(-max(cells, 1) // CELL_ROUNDING) * CELL_ROUNDING
