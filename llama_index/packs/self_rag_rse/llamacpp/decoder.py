"""Greedy multi-sequence decoding on llama.cpp, with exact log-probs of chosen tokens.

llama-cpp-python's high-level ``Llama`` decodes one sequence at a time and builds log-probs by
sorting the whole vocabulary and detokenizing every entry, behind ``logits_all=True``. This module
talks to llama.cpp's low-level API instead, on a second context over the weights an existing
``Llama`` already holds:

* what several prompts share is evaluated **once** (:mod:`.plan`) and a
  :class:`~.conversation.Conversation` keeps sequences in the KV cache between calls, so a
  second round of prompts evaluates only what is new;
* the prompts' remaining parts, and then one new token per live sequence, go through
  ``llama_decode`` together, so k sequences cost roughly one pass over the weights per step;
* at every generated position the raw logits are turned into an exact full-vocabulary
  log-softmax in numpy, from which the log-probs of a few *tracked* token ids are read.

"Exact" means exactly the softmax of the logits llama.cpp computed. Those logits depend a little
on how tokens were batched when the weights are quantized: on SmolLM2-135M Q4_1, llama.cpp's own
prefill and token-by-token paths differ by up to ~0.2 nats on likely tokens, so batched and serial
greedy decoding can part ways at a near tie. With F32 weights (the tests' model) batched, serial,
shared and separate evaluation and a ``logits_all`` reference agree to ~1e-5.

The module knows nothing about Self-RAG: :mod:`.reflection_critic` and :mod:`.backend` build the
prompts.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

from llama_index.packs.self_rag_rse.common.options import require_counts
from llama_index.packs.self_rag_rse.llamacpp import compat
from llama_index.packs.self_rag_rse.llamacpp.context import DecodeStats, NativeContext
from llama_index.packs.self_rag_rse.llamacpp.conversation import Conversation, ConversationSettings
from llama_index.packs.self_rag_rse.llamacpp.plan import Held
from llama_index.packs.self_rag_rse.llamacpp.sequences import (
    Request,
    SequenceOutput,
    fit_suffixes,
    track_array,
)

if TYPE_CHECKING:
    import llama_cpp


logger = logging.getLogger(__name__)


class BatchedDecoder:
    """Greedy decoding of many sequences that share prefixes, in one llama.cpp context.

    Args:
        llm: a loaded ``llama_cpp.Llama``; its weights are shared, its own context is untouched.
            Close this decoder before closing ``llm`` (closing ``llm`` closes it too).
        n_seq_max: sequences decoded together (and held by a conversation). More are processed
            in groups of this size, their shared prefix evaluated once. Higher values use the
            CPU/GPU better per step but need a KV cache holding all of them at once.
        n_ctx: maximum positions of one sequence (prompt + generated tokens); a suffix that
            would exceed it is truncated with a warning. Defaults to ``llm.n_ctx()``.
        n_batch: maximum tokens per ``llama_decode`` call (also the physical micro-batch).
        n_threads: CPU threads for every ``llama_decode`` of this decoder. Defaults to the
            ``Llama``'s ``n_threads_batch`` (llama-cpp-python: all cores), not its
            ``n_threads`` (half the cores, meant for one-token steps): nearly all of this
            decoder's work is batches of several sequences. On a machine shared with other busy
            processes (an embedding model in the same process included), fewer threads than
            cores are steadier: llama.cpp's threads wait for each other by spinning.
        kv_unified: KV-cache layout. ``True``: one buffer for all sequences; a shared prefix is
            handed on without a copy and memory follows the tokens held, but without flash attention
            every token also attends to (then masks out) the other sequences' cells. ``False``: one
            stream per sequence (memory: sequences × the longest one; a shared prefix is copied into
            each stream); attention stays within a sequence, and llama.cpp splits batches by stream.
            ``None`` (default) picks unified when flash attention is on or layers are offloaded to a
            GPU (the masked work is skipped or cheap there), split on a CPU without flash attention,
            where it was measured 21% faster for 10 paragraphs of SmolLM2-135M (8.2 s vs 10.4 s; the
            masked attention is ~1/3 of unified prompt time).
        flash_attn: flash attention for this context; ``None`` (default) inherits the ``Llama``'s
            setting (off unless ``Llama(flash_attn=True)``). llama.cpp's CPU kernel computes in
            F16, which moves log-probs by up to ~1e-2: keep it off on CPU for exact scores.
        share_prefixes: evaluate shared prefixes once and continue held sequences (default).
            ``False`` evaluates every prompt whole in its own sequence: slower, for checking
            that sharing changes nothing.

    The KV cache is sized lazily to what a call needs, kept between calls and recreated only
    when a call needs more. When llama.cpp cannot create a context that large (not enough
    memory), a call decodes fewer sequences at a time, down to one, and raises
    :class:`~.context.ContextCreationError` only if even that fails; for a minute after such a
    failure (``context.RETRY_FAILED_SIZE_AFTER_S``) no context that large is tried again, so
    later calls narrow at once and keep the context they have. :attr:`stats` counts the work done.

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
        kv_unified: bool | None = None,
        flash_attn: bool | None = None,
        share_prefixes: bool = True,
    ) -> None:
        lib = compat.import_llama_cpp("the batched decoder")
        require_counts(
            "BatchedDecoder", n_seq_max=n_seq_max, n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads
        )
        if n_batch < n_seq_max:
            raise ValueError(
                f"n_batch ({n_batch}) must be >= n_seq_max ({n_seq_max}), so that every "
                "sequence fits one batch: raise n_batch or lower n_seq_max"
            )
        if compat.is_closed(llm):
            raise compat.ModelClosedError()
        self._llm = llm
        self.n_seq_max = n_seq_max
        self.n_ctx = int(n_ctx if n_ctx is not None else llm.n_ctx())
        self.n_batch = n_batch
        self.share_prefixes = share_prefixes
        base = compat.context_params(llm)
        #: Threads of every decode (see the ``n_threads`` argument).
        self.n_threads: int = int(n_threads or base.n_threads_batch)
        flash_attn_type = {
            None: base.flash_attn_type,
            True: lib.LLAMA_FLASH_ATTN_TYPE_ENABLED,
            False: lib.LLAMA_FLASH_ATTN_TYPE_DISABLED,
        }[flash_attn]
        if kv_unified is None:
            flash = flash_attn_type != lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
            offloaded = (
                compat.model_params(llm).n_gpu_layers != 0 and lib.llama_supports_gpu_offload()
            )
            kv_unified = bool(flash or offloaded)
        #: The KV-cache layout in use (see ``kv_unified`` above).
        self.kv_unified: bool = kv_unified
        self._native = NativeContext(
            llm,
            n_batch=n_batch,
            n_threads=self.n_threads,
            kv_unified=kv_unified,
            flash_attn_type=flash_attn_type,
            n_seq_max=n_seq_max,
        )
        self.n_vocab: int = self._native.n_vocab
        self._settings = ConversationSettings(
            n_ctx=self.n_ctx,
            share_prefixes=share_prefixes,
            check_open=self.check_open,
            model=os.path.basename(llm.model_path),
            text=self._text,
        )
        # Re-entrant so code inside a ``conversation`` block may also call
        # ``generate`` (which empties the KV cache; the block's next call notices and re-reads).
        # Every use of the native context or batch, and freeing them, happens under this lock.
        self._lock = threading.RLock()
        #: What the last ``carry_over`` conversation left in the KV cache (see ``conversation``).
        self._carried: tuple[dict[int, Held], int] | None = None
        # Free our context before llama-cpp-python frees the model it points to (its exit
        # stacks run callbacks last-in first-out). The callback holds the context and the lock,
        # never this decoder or the Llama (see _free_before_model); it is withdrawn when this
        # decoder goes (__del__), so decoders built and dropped on one model do not pile up.
        self._withdraw = compat.on_close(
            llm, functools.partial(_free_before_model, self._native, self._lock)
        )

    # --- public API ----------------------------------------------------------------------------

    @property
    def stats(self) -> DecodeStats:
        """Counters of the work asked of llama.cpp (``decoder.stats.reset()`` to restart)."""
        return self._native.stats

    @property
    def kv_cells(self) -> int:
        """KV cells of the llama.cpp context held now (per sequence stream when the cache is
        split); 0 when there is none (before the first call, or once freed).
        """
        return self._native.n_cells

    @property
    def closed_model(self) -> bool:
        """Whether the ``Llama`` this decoder runs on has closed (or is closing) its model."""
        return self._native.closing or compat.is_closed(self._llm)

    def check_open(self) -> None:
        """Raise :class:`~.compat.ModelClosedError` if the ``Llama``'s model was closed.

        Every public method of the decoder and of its conversations checks this first. Code that
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

    def _text(self, tokens: Sequence[int]) -> str:
        """``tokens`` as text, Self-RAG's special tokens shown (what traces show)."""
        self.check_open()
        return self._llm.detokenize(list(tokens), special=True).decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        """Whether ``token`` ends generation (EOS, EOT, ... as the GGUF declares them)."""
        self.check_open()
        return self._native.is_eog(token)

    @contextmanager
    def conversation(self, carry_over: bool = False) -> Iterator[Conversation]:
        """Hold the decoder for several calls whose KV cache carries over.

        ``conversation.run(requests)`` decodes :class:`~.sequences.Request` objects (full prompts);
        what one call evaluated stays in the KV cache for the next, so a later prompt that
        begins with an earlier prompt (and its generated tokens) evaluates only the rest::

            with decoder.conversation() as conv:
                answers = conv.run([Request(p, max_new_tokens=64) for p in answer_prompts])
                labels = conv.run([Request(p, 1, label_ids) for p in support_prompts])

        With ``carry_over=True`` the conversation starts with the sequences the last ``carry_over``
        conversation left in the KV cache, when no other call used the cache since (a long-form
        query's next depth continues the contexts its last depth read); otherwise the cache starts
        empty. Results are the same either way, only the time differs.

        Other calls, :meth:`close` and ``Llama.close()`` from other threads wait meanwhile
        (``Llama.close()`` makes the next call raise :class:`~.compat.ModelClosedError`).
        """
        self.check_open()
        with self._lock:
            self.check_open()  # again: the model may have been closed while we waited
            carried = self._carried if carry_over else None
            conversation = Conversation(self._native, self._settings, carried)
            self._carried = None
            try:
                yield conversation
            finally:
                conversation._closed = True
                if carry_over:
                    self._carried = conversation.carried()

    def generate(
        self,
        prefix: Sequence[int],
        suffixes: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        track_ids: Sequence[int] = (),
        suffix_tail: Sequence[int] = (),
        stop_ids: Sequence[int] = (),
    ) -> list[SequenceOutput]:
        """Greedily continue ``prefix + suffixes[i] + suffix_tail`` for every ``i``.

        The prefix is evaluated once and shared by all sequences; ``suffix_tail`` (e.g. a closing
        ``</paragraph>``) is appended to every suffix and is never truncated, whereas a suffix too
        long for ``n_ctx`` loses its last tokens. Each sequence stops at its own end-of-generation
        token, at a token in ``stop_ids``, or after ``max_new_tokens``. ``track_ids`` selects the
        columns of ``tracked_logprobs``. Results come back in suffix order; a sequence whose
        decoding fails carries ``error`` and does not affect the others. The KV cache starts empty.

        Raises :class:`~.context.ContextCreationError` when no llama.cpp context fits even one
        suffix, and :class:`~.compat.ModelClosedError` when the model is (or gets, from another
        thread, mid-call) closed.
        """
        self.check_open()
        prefix = [int(t) for t in prefix]
        if not prefix:
            raise ValueError("prefix must hold at least one token (usually BOS)")
        # max_new_tokens is checked with each request (Conversation.run).
        track_array(track_ids, self.n_vocab)  # fail before any work on a bad id
        tail = [int(t) for t in suffix_tail]
        feeds, truncated = fit_suffixes(
            n_ctx=self.n_ctx,
            prefix_len=len(prefix),
            suffixes=suffixes,
            tail=tail,
            reserve=max_new_tokens,
        )
        if any(truncated):
            message = (
                f"{sum(1 for c in truncated if c)} of {len(truncated)} sequence(s) truncated to "
                f"fit n_ctx={self.n_ctx} (prefix {len(prefix)} tokens, {max_new_tokens} new "
                f"tokens): dropped {truncated} tokens from the end of each suffix"
            )
            logger.warning(message)
            warnings.warn(message, stacklevel=2)
        requests = [
            Request(
                [*prefix, *feed],
                max_new_tokens=max_new_tokens,
                track_ids=track_ids,
                stop_ids=stop_ids,
                truncated=cut,
            )
            for feed, cut in zip(feeds, truncated, strict=True)
        ]
        if not requests:
            return []
        with self.conversation() as conversation:
            return conversation.run(requests)

    def close(self) -> None:
        """Free the native context and batch, once the call running in another thread ends.

        The decoder stays usable: its next call creates them again (unless the ``Llama``'s model
        was closed; then it raises :class:`~.compat.ModelClosedError`). Inside a
        ``conversation`` block of the same thread, it frees them at once (the lock is
        re-entrant) and the block's next call recreates the context and re-reads what it needs.
        Do not call it from a thread that a running call waits on: it would wait forever.
        """
        with self._lock:
            self._native.free()

    def __enter__(self) -> BatchedDecoder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Unreachable, so no thread can be using it: free without waiting for the lock, which a
        # garbage collection running inside another call of this thread must not block on. At
        # interpreter shutdown the llama_cpp module may already be gone.
        with contextlib.suppress(Exception):
            self._withdraw()
            self._native.free()


def _free_before_model(native: NativeContext, lock: threading.RLock) -> None:
    """The ``Llama`` is about to free its model: free the decoder's context first.

    Registered with :func:`.compat.on_close`, it holds the decoder's native context and lock
    rather than the decoder. A weak reference to the decoder would not do: when the decoder and
    the ``Llama`` become garbage together (a script that exits without closing them: its
    globals are collected at interpreter exit), the garbage collector clears weak references
    before it runs finalizers, so the model would be freed first and the context orphaned. The
    context references neither the decoder nor the ``Llama``, so holding it keeps neither
    alive; a decoder withdraws it when it goes.

    ``closing`` is set before taking the lock, so a call running in another thread stops at its
    next ``llama_decode`` (raising ModelClosedError) instead of finishing work nobody can use;
    taking the lock then holds the model's release until that call has left. At interpreter
    exit the lock is not waited for (a daemon thread frozen while holding it never lets go):
    if it is held, the context is left to the process's end.
    """
    native.closing = True
    if not lock.acquire(blocking=not sys.is_finalizing()):
        return
    try:
        native.free()
    except Exception:
        # The model is freed whatever happens here; raising would only make the user's
        # Llama.close() fail.
        logger.exception("could not free the batched decoder's llama.cpp context")
    finally:
        lock.release()
