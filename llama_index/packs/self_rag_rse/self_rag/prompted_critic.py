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
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.llms import LLM
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.prompts.mixin import PromptDictType

from llama_index.packs.self_rag_rse.self_rag.backend import (
    CriticBackend,
    Generated,
    JudgementPrompts,
    ParagraphResult,
    Scored,
    prompt_values,
)
from llama_index.packs.self_rag_rse.self_rag.base_critic import BaseCritic
from llama_index.packs.self_rag_rse.self_rag.contract import ParagraphJudgement, RetrievalDecision
from llama_index.packs.self_rag_rse.self_rag.labels import RETRIEVAL_SCALE
from llama_index.packs.self_rag_rse.self_rag.prompts import DEFAULT_PROMPTS, as_template

if TYPE_CHECKING:
    import llama_cpp

logger = logging.getLogger(__name__)
dispatcher = get_dispatcher(__name__)


class PromptedCritic(BaseCritic):
    """:class:`~.contract.Critic` for ordinary LLMs: Self-RAG's judgements asked as short prompts.

    Args:
        llm: the judging LLM: any LlamaIndex ``LLM``, or a raw ``llama_cpp.Llama``. ``None`` uses
            ``Settings.llm`` (resolved here, once). A ``LlamaCPP`` (or raw ``Llama``) is read
            through batched llama.cpp decoding with exact label probabilities.
        generator_llm: the LLM that writes the per-paragraph and no-evidence answers; defaults to
            ``llm``. A bigger generator with a small judge (or the reverse) is a common split.
        retrieval_prompt, relevance_prompt, support_prompt, utility_prompt: the four judgement
            templates (``PromptTemplate`` or string). They fill ``{query_str}``, ``{context_str}``
            (the paragraph) and ``{answer_str}``, and must keep the reply words the scores read:
            Yes/No, Yes/Partly/No and 1-5.
        answer_prompt, no_evidence_prompt: the answer templates, with and without the paragraph.
        max_new_tokens: answer length cap on llama.cpp (other LLMs use their own
            ``max_tokens``; pass ``llm_kwargs`` to override per call). Short answers keep IsSUP
            and IsUSE about one claim.
        num_workers: concurrent LLM calls for non-llama.cpp LLMs. One judgement of
            k paragraphs makes 4·k calls in two rounds; ``num_workers >= 2k`` makes each round as
            slow as its slowest call.
        use_batched_decoding: read llama.cpp models through :class:`BatchedDecoder` (default).
            ``False`` treats a ``LlamaCPP`` like any LLM (one ``complete`` per question, parsed).
        llm_kwargs: extra keyword arguments for every ``achat``/``acomplete`` call (e.g.
            ``{"max_tokens": 8}``), non-llama.cpp LLMs only.
        n_seq_max, n_ctx, n_threads: batched llama.cpp decoding: sequences decoded together (two
            per paragraph: ``n_seq_max // 2`` paragraphs are judged at a time), positions per
            sequence (default: the model's ``n_ctx``; longer paragraphs are truncated with a
            warning), CPU threads (default: the model's ``n_threads_batch``, all cores unless
            set; fewer when other busy work shares the machine).
        backend, generator_backend: built :class:`~.backend.CriticBackend` objects, used instead
            of building one from ``llm`` / ``generator_llm`` (e.g. a served model's backend).

    Each judgement's ``details`` says how each score was obtained: ``"logprobs"`` (label
    probabilities), ``"parsed"`` (label read from the reply) or ``"fallback"`` (unreadable reply,
    neutral score; ``details["notes"]`` says why), plus, when known, ``answer_tokens`` and
    ``generated_tokens`` (answer and label replies together). A failed paragraph has ``"error"``
    there. Synchronous methods run the async ones through the package's sync/async bridge, so
    they are as parallel as the async ones.
    """

    name = "prompted"

    def __init__(
        self,
        llm: LLM | llama_cpp.Llama | None = None,
        *,
        generator_llm: LLM | llama_cpp.Llama | None = None,
        retrieval_prompt: BasePromptTemplate | str | None = None,
        relevance_prompt: BasePromptTemplate | str | None = None,
        support_prompt: BasePromptTemplate | str | None = None,
        utility_prompt: BasePromptTemplate | str | None = None,
        answer_prompt: BasePromptTemplate | str | None = None,
        no_evidence_prompt: BasePromptTemplate | str | None = None,
        max_new_tokens: int = 64,
        num_workers: int = 4,
        use_batched_decoding: bool = True,
        llm_kwargs: Mapping[str, Any] | None = None,
        n_seq_max: int = 8,
        n_ctx: int | None = None,
        n_threads: int | None = None,
        backend: CriticBackend | None = None,
        generator_backend: CriticBackend | None = None,
    ) -> None:
        from llama_index.packs.self_rag_rse.self_rag.factory import build_backend

        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if llm is None and backend is None:
            from llama_index.core import Settings

            llm = Settings.llm
        self.llm = llm
        self.generator_llm = generator_llm if generator_llm is not None else llm
        self.num_workers = num_workers
        self.max_new_tokens = max_new_tokens
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
        options: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "num_workers": num_workers,
            "use_batched_decoding": use_batched_decoding,
            "llm_kwargs": llm_kwargs,
            "n_seq_max": n_seq_max,
            "n_ctx": n_ctx,
            "n_threads": n_threads,
        }
        #: The backend that judges (and answers, unless a generator was given).
        self.backend: CriticBackend = (
            backend if backend is not None else build_backend(llm, **options)
        )
        if generator_backend is not None:
            self.generator_backend = generator_backend
        elif generator_llm is None or generator_llm is llm:
            self.generator_backend = self.backend
        else:
            self.generator_backend = build_backend(generator_llm, **options)

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

    # --- Critic --------------------------------------------------------------------------------

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
            cut = 0.5 if threshold is None else threshold
            retrieve = scored.score > cut
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
        results = await self.backend.judge_paragraphs(
            query, paragraphs, self._judgement_prompts(), generator=self.generator_backend
        )
        return [_judgement(result) for result in results]

    def _judgement_prompts(self) -> JudgementPrompts:
        return JudgementPrompts(
            answer=self._prompts["answer_prompt"],
            relevance=self._prompts["relevance_prompt"],
            support=self._prompts["support_prompt"],
            utility=self._prompts["utility_prompt"],
        )

    @dispatcher.span
    async def agenerate(self, query: str) -> str:
        """Answer ``query`` with no evidence (``no_evidence_prompt``)."""
        (result,) = await self.generator_backend.generate(
            self._prompts["no_evidence_prompt"], [prompt_values(query)]
        )
        if isinstance(result, Exception):
            raise result
        return result.text

    def close(self) -> None:
        """Free the backends' native resources (the LLMs themselves stay open)."""
        self.backend.close()
        if self.generator_backend is not self.backend:
            self.generator_backend.close()


def _judgement(item: ParagraphResult) -> ParagraphJudgement:
    failures = [item.answer] if isinstance(item.answer, Exception) else []
    failures += [s for s in item.scores.values() if isinstance(s, Exception)]
    if failures:
        return ParagraphJudgement(
            answer="",
            relevance=0.0,
            support=0.0,
            utility=0.0,
            error=f"{type(failures[0]).__name__}: {failures[0]}",
            details={"relevance": "error", "support": "error", "utility": "error"},
        )
    assert isinstance(item.answer, Generated)
    scores = {k: v for k, v in item.scores.items() if isinstance(v, Scored)}
    details: dict[str, Any] = {name: scores[name].method for name in scores}
    notes = {name: s.note for name, s in scores.items() if s.note}
    if notes:
        details["notes"] = notes
    counts = [item.answer.generated_tokens, *(s.generated_tokens for s in scores.values())]
    if all(c is not None for c in counts):
        details["generated_tokens"] = sum(c for c in counts if c is not None)
    if item.answer.generated_tokens is not None:
        details["answer_tokens"] = item.answer.generated_tokens
    return ParagraphJudgement(
        answer=item.answer.text,
        relevance=scores["relevance"].score,
        support=scores["support"].score,
        utility=scores["utility"].score,
        seq_score=item.answer.seq_score,
        details=details,
    )
