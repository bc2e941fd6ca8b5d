"""The prompted critic: Self-RAG's judgements asked of an ordinary LLM, one question at a time.

Models without reflection tokens are asked four short questions instead, each written for small
instruct models and answered with one label word:

* the gate: does the question need documents? (Yes / No)
* IsREL: is the paragraph relevant to the question? (Yes / No)
* IsSUP: does the paragraph support the answer? (Yes / Partly / No)
* IsUSE: how useful is the answer, 1 to 5?

The replies are turned into scores on the reflection critic's scales, so both critics rank alike:
relevance and support in [0, 1] (support = p(Yes) + 0.5·p(Partly)), utility in [-1, 1] (weights
-1, -0.5, 0, 0.5, 1 over 1..5), gate probability p(Yes) / (p(Yes) + p(No)).

The critic talks to its models through the :class:`~.backend.CriticBackend` contract only: how
label probabilities are read (exact next-token log-probs on llama.cpp, returned log-probs or a
parsed reply elsewhere), and how the four questions of a paragraph share work (llama.cpp reads
each paragraph once for all of them), is the backend's business. Every
:class:`~.contract.ParagraphJudgement` records in ``details`` how each score was obtained
(``"logprobs"``, ``"parsed"`` or ``"fallback"``).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.llms import LLM
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.prompts.mixin import PromptDictType

from llama_index.packs.self_rag_rse.critic.backend import (
    CriticBackend,
    Generated,
    JudgementPrompts,
    ParagraphResult,
    Scored,
    prompt_values,
)
from llama_index.packs.self_rag_rse.critic.contract import (
    BaseCritic,
    ParagraphJudgement,
    RetrievalDecision,
)
from llama_index.packs.self_rag_rse.critic.labels import RETRIEVAL_SCALE
from llama_index.packs.self_rag_rse.critic.llm_backend import LLMBackend
from llama_index.packs.self_rag_rse.critic.prompts import DEFAULT_PROMPTS, as_template

logger = logging.getLogger(__name__)
dispatcher = get_dispatcher(__name__)


class PromptedCritic(BaseCritic):
    """:class:`~.contract.BaseCritic` for ordinary LLMs: Self-RAG's judgements asked as prompts.

    Args:
        backend: the :class:`~.backend.CriticBackend` that judges (and answers, unless
            ``generator_backend`` is given): ``LlamaCppBackend(LlamaCPP(...))`` for batched
            llama.cpp decoding with exact label probabilities, ``LLMBackend(llm)`` for any
            LlamaIndex LLM, or a backend of your own. :meth:`from_llm` builds one from an LLM.
        generator_backend: the backend that writes the per-paragraph and no-evidence answers;
            defaults to ``backend``. A bigger generator with a small judge (or the reverse) is a
            common split.
        retrieval_prompt, relevance_prompt, support_prompt, utility_prompt: the four judgement
            templates (``PromptTemplate`` or string). They fill ``{query_str}``, ``{context_str}``
            (the paragraph) and ``{answer_str}``, and must keep the reply words the scores read:
            Yes/No, Yes/Partly/No and 1-5.
        answer_prompt, no_evidence_prompt: the answer templates, with and without the paragraph.

    Each judgement's ``details`` says how each score was obtained: ``"logprobs"`` (label
    probabilities), ``"parsed"`` (label read from the reply) or ``"fallback"`` (unreadable reply,
    neutral score; ``details["notes"]`` says why), plus, when known, ``answer_tokens`` and
    ``generated_tokens`` (answer and label replies together). A failed paragraph has ``"error"``
    there. Synchronous methods run the async ones through the package's sync/async bridge, so
    they are as parallel as the async ones.

    Example::

        critic = PromptedCritic.from_llm(OpenAI(model="gpt-4o-mini"))
        engine = SelfRAGQueryEngine(retriever=index.as_retriever(), critic=critic)
    """

    name = "prompted"

    def __init__(
        self,
        backend: CriticBackend,
        *,
        generator_backend: CriticBackend | None = None,
        retrieval_prompt: BasePromptTemplate | str | None = None,
        relevance_prompt: BasePromptTemplate | str | None = None,
        support_prompt: BasePromptTemplate | str | None = None,
        utility_prompt: BasePromptTemplate | str | None = None,
        answer_prompt: BasePromptTemplate | str | None = None,
        no_evidence_prompt: BasePromptTemplate | str | None = None,
    ) -> None:
        if not isinstance(backend, CriticBackend):
            raise TypeError(
                f"PromptedCritic takes a built CriticBackend, got {type(backend).__name__}: "
                "use PromptedCritic.from_llm(llm) to judge with a LlamaIndex LLM"
            )
        given = {
            "retrieval_prompt": retrieval_prompt,
            "relevance_prompt": relevance_prompt,
            "support_prompt": support_prompt,
            "utility_prompt": utility_prompt,
            "answer_prompt": answer_prompt,
            "no_evidence_prompt": no_evidence_prompt,
        }
        self._prompts: dict[str, BasePromptTemplate] = {
            key: as_template(value if value is not None else DEFAULT_PROMPTS[key], key)
            for key, value in given.items()
        }
        #: The backend that judges (and answers, unless a generator was given).
        self.backend = backend
        self.generator_backend = generator_backend if generator_backend is not None else backend

    @classmethod
    def from_llm(
        cls,
        llm: LLM | None = None,
        *,
        generator_llm: LLM | None = None,
        num_workers: int = 4,
        llm_kwargs: Mapping[str, Any] | None = None,
        **prompts: BasePromptTemplate | str | None,
    ) -> PromptedCritic:
        """A critic that asks any LlamaIndex ``LLM`` its questions, ``num_workers`` at a time.

        ``llm=None`` uses ``Settings.llm`` (resolved here, once); ``generator_llm`` writes the
        answers (default ``llm``). Label probabilities come from returned log-probs where the LLM
        gives them, else from the parsed reply. One judgement of k paragraphs makes 4·k calls in
        two rounds: ``num_workers >= 2k`` makes each round as slow as its slowest call.
        ``llm_kwargs`` go to every ``achat``/``acomplete`` call (e.g. ``{"max_tokens": 8}``);
        ``prompts`` are the templates of the constructor. Every LLM is called through its public
        API here, a ``LlamaCPP`` too; ``PromptedCritic(LlamaCppBackend(llm))`` reads llama.cpp
        models with batched decoding and exact label probabilities instead.
        """
        if llm is None:
            from llama_index.core import Settings

            llm = Settings.llm
        for name, model in (("llm", llm), ("generator_llm", generator_llm)):
            if model is not None and not isinstance(model, LLM):
                raise TypeError(
                    f"{name} must be a LlamaIndex LLM, got {type(model).__name__}: wrap a "
                    "llama_cpp.Llama as PromptedCritic(LlamaCppBackend(llama))"
                )
        backend = LLMBackend(llm, llm_kwargs, num_workers=num_workers)
        generator: LLMBackend | None = None
        # A generator of its own only when it is another LLM than the judge.
        if generator_llm is not None and generator_llm is not llm:
            generator = LLMBackend(generator_llm, llm_kwargs, num_workers=num_workers)
        return cls(backend, generator_backend=generator, **prompts)

    @property
    def decoder(self) -> Any:
        """The judge's batched llama.cpp decoder, or ``None`` when the judge is not llama.cpp."""
        return getattr(self.backend, "decoder", None)

    @property
    def prompt_format(self) -> str:
        """How the judge's prompts are formatted (``"gguf_chat_template"``, ``"llm"``, ...)."""
        return self.backend.prompt_format

    # --- PromptMixin ---------------------------------------------------------------------------

    def _get_prompts(self) -> PromptDictType:
        """The six templates, keyed as in :data:`~.prompts.PROMPT_VARIABLES`."""
        return dict(self._prompts)

    def _update_prompts(self, prompts_dict: PromptDictType) -> None:
        """Replace templates by key; unknown keys are ignored like in LlamaIndex modules."""
        for key, prompt in prompts_dict.items():
            if key in self._prompts:
                self._prompts[key] = as_template(prompt, key)

    # --- the critic contract ----------------------------------------------------------------------

    @dispatcher.span
    async def adecide_retrieval(
        self, query: str, threshold: float | None, answer_if_skipped: bool = True
    ) -> RetrievalDecision:
        """Ask whether ``query`` needs documents.

        With label probabilities, retrieve when p(Yes)/(p(Yes)+p(No)) exceeds ``threshold``
        (``None``: when Yes is the likelier label). A parsed verdict has no probability
        (``probability=None``) and decides alone; an unreadable one retrieves. When retrieval is
        skipped and ``answer_if_skipped``, the no-evidence answer is generated too.
        """
        (scored,) = await self.backend.score(
            RETRIEVAL_SCALE, self._prompts["retrieval_prompt"], [prompt_values(query)]
        )
        if isinstance(scored, Exception):
            raise scored
        if scored.method == "logprobs":
            probability: float | None = scored.score
            retrieve = scored.score > (0.5 if threshold is None else threshold)
        else:
            probability = None
            retrieve = scored.score >= 0.5
        answer = None
        if not retrieve and answer_if_skipped:
            answer = await self.agenerate(query)
        logger.debug(
            "retrieval gate (%s): p=%s threshold=%s retrieve=%s%s",
            scored.method,
            probability,
            threshold,
            retrieve,
            f" ({scored.note})" if scored.note else "",
        )
        return RetrievalDecision(retrieve=retrieve, probability=probability, answer=answer)

    @dispatcher.span
    async def ajudge(self, query: str, paragraphs: Sequence[str]) -> list[ParagraphJudgement]:
        """Answer ``query`` from each paragraph and score each answer, in input order.

        One backend call (:meth:`~.backend.CriticBackend.judge_paragraphs`): the answers and the
        relevance of every paragraph, then support and utility of every answer. A paragraph
        whose call failed comes back with ``error`` set and zero scores.
        """
        if not paragraphs:
            return []
        prompts = JudgementPrompts(
            answer=self._prompts["answer_prompt"],
            relevance=self._prompts["relevance_prompt"],
            support=self._prompts["support_prompt"],
            utility=self._prompts["utility_prompt"],
        )
        results = await self.backend.judge_paragraphs(
            query, paragraphs, prompts, generator=self.generator_backend
        )
        return [_judgement(result) for result in results]

    @dispatcher.span
    async def agenerate(self, query: str) -> str:
        """Answer ``query`` with no evidence (``no_evidence_prompt``)."""
        (result,) = await self.generator_backend.generate(
            self._prompts["no_evidence_prompt"], [prompt_values(query)]
        )
        if isinstance(result, Exception):
            raise result
        return result.text

    async def astream_generate(self, query: str) -> AsyncIterator[str]:
        """The no-evidence answer, piece by piece as the generator's model writes it."""
        template = self._prompts["no_evidence_prompt"]
        async for piece in self.generator_backend.astream(template, prompt_values(query)):
            yield piece

    def close(self) -> None:
        """Free the backends' native resources (the LLMs themselves stay open)."""
        self.backend.close()
        if self.generator_backend is not self.backend:
            self.generator_backend.close()


def _judgement(item: ParagraphResult) -> ParagraphJudgement:
    """One paragraph's judgement from what the backend found: a part that failed fails the
    paragraph (its first failure is the error, every score 0); ``details`` says how each score
    was read, and the token counts when known.
    """
    parts = [item.answer, *item.scores.values()]
    failures = [part for part in parts if isinstance(part, Exception)]
    if failures:
        error = f"{type(failures[0]).__name__}: {failures[0]}"
        marks = dict.fromkeys(("relevance", "support", "utility"), "error")
        return ParagraphJudgement(
            answer="",
            relevance=0.0,
            support=0.0,
            utility=0.0,
            error=error,
            details=marks,
        )
    assert isinstance(item.answer, Generated)
    scores = {k: v for k, v in item.scores.items() if isinstance(v, Scored)}
    details: dict[str, Any] = {name: scores[name].method for name in scores}
    if notes := {name: s.note for name, s in scores.items() if s.note}:
        details["notes"] = notes
    counts = [item.answer.generated_tokens, *(s.generated_tokens for s in scores.values())]
    if all(c is not None for c in counts):
        details["generated_tokens"] = sum(c for c in counts if c is not None)
    if item.answer.generated_tokens is not None:
        details["answer_tokens"] = item.answer.generated_tokens
    if item.answer.passage_cut:  # as the reflection critics record it
        details["passage_cut"] = item.answer.passage_cut
    return ParagraphJudgement(
        answer=item.answer.text,
        relevance=scores["relevance"].score,
        support=scores["support"].score,
        utility=scores["utility"].score,
        seq_score=item.answer.seq_score,
        details=details,
    )
