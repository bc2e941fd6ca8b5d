"""The reflection-token critic: Self-RAG GGUFs on llama.cpp, scored from their own logits.

A Self-RAG model critiques itself: after ``[Retrieval]<paragraph>...</paragraph>`` it writes
``[Relevant]``/``[Irrelevant]``, the answer, a grounding token and a ``[Utility:k]`` token. This
critic reads the probabilities of those tokens straight from the logits of one batched llama.cpp
pass over all paragraphs (:class:`~llama_index.packs.self_rag_rse.llamacpp.decoder.BatchedDecoder`)
and turns them into scores with the pure functions of
:mod:`llama_index.packs.self_rag_rse.critic.reflection`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from llama_index.core.instrumentation import get_dispatcher
from numpy.typing import NDArray

from llama_index.packs.self_rag_rse.common.options import require_counts
from llama_index.packs.self_rag_rse.critic.contract import (
    BaseCritic,
    Continuation,
    ParagraphJudgement,
    RetrievalDecision,
)
from llama_index.packs.self_rag_rse.critic.reflection import (
    NO_RETRIEVAL,
    PARAGRAPH_CLOSE,
    PARAGRAPH_OPEN,
    PROMPT_TEMPLATE,
    REFLECTION_TOKENS,
    RETRIEVAL,
    SELF_RAG_SPECIAL_TOKENS,
    MissingReflectionTokens,
    retrieval_probability,
    score_generation,
)
from llama_index.packs.self_rag_rse.llamacpp import compat
from llama_index.packs.self_rag_rse.llamacpp.context import DecodeError
from llama_index.packs.self_rag_rse.llamacpp.conversation import Conversation
from llama_index.packs.self_rag_rse.llamacpp.sequences import Request, SequenceOutput, failed
from llama_index.packs.self_rag_rse.llamacpp.worker import DecoderWorker, TextStream

if TYPE_CHECKING:
    import llama_cpp

logger = logging.getLogger(__name__)
dispatcher = get_dispatcher(__name__)


class ReflectionCritic(BaseCritic):
    """The critic for Self-RAG GGUFs (reflection tokens in the vocabulary) on llama.cpp.

    Args:
        llm: a ``llama_cpp.Llama`` (or a ``LlamaCPP``) holding a Self-RAG model (e.g.
            ``selfrag_llama2_7b``). Its weights are shared with a second, multi-sequence context.
        max_new_tokens: tokens generated per answer. 50, like LlamaIndex's Self-RAG pack: the
            grounding and utility tokens come *after* the answer, so a short budget (Self-RAG's
            short-form scripts use 15) cuts them off and IsSUP/IsUSE fall to 0.
        n_seq_max: paragraphs decoded together; more are processed in chunks after one shared
            evaluation of the instruction. 10 matches Self-RAG's default ``ndocs``.
        n_ctx: maximum tokens of one prompt + paragraph + answer; longer paragraphs are truncated
            with a warning. Defaults to ``llm.n_ctx()``.
        n_threads: CPU threads for decoding; defaults to the ``Llama``'s ``n_threads_batch``
            (see the decoder: its steps are batches of all paragraphs).
        kv_unified, flash_attn: KV-cache layout and attention kernel of the batched context, see
            :class:`~llama_index.packs.self_rag_rse.llamacpp.decoder.BatchedDecoder` (defaults:
            flash attention as the ``Llama`` has it; a shared cache on GPU or with flash
            attention, one stream per paragraph on CPU otherwise).

    Raises:
        MissingReflectionTokens: (a ``ValueError``) when the model's vocabulary lacks a reflection
            token (not a Self-RAG model).

    Decoding runs on one worker thread, in order; the blocking methods wait for it.
    """

    name = "reflection"

    def __init__(
        self,
        llm: Any,
        *,
        max_new_tokens: int = 50,
        n_seq_max: int = 10,
        n_ctx: int | None = None,
        n_threads: int | None = None,
        kv_unified: bool | None = None,
        flash_attn: bool | None = None,
    ) -> None:
        require_counts("ReflectionCritic", max_new_tokens=max_new_tokens, n_seq_max=n_seq_max)
        llm = compat.llama_of(llm, "ReflectionCritic")
        if compat.is_closed(llm):
            raise compat.ModelClosedError()
        self.llm: llama_cpp.Llama = llm
        self.max_new_tokens = max_new_tokens
        #: Id of every Self-RAG special string (13 reflection tokens + 2 paragraph markers).
        self.token_ids: dict[str, int] = reflection_token_ids(llm)
        self._reflection_ids = [self.token_ids[t] for t in REFLECTION_TOKENS]
        self._special_ids = frozenset(self.token_ids.values())
        self._worker = DecoderWorker(
            llm,
            "self-rag-critic",
            n_seq_max=n_seq_max,
            n_ctx=n_ctx,
            n_threads=n_threads,
            kv_unified=kv_unified,
            flash_attn=flash_attn,
        )
        self.decoder = self._worker.decoder

    # --- the critic contract ----------------------------------------------------------------------

    def _decide_retrieval(
        self, query: str, threshold: float | None, answer_if_skipped: bool = True
    ) -> RetrievalDecision:
        """Self-RAG's adaptive-retrieval gate, from one evaluation of the prompt.

        With a ``threshold``, retrieve when p([Retrieval]) / (p([Retrieval]) + p([No Retrieval]))
        at the first position exceeds it (0.0 retrieves always, 1.0 never); otherwise, if
        ``answer_if_skipped``, the answer is generated after ``[No Retrieval]`` from the same KV
        cache. With ``threshold=None`` the model decides greedily: retrieve when it generates
        ``[Retrieval]`` (generation stops there); when it does not, the answer is generated
        after ``[No Retrieval]``, as in threshold mode and the official code.
        """
        prompt = self._prompt(query)
        retrieval_id = self.token_ids[RETRIEVAL]
        track = self._reflection_ids
        # One conversation: the answer after [No Retrieval] continues the prompt the gate read.
        with self.decoder.conversation() as conversation:
            if threshold is None:
                request = Request(
                    prompt,
                    max_new_tokens=self.max_new_tokens,
                    track_ids=track,
                    stop_ids=[retrieval_id],
                )
            else:
                # One token's log-probs; the prompt kept for the answer after [No Retrieval].
                request = Request(prompt, max_new_tokens=1, track_ids=track, keep=True)
            out = _decoded(conversation, request)
            probability = retrieval_probability(out.tracked_logprobs)
            retrieve = retrieval_id in out.tokens if threshold is None else probability > threshold
            answer = None
            if not retrieve and answer_if_skipped:
                out = _decoded(conversation, self._answer_request(prompt))
                answer = self._answer_text(out.tokens)
        logger.debug(
            "retrieval gate: p=%.4f threshold=%s retrieve=%s", probability, threshold, retrieve
        )
        return RetrievalDecision(retrieve=retrieve, probability=probability, answer=answer)

    def _judge(self, query: str, paragraphs: Sequence[str]) -> list[ParagraphJudgement]:
        """Answer from every paragraph in one batched pass and score each answer.

        The prompt is ``### Instruction:\\n{query}\\n\\n### Response:\\n[Retrieval]<paragraph>``,
        shared by all paragraphs and evaluated once; each paragraph's text (with its optional
        title line) and ``</paragraph>`` follow in its own sequence. Judgements come back in input
        order; a paragraph whose decoding failed has ``error`` set and scores 0.
        """
        if not paragraphs:
            return []
        prefix = [*self._prompt(query), self.token_ids[RETRIEVAL], self.token_ids[PARAGRAPH_OPEN]]
        suffixes = [self._user_tokens(text, add_bos=False) for text in paragraphs]
        outputs = self.decoder.generate(
            prefix,
            suffixes,
            max_new_tokens=self.max_new_tokens,
            track_ids=self._reflection_ids,
            suffix_tail=[self.token_ids[PARAGRAPH_CLOSE]],
        )
        return [self._judgement(out) for out in outputs]

    def _judgement(self, out: SequenceOutput) -> ParagraphJudgement:
        """The answer ``out`` generated after a paragraph, scored (zeros and ``error`` when its
        decoding failed).
        """
        if out.error is not None:
            return ParagraphJudgement(
                answer="", relevance=0.0, support=0.0, utility=0.0, error=out.error
            )
        scores = score_generation(
            out.tracked_logprobs,
            generated=out.tokens,
            token_logprobs=out.token_logprobs,
            column_ids=self._reflection_ids,
        )
        return ParagraphJudgement(
            answer=self._answer_text(out.tokens),
            relevance=scores.relevance,
            support=scores.support,
            utility=scores.utility,
            seq_score=scores.seq_score,
            # The paragraph's tokens left out to fit n_ctx, shown in its row.
            details={"passage_cut": out.truncated} if out.truncated else {},
        )

    def _generate(self, query: str, on_text: Callable[[str], None] | None = None) -> str:
        """Answer with no evidence: greedy continuation after ``[No Retrieval]`` (``on_text``
        gets the answer so far after every token).
        """
        request = self._answer_request(self._prompt(query))
        if on_text is not None:
            text = TextStream(self.llm, self._answer_filter())
            request.on_token = lambda token: on_text(text.feed(token))
        with self.decoder.conversation() as conversation:
            out = _decoded(conversation, request)
        return self._answer_text(out.tokens)

    def _answer_request(self, prompt: list[int]) -> Request:
        """The answer with no evidence: greedy continuation after ``[No Retrieval]``."""
        return Request([*prompt, self.token_ids[NO_RETRIEVAL]], max_new_tokens=self.max_new_tokens)

    @dispatcher.span
    async def adecide_retrieval(
        self, query: str, threshold: float | None, answer_if_skipped: bool = True
    ) -> RetrievalDecision:
        """Self-RAG's adaptive-retrieval gate (see :meth:`_decide_retrieval`)."""
        return await self._worker.run(self._decide_retrieval, query, threshold, answer_if_skipped)

    @dispatcher.span
    async def ajudge(self, query: str, paragraphs: Sequence[str]) -> list[ParagraphJudgement]:
        """Answer from every paragraph in one batched pass and score each answer."""
        return await self._worker.run(self._judge, query, paragraphs)

    @dispatcher.span
    async def agenerate(self, query: str) -> str:
        """Answer with no evidence: greedy continuation after ``[No Retrieval]``."""
        return await self._worker.run(self._generate, query)

    async def astream_generate(self, query: str) -> AsyncIterator[str]:
        """The no-evidence answer, token by token as llama.cpp writes it."""
        async for piece in self._worker.stream(self._generate, query):
            yield piece

    # --- long form --------------------------------------------------------------------------------

    writes_segments = True

    async def astart_path(self, query: str) -> tuple[int, ...]:
        """The prompt's tokens: where every long-form path starts (tokenized on the worker,
        which checks the model is open and holds it so: a closed model's vocabulary crashes).
        """
        return tuple(await self._worker.run(self._prompt, query))

    @dispatcher.span
    async def awrite_segments(
        self, branches: Sequence[tuple[tuple[int, ...], str]], boundary_threshold: float | None
    ) -> list[Continuation]:
        """One segment per ``(context, paragraph)``, all decoded side by side in one batched
        call; contexts and passages shared by several branches are evaluated once.
        """
        return await self._worker.run(self._write_segments, branches, boundary_threshold)

    def _write_segments(
        self, branches: Sequence[tuple[tuple[int, ...], str]], boundary_threshold: float | None
    ) -> list[Continuation]:
        if not branches:
            return []
        ids = self.token_ids
        stop_if = None
        if boundary_threshold is not None:
            threshold = boundary_threshold  # a float here, for the closure
            no_retrieval = ids[NO_RETRIEVAL]

            def stop_if(token: int, tracked: NDArray[np.float64]) -> bool:
                return token == no_retrieval and retrieval_probability(tracked) > threshold

        requests: list[Request | None] = []
        for context, paragraph in branches:
            room = self.decoder.n_ctx - len(context) - 3 - self.max_new_tokens
            evidence = self._user_tokens(paragraph, add_bos=False)
            if room < 1:
                requests.append(None)
                continue
            if len(evidence) > room:
                logger.warning(
                    "long form: a passage of %d tokens cut to %d to fit n_ctx=%d (raise n_ctx "
                    "to keep whole passages)",
                    len(evidence),
                    room,
                    self.decoder.n_ctx,
                )
            tokens = [*context, ids[RETRIEVAL], ids[PARAGRAPH_OPEN], *evidence[:room]]
            requests.append(
                Request(
                    [*tokens, ids[PARAGRAPH_CLOSE]],
                    max_new_tokens=self.max_new_tokens,
                    track_ids=self._reflection_ids,
                    stop_ids=[ids[RETRIEVAL]],
                    truncated=max(0, len(evidence) - room),
                    stop_if=stop_if,
                )
            )
        # The KV cache carries over from the last depth: a path's context was read there.
        with self.decoder.conversation(carry_over=True) as conversation:
            decoded = iter(conversation.run([r for r in requests if r is not None]))
        # None for a branch with no room: it was not decoded.
        outputs = [next(decoded) if request is not None else None for request in requests]
        return [
            self._continuation(context, out)
            for (context, _), out in zip(branches, outputs, strict=True)
        ]

    def _continuation(self, context: tuple[int, ...], out: SequenceOutput | None) -> Continuation:
        """The segment ``out`` generated after ``context`` and a passage, scored."""
        if out is None:  # the branch was not decoded
            out = failed(
                f"the path's context ({len(context)} tokens) leaves no room for a passage "
                f"and {self.max_new_tokens} new tokens in n_ctx={self.decoder.n_ctx}: raise "
                "n_ctx, or lower max_segments or max_new_tokens",
                n_tracked=len(self._reflection_ids),
            )
        if out.error is not None:
            return Continuation(
                answer="",
                relevance=0.0,
                support=0.0,
                utility=0.0,
                seq_score=0.0,
                error=out.error,
                context=context,
                stop="error",
            )
        tokens = list(out.tokens)
        stop = "length"
        if out.finish_reason == "stop":
            boundary = tokens.pop() in (self.token_ids[RETRIEVAL], self.token_ids[NO_RETRIEVAL])
            stop = "boundary" if boundary else "eos"
        scores = score_generation(
            out.tracked_logprobs,
            generated=tokens,
            token_logprobs=out.token_logprobs[: len(tokens)],
            column_ids=self._reflection_ids,
        )
        return Continuation(
            answer=" ".join(self._answer_text(tokens).split()),
            relevance=scores.relevance,
            support=scores.support,
            utility=scores.utility,
            seq_score=scores.seq_score,
            # The passage's tokens left out to fit n_ctx, shown in the segment's row.
            details={"passage_cut": out.truncated} if out.truncated else {},
            tokens=tokens,
            context=(*context, *tokens),
            stop=stop,
        )

    def close(self) -> None:
        """Wait for running work, then free the critic's llama.cpp context (the ``Llama``
        itself stays open).
        """
        self._worker.close()

    # --- tokens -----------------------------------------------------------------------------------

    def _prompt(self, query: str) -> list[int]:
        return self._user_tokens(PROMPT_TEMPLATE.format(query=query), add_bos=True)

    def _user_tokens(self, text: str, add_bos: bool) -> list[int]:
        """Tokenize user text so it cannot smuggle in reflection tokens.

        ``special=False`` keeps CONTROL-typed tokens out, but llama.cpp still matches
        USER_DEFINED tokens in plain text, so a document quoting ``[Fully supported]`` would
        otherwise steer the critic: such ids are dropped.
        """
        tokens = self.llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=False)
        clean = [t for t in tokens if t not in self._special_ids]
        if len(clean) != len(tokens):
            logger.warning(
                "dropped %d Self-RAG special token(s) found in user text", len(tokens) - len(clean)
            )
        return clean

    def _answer_text(self, tokens: Sequence[int]) -> str:
        """Detokenize an answer without reflection tokens, end markers or generated evidence."""
        kept = list(filter(self._answer_filter(), tokens))
        return self.llm.detokenize(kept).decode("utf-8", errors="ignore").strip()

    def _answer_filter(self) -> Callable[[int], bool]:
        """Whether each generated token, asked in order, is part of the answer: no reflection
        token, no end of generation, nothing between ``<paragraph>`` and ``</paragraph>`` (the
        model quoting evidence is not part of its answer).
        """
        opening = self.token_ids[PARAGRAPH_OPEN]
        closing = self.token_ids[PARAGRAPH_CLOSE]
        quoting = False

        def keep(token: int) -> bool:
            nonlocal quoting
            if token in (opening, closing):
                quoting = token == opening
                return False
            return not quoting and token not in self._special_ids and not self.decoder.is_eog(token)

        return keep


def _decoded(conversation: Conversation, request: Request) -> SequenceOutput:
    """The one output of ``request``; raises :class:`~.context.DecodeError` when it failed."""
    (out,) = conversation.run([request])
    if out.error is not None:
        raise DecodeError(out.error)
    return out


def reflection_token_ids(llm: llama_cpp.Llama) -> dict[str, int]:
    """Map every Self-RAG special string to its single token id, or explain what is missing."""
    ids: dict[str, int] = {}
    missing: list[str] = []
    for text in SELF_RAG_SPECIAL_TOKENS:
        tokens = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        if len(tokens) == 1:
            ids[text] = int(tokens[0])
        else:
            missing.append(text)
    if missing:
        raise MissingReflectionTokens(missing, sorted(ids))
    return ids
