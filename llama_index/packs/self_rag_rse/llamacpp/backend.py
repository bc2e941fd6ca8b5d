"""The critic backend on in-process llama.cpp: batched decodes, exact label probabilities.

Every call is one :class:`~.conversation.Conversation` on a :class:`~.decoder.BatchedDecoder`:
all prompts are decoded together, and what they share is evaluated once (the system prompt and
the question for all of them, a paragraph for its answer and its relevance). A whole paragraph
judgement (:meth:`LlamaCppBackend.judge_paragraphs`) keeps its sequences in the KV cache from the
first round to the second, so support and utility evaluate only what follows the paragraph (the
answer and the question): each paragraph is read once for all four questions. Label
probabilities are the exact next-token log-probs of each label's first tokens under the
full-vocabulary softmax, and scores are expectations under them, like the paper's.

All decoding runs on one worker thread per backend, in order (see
:class:`~llama_index.packs.self_rag_rse.common.bridge.SerialWorker`).
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from llama_index.core.prompts import BasePromptTemplate

from llama_index.packs.self_rag_rse.common.options import require_counts
from llama_index.packs.self_rag_rse.critic.backend import (
    CriticBackend,
    FirstRound,
    Generated,
    JudgementPrompts,
    ParagraphResult,
    Scored,
    Values,
    prompt_values,
)
from llama_index.packs.self_rag_rse.critic.labels import (
    RELEVANCE_SCALE,
    SUPPORT_SCALE,
    UTILITY_SCALE,
    LabelScale,
)
from llama_index.packs.self_rag_rse.critic.reflection import logsumexp, sequence_score
from llama_index.packs.self_rag_rse.llamacpp import compat
from llama_index.packs.self_rag_rse.llamacpp.conversation import Conversation
from llama_index.packs.self_rag_rse.llamacpp.prompt_tokens import PromptTokenizer
from llama_index.packs.self_rag_rse.llamacpp.sequences import Request, SequenceOutput
from llama_index.packs.self_rag_rse.llamacpp.worker import DecoderWorker, TextStream

if TYPE_CHECKING:
    import llama_cpp

T = TypeVar("T")


class LlamaCppBackend(CriticBackend):
    """:class:`~llama_index.packs.self_rag_rse.critic.backend.CriticBackend` on llama.cpp.

    Args:
        model: a ``LlamaCPP`` (its prompt formatting and system prompt are used) or a loaded
            ``llama_cpp.Llama``; the weights are shared with a second, multi-sequence context.
            The backend never closes the model.
        max_new_tokens: answer length cap.
        n_seq_max: sequences decoded together; a judgement takes two per paragraph, so
            ``n_seq_max // 2`` paragraphs are judged at a time.
        n_ctx: positions per sequence (default: the model's ``n_ctx``); longer paragraphs are
            shortened from their end with a warning.
        n_threads: CPU threads for decoding (default: the model's ``n_threads_batch``, see
            :class:`~.decoder.BatchedDecoder`).
        share_prefixes: evaluate what prompts share once and carry the KV cache between the
            rounds of a judgement (default); ``False`` decodes every prompt whole, for checks.

    Example::

        critic = PromptedCritic(LlamaCppBackend(LlamaCPP(model_path="model.gguf")))
    """

    def __init__(
        self,
        model: Any,
        *,
        max_new_tokens: int = 64,
        n_seq_max: int = 8,
        n_ctx: int | None = None,
        n_threads: int | None = None,
        share_prefixes: bool = True,
    ) -> None:
        require_counts("LlamaCppBackend", max_new_tokens=max_new_tokens, n_seq_max=n_seq_max)
        self.llama: llama_cpp.Llama = compat.llama_of(model, "LlamaCppBackend")
        self.max_new_tokens = max_new_tokens
        self._worker = DecoderWorker(
            self.llama,
            "llama-cpp-critic",
            n_seq_max=n_seq_max,
            n_ctx=n_ctx,
            n_threads=n_threads,
            share_prefixes=share_prefixes,
        )
        self.decoder = self._worker.decoder
        self.tokenizer = PromptTokenizer(self.llama, model, self.decoder.n_ctx)
        self.prompt_format = self.tokenizer.prompt_format

    # --- CriticBackend -------------------------------------------------------------------------

    async def generate(
        self, template: BasePromptTemplate, values: Sequence[Values]
    ) -> list[Generated | Exception]:
        """Greedy answers for every prompt from one multi-sequence decode."""
        return await self._decode(self._answers, template, values)

    async def score(
        self, scale: LabelScale, template: BasePromptTemplate, values: Sequence[Values]
    ) -> list[Scored | Exception]:
        """Label probabilities of every prompt from one multi-sequence decode (1 new token)."""
        return await self._decode(self._labels, scale, template, values)

    async def generate_and_score(
        self,
        answer_template: BasePromptTemplate,
        scale: LabelScale,
        label_template: BasePromptTemplate,
        values: Sequence[Values],
    ) -> tuple[list[Generated | Exception], list[Scored | Exception]]:
        """Answers and labels from one decode, what their prompts share evaluated once.

        The two prompts usually agree up to the end of the paragraph (question, then paragraph,
        then the instruction): that part is evaluated once per paragraph and continued by each
        instruction. Prompts that agree less share less; nothing else changes.
        """
        return await self._decode(self._first_round, answer_template, scale, label_template, values)

    async def judge_paragraphs(
        self,
        query: str,
        paragraphs: Sequence[str],
        prompts: JudgementPrompts,
        generator: CriticBackend | None = None,
    ) -> list[ParagraphResult]:
        """The four questions of every paragraph, each paragraph evaluated once (see the
        module); answers written by another ``generator`` take the contract's two rounds.

        One conversation: per group of ``n_seq_max // 2`` paragraphs, the answers with the
        relevance labels, then the support and utility labels, whose prompts continue the
        first round's sequences where their tokens agree (the default prompts: everything up
        to the end of the paragraph). Templates that agree less are evaluated further, as
        separate decodes would; the results are the same either way.
        """
        if generator is not None and generator is not self:
            return await super().judge_paragraphs(query, paragraphs, prompts, generator)
        return await self._decode(self._judge, query, paragraphs, prompts)

    async def astream(self, template: BasePromptTemplate, values: Values) -> AsyncIterator[str]:
        """One greedy answer, token by token as llama.cpp writes it."""
        async for piece in self._worker.stream(self._conversing, self._stream, template, values):
            yield piece

    def close(self) -> None:
        """Wait for running work, then free the decoder's context (the model stays open)."""
        self._worker.close()

    # --- on the worker thread, in one conversation ------------------------------------------------

    async def _decode(self, func: Callable[..., T], /, *args: Any) -> T:
        """``func(conversation, *args)`` on the worker thread."""
        return await self._worker.run(self._conversing, func, *args)

    def _conversing(self, func: Callable[..., T], /, *args: Any) -> T:
        with self.decoder.conversation() as conversation:
            return func(conversation, *args)

    def _answers(
        self, conversation: Conversation, template: BasePromptTemplate, values: Sequence[Values]
    ) -> list[Generated | Exception]:
        outputs = conversation.run(self._answer_requests(template, values))
        return [self._generated(out) for out in outputs]

    def _labels(
        self,
        conversation: Conversation,
        scale: LabelScale,
        template: BasePromptTemplate,
        values: Sequence[Values],
    ) -> list[Scored | Exception]:
        outputs = conversation.run(self._label_requests(scale, template, values))
        return [self._scored(out, scale) for out in outputs]

    def _stream(
        self,
        conversation: Conversation,
        template: BasePromptTemplate,
        values: Values,
        on_text: Callable[[str], None],
    ) -> str:
        (request,) = self._answer_requests(template, [values])
        text = TextStream(self.llama, lambda token: not self.decoder.is_eog(token))
        request.on_token = lambda token: on_text(text.feed(token))
        (out,) = conversation.run([request])
        result = self._generated(out)
        if isinstance(result, Exception):
            raise result
        return result.text

    def _judge(
        self,
        conversation: Conversation,
        query: str,
        paragraphs: Sequence[str],
        prompts: JudgementPrompts,
    ) -> list[ParagraphResult]:
        results: list[ParagraphResult] = []
        width = max(1, self.decoder.n_seq_max // 2)
        for start in range(0, len(paragraphs), width):
            group = paragraphs[start : start + width]
            values = [prompt_values(query, text) for text in group]
            answers, relevance = self._first_round(
                conversation, prompts.answer, RELEVANCE_SCALE, prompts.relevance, values
            )
            first = FirstRound.of(answers, relevance)
            support = self._label_requests(
                SUPPORT_SCALE, prompts.support, first.support_values(query, group)
            )
            utility = self._label_requests(
                UTILITY_SCALE, prompts.utility, first.utility_values(query)
            )
            outputs = conversation.run([*support, *utility])  # nothing to do when empty
            n = len(first.answered)
            results += first.record(
                [self._scored(out, SUPPORT_SCALE) for out in outputs[:n]],
                [self._scored(out, UTILITY_SCALE) for out in outputs[n:]],
            )
        return results

    def _first_round(
        self,
        conversation: Conversation,
        answer_template: BasePromptTemplate,
        scale: LabelScale,
        label_template: BasePromptTemplate,
        values: Sequence[Values],
    ) -> tuple[list[Generated | Exception], list[Scored | Exception]]:
        """Answers and labels of the same values, decoded together."""
        answers = self._answer_requests(answer_template, values)
        outputs = conversation.run([*answers, *self._label_requests(scale, label_template, values)])
        return (
            [self._generated(out) for out in outputs[: len(answers)]],
            [self._scored(out, scale) for out in outputs[len(answers) :]],
        )

    def _answer_requests(
        self, template: BasePromptTemplate, values: Sequence[Values]
    ) -> list[Request]:
        n = self.max_new_tokens
        fits = [self.tokenizer.fitted(template, dict(v), n) for v in values]
        return [Request(tokens, max_new_tokens=n, truncated=cut) for tokens, cut in fits]

    def _label_requests(
        self, scale: LabelScale, template: BasePromptTemplate, values: Sequence[Values]
    ) -> list[Request]:
        lead, groups = self.tokenizer.label_ids(scale)
        track = [t for group in groups for t in group]
        # Room for the lead tokens and the one label position read after them.
        fits = [self.tokenizer.fitted(template, dict(v), 1 + len(lead)) for v in values]
        return [Request(tokens + lead, max_new_tokens=1, track_ids=track) for tokens, _ in fits]

    def _generated(self, out: SequenceOutput) -> Generated | Exception:
        if out.error is not None:
            return RuntimeError(out.error)
        return Generated(
            text=self._text(out.tokens),
            seq_score=sequence_score(out.token_logprobs),
            generated_tokens=len(out.tokens),
            passage_cut=out.truncated,
        )

    def _text(self, tokens: Sequence[int]) -> str:
        kept = [t for t in tokens if not self.decoder.is_eog(t)]
        return self.llama.detokenize(kept).decode("utf-8", errors="ignore").strip()

    def _scored(self, out: SequenceOutput, scale: LabelScale) -> Scored | Exception:
        if out.error is not None or len(out.tracked_logprobs) == 0:
            return RuntimeError(out.error or "no logits")
        _, groups = self.tokenizer.label_ids(scale)
        label_lps = group_logprobs(out.tracked_logprobs[0], groups)
        return Scored(score=scale.expected_value(label_lps), method="logprobs", generated_tokens=1)


def group_logprobs(row: Sequence[float] | Any, groups: Sequence[Sequence[int]]) -> list[float]:
    """Per-label log-prob: log Σ p over the label's first-token ids (columns in group order)."""
    values = iter([float(v) for v in row])
    return [logsumexp(itertools.islice(values, len(group))) for group in groups]
