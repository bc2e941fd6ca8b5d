"""Several decoding calls on one llama.cpp context whose KV cache carries over.

A Self-RAG judgement asks four questions of each paragraph in two rounds: the answer and the
paragraph's relevance, then whether the paragraph supports that answer and how useful the answer
is. The second round cannot join the first one's batch (it needs the answers), but its prompts
begin with what the first round evaluated: the system prompt, the question, the paragraph. A
:class:`Conversation` keeps the first round's sequences in the KV cache, so the second round
evaluates only what is new.

Each :meth:`Conversation.run` plans its prompts against the sequences the cache holds
(:mod:`.plan`: shared prefixes once, held prefixes not at all), evaluates the plan level by level
in a few batched ``llama_decode`` calls (on a split cache, runs of about the same depth together:
see :data:`DEPTH_RATIO`), then generates for all prompts together, one token each per step. The
held sequences are a cache: when sequence ids or cells run out, the least recently made ones are
dropped, and what was dropped is evaluated again when a later prompt needs it. Results never
depend on what was held, only the time does (with F32 weights and KV cache, shared and separate
evaluation agree to ~1e-5; quantized kernels round a little differently for other batch shapes).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
from numpy.typing import NDArray

from llama_index.packs.self_rag_rse.llamacpp.context import (
    ContextCreationError,
    DecodeError,
    Entry,
    NativeContext,
)
from llama_index.packs.self_rag_rse.llamacpp.model_calls import traced
from llama_index.packs.self_rag_rse.llamacpp.plan import MIN_SHARED_TOKENS, Held, Plan, assign, plan
from llama_index.packs.self_rag_rse.llamacpp.sequences import (
    Request,
    SequenceOutput,
    Slot,
    failed,
    greedy_step,
    output,
    track_array,
)

logger = logging.getLogger(__name__)

#: With a split KV cache, a generating sequence is moved to fill a gap in the ids being decoded
#: (llama.cpp decodes only consecutive ids in one pass) if it may still need this many steps:
#: the move copies one stream, a gap costs one more pass over the weights per step.
MIN_STEPS_TO_MOVE = 4
#: With a split KV cache, every sequence of a micro-batch attends over as many cells as the
#: deepest one holds, rounded up to :data:`KV_PADDING`: prompt runs ending this many times
#: shallower than the deepest get a decode of their own, and a run crossing a multiple of
#: :data:`KV_PADDING` is cut there, each only when both parts hold :data:`MIN_SPLIT_TOKENS`
#: (a smaller pass uses the matrix kernels poorly).
DEPTH_RATIO = 1.5
MIN_SPLIT_TOKENS = 32
KV_PADDING = 256


@dataclass(frozen=True)
class ConversationSettings:
    """What a conversation needs to know of the decoder that holds it, besides its native context
    (which has ``n_seq_max`` and ``n_batch``): ``n_ctx`` positions per sequence, whether prefixes
    are shared (see :class:`~llama_index.packs.self_rag_rse.llamacpp.decoder.BatchedDecoder`),
    ``check_open`` (raises once the model was closed), the ``model`` and ``text`` traces show.
    """

    n_ctx: int
    share_prefixes: bool
    check_open: Callable[[], None]
    model: str = ""
    text: Callable[[Sequence[int]], str] = str


@dataclass
class _Prompt:
    """A request with its tokens and tracked ids checked and converted."""

    request: Request
    tokens: list[int]
    track: NDArray[np.intp]


class Conversation:
    """Decoding calls whose KV cache carries over (see
    :meth:`~llama_index.packs.self_rag_rse.llamacpp.decoder.BatchedDecoder.conversation`).

    Use it inside its ``with`` block only; the decoder is held meanwhile.
    """

    def __init__(
        self,
        native: NativeContext,
        settings: ConversationSettings,
        carried: tuple[dict[int, Held], int] | None = None,
    ) -> None:
        self._settings = settings
        self._native = native
        # Sequence id -> what it holds, oldest first; valid while the native context's epoch
        # is ``_epoch`` (a carried-over cache that was emptied since is forgotten by _sync).
        self._held: dict[int, Held] = dict(carried[0]) if carried else {}
        self._epoch = carried[1] if carried else -1
        self._width = native.n_seq_max  # prompts per group; halved when no context fits
        self._closed = False

    @property
    def held(self) -> dict[int, list[int]]:
        """Tokens of every sequence the KV cache holds for this conversation, by sequence id."""
        self._sync()
        return {seq: list(h.tokens) for seq, h in self._held.items()}

    def carried(self) -> tuple[dict[int, Held], int]:
        """What the KV cache holds for a later conversation to continue (see
        :meth:`~llama_index.packs.self_rag_rse.llamacpp.decoder.BatchedDecoder.conversation`).
        """
        return dict(self._held), self._epoch

    def run(self, requests: Sequence[Request]) -> list[SequenceOutput]:
        """:meth:`_decode`, each request a model call in traces (:mod:`.model_calls`)."""
        settings = self._settings
        return traced(self._decode, requests, model=settings.model, text=settings.text)

    def _decode(self, requests: Sequence[Request]) -> list[SequenceOutput]:
        """Decode every request; outputs come back in request order.

        Prompts are decoded ``n_seq_max`` at a time at most; prefixes shared with each other or
        with sequences held from earlier calls are not evaluated again. A request whose
        decoding fails comes back with ``error`` set and does not affect the others. Raises
        :class:`~.context.ContextCreationError` when no llama.cpp context fits even one request,
        and :class:`~.compat.ModelClosedError` when the model is (or gets) closed.
        """
        if self._closed:
            raise RuntimeError("the conversation is closed: use it inside its `with` block only")
        self._settings.check_open()
        prompts = [self._checked(r) for r in requests]
        outputs: list[SequenceOutput | None] = [None] * len(prompts)
        stats = self._native.stats
        evaluated_before = stats.prompt_tokens
        pending = _chunks(list(range(len(prompts))), self._width)
        first_width = self._width
        failure: ContextCreationError | None = None
        while pending:
            group = pending.popleft()
            try:
                group_plan = self._prepare(group, prompts)
            except ContextCreationError as exc:
                if len(group) == 1:
                    raise
                failure = exc
                self._width = (len(group) + 1) // 2
                pending = _chunks([r for g in (group, *pending) for r in g], self._width)
                continue
            try:
                self._execute(group_plan, group, prompts, outputs)
            except DecodeError as exc:
                self._forget()  # the cache may hold half-evaluated batches
                remaining = [r for r in group if outputs[r] is None]
                if len(remaining) > 1:
                    half = (len(remaining) + 1) // 2
                    pending.appendleft(remaining[half:])
                    pending.appendleft(remaining[:half])
                    logger.warning(
                        "llama_decode failed for a group of %d sequences (%s); retrying the %d "
                        "unfinished ones in smaller groups",
                        len(group),
                        exc,
                        len(remaining),
                    )
                else:
                    for r in remaining:
                        p = prompts[r]
                        outputs[r] = failed(str(exc), len(p.track), p.request.truncated)
                        logger.warning("sequence %d failed: %s", r, exc)
        if failure is not None and self._width < first_width:
            # Reported once: later calls skip the size that failed for a while (see
            # context.RETRY_FAILED_SIZE_AFTER_S) and narrow at no cost.
            report = logger.debug if self._native.narrowing_reported else logger.warning
            self._native.narrowing_reported = True
            report(
                "%s; decoding %d sequence(s) at a time instead of %d, which is slower: lower "
                "n_seq_max to skip the failed attempt, or free memory",
                failure,
                self._width,
                first_width,
            )
        asked = sum(len(p.tokens) for p in prompts)
        stats.reused_tokens += max(0, asked - (stats.prompt_tokens - evaluated_before))
        return [
            out if out is not None else failed("not decoded", len(p.track))
            for out, p in zip(outputs, prompts, strict=True)
        ]

    # --- planning ---------------------------------------------------------------------------------

    def _checked(self, request: Request) -> _Prompt:
        tokens = [int(t) for t in request.tokens]
        n_ctx = self._settings.n_ctx
        if not tokens:
            raise ValueError("a prompt must hold at least one token (usually BOS)")
        if request.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {request.max_new_tokens}")
        if len(tokens) + request.max_new_tokens > n_ctx:
            raise ValueError(
                f"prompt ({len(tokens)} tokens) + max_new_tokens ({request.max_new_tokens}) "
                f"exceed n_ctx={n_ctx}: shorten the prompt or raise n_ctx"
            )
        return _Prompt(request, tokens, track_array(request.track_ids, self._native.n_vocab))

    def _sync(self) -> None:
        """Forget what the cache held if someone else emptied or used it since."""
        if self._epoch != self._native.epoch:
            self._forget()

    def _forget(self) -> None:
        if self._native.ctx is not None:
            self._native.clear()
        self._held.clear()
        self._epoch = self._native.epoch

    def _evict(self, seq: int) -> None:
        del self._held[seq]
        self._native.trim(seq, 0)

    def _victim(self, group_plan: Plan) -> int | None:
        """The held sequence to drop first: unused by the plan, not kept, oldest."""
        used = group_plan.claimed | group_plan.copied
        for tiers in ((False,), (True,)):
            for seq, held in self._held.items():
                if seq not in used and held.keep in tiers:
                    return seq
        return next(iter(self._held), None)  # even a used one: the plan changes, not the result

    def _prepare(self, group: list[int], prompts: list[_Prompt]) -> Plan:
        """Plan the group, make room for it, and make sure the context fits it."""
        native = self._native
        self._sync()
        if not self._settings.share_prefixes and self._held:
            self._forget()  # nothing held is of use, and it takes room
        tokens = [prompts[r].tokens for r in group]
        generating = {i for i, r in enumerate(group) if prompts[r].request.max_new_tokens > 1}
        capacity = native.n_seq_max
        while True:
            group_plan = plan(tokens, self._held, share=self._settings.share_prefixes)
            n_fresh = len(group) - len(group_plan.claimed)
            if len(self._held) + n_fresh > capacity:
                victim = self._victim(group_plan)
                assert victim is not None  # len(group) <= capacity
                self._evict(victim)
                continue
            free = [i for i in range(capacity) if i not in self._held]
            assign(group_plan, len(group), free, generating)
            cells, streams = self._needs(group_plan, group, prompts)
            if native.fits(cells, streams):
                return group_plan
            if self._held:
                # Dropping held sequences frees ids and cells; when the group alone does not
                # fit, the context is recreated below and the cache is lost anyway.
                alone = self._needs(group_plan, group, prompts, held=False)
                if native.fits(*alone) and len(self._held) > len(group_plan.claimed):
                    victim = self._victim(group_plan)
                    if victim is not None:
                        self._evict(victim)
                        continue
                self._forget()
                continue
            # Room for what the conversation's next call is likely to need: a little longer
            # sequences (a question after an answer) and one more (a copy).
            native.ensure(cells, streams, (cells + cells // 4, min(self._width, streams + 1)))
            self._epoch = native.epoch
            return group_plan

    def _needs(
        self, group_plan: Plan, group: list[int], prompts: list[_Prompt], held: bool = True
    ) -> tuple[int, int]:
        """KV cells (per stream when split) and sequence ids the group needs, with or without
        the held sequences.
        """
        native = self._native
        kept = list(self._held.values()) if held else []
        if native.kv_unified:
            new = sum(len(edge.tokens) for edge in group_plan.edges())
            generated = sum(prompts[r].request.max_new_tokens for r in group)
            return _distinct_cells([h.tokens for h in kept]) + new + generated, native.n_seq_max
        lengths = [len(prompts[r].tokens) + prompts[r].request.max_new_tokens for r in group]
        lengths += [len(h.tokens) for h in kept]
        if not held:
            return max(lengths), len(group)
        return max(lengths), max([*self._held, *group_plan.seq_of.values()]) + 1

    # --- execution --------------------------------------------------------------------------------

    def _execute(
        self,
        group_plan: Plan,
        group: list[int],
        prompts: list[_Prompt],
        outputs: list[SequenceOutput | None],
    ) -> None:
        """Evaluate the plan level by level, then generate for every prompt together."""
        slots = [
            Slot(
                index=r,
                seq_id=group_plan.seq_of[i],
                feed=[],
                pos=len(prompts[r].tokens),
                request=prompts[r].request,
                track=prompts[r].track,
            )
            for i, r in enumerate(group)
        ]
        for slot, evaluated in zip(slots, group_plan.evaluated(len(group)), strict=True):
            slot.prompt_tokens = evaluated
        try:
            self._start(group_plan, slots)
            for level in group_plan.waves():
                for edge, parent in level:
                    if parent is not None and edge.seq != parent.seq:
                        self._native.fork(parent.seq, edge.seq, edge.start)
                runs: list[Slot] = []
                for edge, _ in level:
                    if edge.request is None:  # shared by several prompts: evaluate only
                        runs.append(
                            Slot(index=-1, seq_id=edge.seq, feed=list(edge.tokens), pos=edge.start)
                        )
                    else:
                        slot = slots[edge.request]
                        slot.feed, slot.pos = list(edge.tokens), edge.start
                        runs.append(slot)
                self._run(runs, slots, prefill=True)
            self._run([s for s in slots if s.finish_reason is None], slots, prefill=False)
        finally:
            for slot in slots:
                if slot.finish_reason is not None:
                    outputs[slot.index] = output(slot)
        for slot in slots:
            if slot.seq_id < 0:
                continue  # its sequence was given to another (see _compact)
            p = prompts[slot.index]
            self._held.pop(slot.seq_id, None)
            self._held[slot.seq_id] = Held(
                tokens=[*p.tokens, *slot.tokens[: slot.fed]],
                logits=slot.logits,
                keep=p.request.keep,
            )

    def _start(self, group_plan: Plan, slots: list[Slot]) -> None:
        """Give each start the held prefix it continues; prompts held whole read their logits."""
        native = self._native
        cached = {
            s.request: self._held[s.source].logits
            for s in group_plan.starts
            if s.edge is None and s.request is not None and s.source is not None
        }
        # Copies before continuations in place: a copy may need what a trim drops.
        for start in group_plan.starts:
            if start.source is None or start.takeover:
                continue
            if start.edge is not None:
                native.fork(start.source, start.edge.seq, start.length)
            else:
                assert start.request is not None  # a prompt held whole
                native.fork(start.source, slots[start.request].seq_id, start.length)
        for start in group_plan.starts:
            if start.takeover and start.source is not None:
                native.trim(start.source, start.length)
            elif start.source is None and start.edge is not None:
                native.trim(start.edge.seq, 0)
        for seq in group_plan.claimed:
            del self._held[seq]  # continued in place: they become the group's sequences
        for i, logits in cached.items():
            if slots[i].max_new == 0:
                slots[i].finish_reason = "length"
            else:
                assert logits is not None
                greedy_step(slots[i], logits, native.is_eog)
                native.stats.generated_tokens += 1

    def _run(self, slots: list[Slot], group: list[Slot], prefill: bool) -> None:
        """Decode ``slots`` in as few ``llama_decode`` calls as the batch size allows.

        ``prefill``: evaluate each slot's feed and read a prompt's first token, then stop;
        otherwise generate to the end. A slot with ``max_new == 0`` only evaluates its feed.
        """
        native = self._native
        stats = native.stats
        n_batch = native.n_batch
        while True:
            live = sorted(
                (s for s in slots if s.finish_reason is None and not (prefill and s.tokens)),
                key=lambda s: s.seq_id,
            )
            if not live:
                return
            if not native.kv_unified:
                live = _as_deep(live) if prefill else self._compact(live, group)
            entries: list[Entry] = []
            readers: list[tuple[Slot, int]] = []
            prompt_tokens = fed_tokens = 0
            for slot in live:
                room = n_batch - len(entries)
                if room <= 0:
                    break
                n = len(slot.feed)
                if prefill and not native.kv_unified:
                    # Cut at the next multiple of KV_PADDING when both parts are worth a pass.
                    head = KV_PADDING - slot.pos % KV_PADDING
                    n = head if min(head, n - head) >= MIN_SPLIT_TOKENS else n
                if not native.kv_unified and entries and n > room:
                    # llama.cpp cuts a split-cache batch into micro-batches with as many tokens
                    # from each stream: a run's last few tokens would make one tiny pass.
                    continue
                take = slot.feed[: min(n, room)]
                del slot.feed[: len(take)]
                if slot.tokens:
                    fed_tokens += len(take)
                    slot.fed += len(take)
                else:
                    prompt_tokens += len(take)
                for j, token in enumerate(take):
                    want = not slot.feed and j == len(take) - 1 and slot.max_new > 0
                    if want:
                        readers.append((slot, len(entries)))
                    entries.append((token, slot.pos, slot.seq_id, want))
                    slot.pos += 1
                if not slot.feed and slot.max_new == 0:
                    slot.finish_reason = "length"
            native.decode(entries)
            stats.prompt_tokens += prompt_tokens
            stats.fed_tokens += fed_tokens
            if prompt_tokens == 0:  # a generation step: every slot read one new token
                stats.steps += 1
            for slot, row in readers:
                greedy_step(slot, native.logits(row), native.is_eog)
                stats.generated_tokens += 1

    def _compact(self, live: list[Slot], group: list[Slot]) -> list[Slot]:
        """Move generating sequences into gaps so that their ids are consecutive (split cache).

        A sequence of the group that finished sits in a gap: it is dropped from the cache
        (a later prompt that needs its text evaluates it again) unless it was asked to be kept.
        """
        first = live[0].seq_id
        ids = {s.seq_id for s in live}
        gaps = [x for x in range(first, first + len(live)) if x not in ids]
        movers = [s for s in reversed(live) if s.seq_id >= first + len(live)]
        moved = False
        for gap, slot in zip(gaps, movers, strict=False):
            if slot.max_new - len(slot.tokens) < MIN_STEPS_TO_MOVE:
                break
            occupant = next((s for s in group if s.seq_id == gap and s is not slot), None)
            held = self._held.get(gap)
            # A sequence asked to be kept is never overwritten.
            if (occupant is not None and occupant.request.keep) or (held is not None and held.keep):
                break
            if occupant is not None:
                occupant.seq_id = -1
            self._held.pop(gap, None)
            self._native.fork(slot.seq_id, gap, slot.pos)
            self._native.trim(slot.seq_id, 0)
            slot.seq_id = gap
            moved = True
        return sorted(live, key=lambda s: s.seq_id) if moved else live


def _as_deep(live: list[Slot]) -> list[Slot]:
    """The prompt runs to evaluate next on a split cache (see :data:`DEPTH_RATIO`)."""
    deepest = max(s.pos + len(s.feed) for s in live)
    deep = [s for s in live if (s.pos + len(s.feed)) * DEPTH_RATIO >= deepest]
    n_deep = sum(len(s.feed) for s in deep)
    n_all = sum(len(s.feed) for s in live)
    # Both decodes must be worth a pass over the weights.
    return deep if min(n_deep, n_all - n_deep) >= MIN_SPLIT_TOKENS else live


def _distinct_cells(sequences: list[list[int]]) -> int:
    """Cells a unified KV cache uses for ``sequences``: their distinct prefixes (sequences made
    by copying share the cells of their common prefix), plus a little for the few tokens that
    prompts evaluate each for themselves (see :data:`~.plan.MIN_SHARED_TOKENS`).
    """
    ordered = sorted(sequences)
    cells = sum(len(s) for s in ordered)
    for previous, current in pairwise(ordered):
        same = [*(a == b for a, b in zip(previous, current, strict=False)), False]
        cells -= same.index(False)  # the length of their common prefix
    return cells + MIN_SHARED_TOKENS * len(sequences)


def _chunks(indices: list[int], size: int) -> deque[list[int]]:
    """``indices`` cut into consecutive groups of at most ``size``."""
    return deque(indices[start : start + size] for start in range(0, len(indices), size))
