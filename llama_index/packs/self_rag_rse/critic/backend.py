"""The contract between a critic and the model it questions.

A critic needs two things from a model: *continue these k prompts* (the answers) and *report the
probabilities of these label groups at the next position* (Yes/No, Yes/Partly/No, 1..5). A
:class:`CriticBackend` does both for a batch of prompts built from one template, and the whole
judgement of k paragraphs (:meth:`CriticBackend.judge_paragraphs`: answer, relevance, support,
utility) as one call that a backend may do in fewer steps, so a critic never asks which model it
has: in-process llama.cpp
(:class:`~llama_index.packs.self_rag_rse.llamacpp.backend.LlamaCppBackend`, one batched decode,
exact label probabilities) and any LlamaIndex LLM
(:class:`~llama_index.packs.self_rag_rse.critic.llm_backend.LLMBackend`, concurrent calls,
log-probs when returned, tolerant reply parsing otherwise) implement it, and a served model is a
third implementation.

Results are per prompt and in input order; a prompt that failed comes back as the exception, so
one failure never sinks the others.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from llama_index.core.prompts import BasePromptTemplate

from llama_index.packs.self_rag_rse.critic.labels import (
    RELEVANCE_SCALE,
    SUPPORT_SCALE,
    UTILITY_SCALE,
    LabelScale,
)

#: One prompt's template variables (``query_str``, ``context_str``, ``answer_str``).
Values = Mapping[str, Any]


@dataclass
class Scored:
    """One label judgement: ``score`` on the scale's range and how it was obtained.

    ``method`` is ``"logprobs"`` (label probabilities), ``"parsed"`` (label read from a reply)
    or ``"fallback"`` (unreadable reply, the scale's neutral score; ``note`` says why).
    ``generated_tokens`` counts the tokens the model produced for it, when known.
    """

    score: float
    method: str
    note: str | None = None
    generated_tokens: int | None = None


@dataclass
class Generated:
    """One generated answer; ``seq_score`` is exp(mean token log-prob) when log-probs exist;
    ``passage_cut``: the paragraph's tokens left out to fit the context.
    """

    text: str
    seq_score: float | None = None
    generated_tokens: int | None = None
    passage_cut: int = 0


@dataclass(frozen=True)
class JudgementPrompts:
    """The templates of a paragraph judgement: the answer from the paragraph, then whether the
    paragraph is relevant (Yes/No), supports the answer (Yes/Partly/No) and how useful the
    answer is (1-5).
    """

    answer: BasePromptTemplate
    relevance: BasePromptTemplate
    support: BasePromptTemplate
    utility: BasePromptTemplate


@dataclass
class ParagraphResult:
    """What a judgement found for one paragraph: the answer and the ``relevance``, ``support``
    and ``utility`` scores (support and utility are missing when there was no answer); a part
    that failed is the exception.
    """

    answer: Generated | Exception
    scores: dict[str, Scored | Exception] = field(default_factory=dict)


def prompt_values(query: str, paragraph: str | None = None, answer: str | None = None) -> Values:
    """Template variables for one prompt (a missing part is left out, not filled with "")."""
    values = {"query_str": query}
    if paragraph is not None:
        values["context_str"] = paragraph
    if answer is not None:
        values["answer_str"] = answer
    return values


@dataclass
class FirstRound:
    """A judgement after its first round (answers and relevance), and what the second asks.

    ``answered`` lists ``(index, answer text)`` of the paragraphs that got an answer: only they
    are asked about support and utility.
    """

    results: list[ParagraphResult]
    answered: list[tuple[int, str]]

    @classmethod
    def of(
        cls, answers: Sequence[Generated | Exception], relevance: Sequence[Scored | Exception]
    ) -> FirstRound:
        """The results of the first round's ``answers`` and ``relevance`` (input order)."""
        results = [
            ParagraphResult(answer, {"relevance": rel})
            for answer, rel in zip(answers, relevance, strict=True)
        ]
        answered = [
            (i, r.answer.text) for i, r in enumerate(results) if isinstance(r.answer, Generated)
        ]
        return cls(results, answered)

    def support_values(self, query: str, paragraphs: Sequence[str]) -> list[Values]:
        """Values of the support questions: each answered paragraph with its answer."""
        return [prompt_values(query, paragraphs[i], text) for i, text in self.answered]

    def utility_values(self, query: str) -> list[Values]:
        """Values of the utility questions: each answer, without its paragraph."""
        return [prompt_values(query, None, text) for _, text in self.answered]

    def record(
        self, support: Sequence[Scored | Exception], utility: Sequence[Scored | Exception]
    ) -> list[ParagraphResult]:
        """Add the second round's scores (one per answered paragraph); returns the results."""
        for (i, _), sup, use in zip(self.answered, support, utility, strict=True):
            self.results[i].scores["support"] = sup
            self.results[i].scores["utility"] = use
        return self.results


class CriticBackend(ABC):
    """Continue prompts and read label probabilities, for a batch of prompts at once."""

    #: How prompts are formatted for the model (``"gguf_chat_template"``, ``"llm"``, ...).
    prompt_format: str = "llm"

    @abstractmethod
    async def generate(
        self, template: BasePromptTemplate, values: Sequence[Values]
    ) -> list[Generated | Exception]:
        """Answer every prompt ``template.format(**values[i])``."""

    @abstractmethod
    async def score(
        self, scale: LabelScale, template: BasePromptTemplate, values: Sequence[Values]
    ) -> list[Scored | Exception]:
        """Score every prompt on ``scale`` (the label the model would reply with)."""

    async def generate_and_score(
        self,
        answer_template: BasePromptTemplate,
        scale: LabelScale,
        label_template: BasePromptTemplate,
        values: Sequence[Values],
    ) -> tuple[list[Generated | Exception], list[Scored | Exception]]:
        """Answers from ``answer_template`` and labels from ``label_template``, same values.

        Backends that can share work between the two (llama.cpp evaluates each paragraph once
        for both) override this; the default runs both together.
        """
        return await asyncio.gather(
            self.generate(answer_template, values), self.score(scale, label_template, values)
        )

    async def judge_paragraphs(
        self,
        query: str,
        paragraphs: Sequence[str],
        prompts: JudgementPrompts,
        generator: CriticBackend | None = None,
    ) -> list[ParagraphResult]:
        """Answer ``query`` from each paragraph and score the paragraph and its answer.

        Two rounds: every answer (written by ``generator``, default this backend) and every
        paragraph's relevance, then the support and utility of every answer. Results are in
        input order. Backends that can carry work from one round to the next (llama.cpp reads
        each paragraph once for all four questions) override this; the default asks
        :meth:`generate_and_score` and :meth:`score`.
        """
        values = [prompt_values(query, text) for text in paragraphs]
        if generator is None or generator is self:
            answers, relevance = await self.generate_and_score(
                answer_template=prompts.answer,
                scale=RELEVANCE_SCALE,
                label_template=prompts.relevance,
                values=values,
            )
        else:
            answers, relevance = await asyncio.gather(
                generator.generate(prompts.answer, values),
                self.score(RELEVANCE_SCALE, prompts.relevance, values),
            )
        first = FirstRound.of(answers, relevance)
        if not first.answered:
            return first.results
        support, utility = await asyncio.gather(
            self.score(SUPPORT_SCALE, prompts.support, first.support_values(query, paragraphs)),
            self.score(UTILITY_SCALE, prompts.utility, first.utility_values(query)),
        )
        return first.record(support, utility)

    async def astream(self, template: BasePromptTemplate, values: Values) -> AsyncIterator[str]:
        """One answer to ``template.format(**values)``, piece by piece as the model writes it.

        The default yields :meth:`generate`'s whole answer once; backends whose model streams
        override it.
        """
        (result,) = await self.generate(template, [values])
        if isinstance(result, Exception):
            raise result
        yield result.text

    def close(self) -> None:  # noqa: B027 - optional hook, most backends hold nothing
        """Free what the backend holds (never the model it was given)."""
