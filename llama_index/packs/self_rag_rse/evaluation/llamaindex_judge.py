"""LlamaIndex's own evaluators as a judge: the path taken when ``ragas`` is not installed.

Each metric is a LlamaIndex evaluator run on one answer. They are not the RAGAS metrics and carry
other names (prefix ``li_``), so a table never mixes the two:

- ``li_faithfulness``: ``FaithfulnessEvaluator``, 1 if the contexts support the answer, else 0.
- ``li_relevancy``: ``RelevancyEvaluator``, 1 if the answer and contexts are in line with the
  question, else 0.
- ``li_answer_relevancy``: ``AnswerRelevancyEvaluator``, 0..1 (its 0–2 rubric score / 2).
- ``li_context_relevancy``: ``ContextRelevancyEvaluator``, 0..1 (its 0–4 rubric score / 4).
- ``li_correctness``: ``CorrectnessEvaluator`` against the reference, its 1–5 score mapped to
  0..1 as (score − 1) / 4. Only with a reference.
- ``li_semantic_similarity``: ``SemanticSimilarityEvaluator``, embedding cosine of answer and
  reference (no LLM). Only with a reference and an embedding model.

A reply the evaluator cannot read (``invalid_result``, no score) raises
:class:`~.protocol.JudgementError`; the runner records it.
"""

from __future__ import annotations

from typing import Any

from llama_index.core.evaluation import (
    AnswerRelevancyEvaluator,
    BaseEvaluator,
    ContextRelevancyEvaluator,
    CorrectnessEvaluator,
    FaithfulnessEvaluator,
    RelevancyEvaluator,
    SemanticSimilarityEvaluator,
)

from llama_index.packs.self_rag_rse.evaluation.protocol import (
    Judge,
    JudgementError,
    Sample,
    embed_label,
    llm_label,
)

#: Every metric this judge scores, in report order.
LLAMAINDEX_METRICS = (
    "li_faithfulness",
    "li_relevancy",
    "li_answer_relevancy",
    "li_context_relevancy",
    "li_correctness",
    "li_semantic_similarity",
)
_NEEDS_CONTEXTS = {"li_faithfulness", "li_relevancy", "li_context_relevancy"}
_NEEDS_REFERENCE = {"li_correctness", "li_semantic_similarity"}


class LlamaIndexJudge(Judge):
    """LlamaIndex evaluators judged by a LlamaIndex LLM (metrics in the module docstring).

    Args:
        llm: the judge LLM.
        embed_model: for ``li_semantic_similarity``; without one that metric is left out.
        name: overrides the judge's identity in the cache and report.
    """

    backend = "llamaindex"

    def __init__(self, llm: Any, embed_model: Any = None, *, name: str | None = None) -> None:
        self.llm = llm
        self.embed_model = embed_model
        evaluators: dict[str, BaseEvaluator] = {
            "li_faithfulness": FaithfulnessEvaluator(llm=llm),
            "li_relevancy": RelevancyEvaluator(llm=llm),
            "li_answer_relevancy": AnswerRelevancyEvaluator(llm=llm),
            "li_context_relevancy": ContextRelevancyEvaluator(llm=llm),
            "li_correctness": CorrectnessEvaluator(llm=llm),
        }
        if embed_model is not None:
            evaluators["li_semantic_similarity"] = SemanticSimilarityEvaluator(
                embed_model=embed_model
            )
        self._evaluators = evaluators
        self._identity = name or f"llamaindex / {llm_label(llm)}"

    @property
    def identity(self) -> str:
        """``llamaindex / <LLM class>(<model>)`` unless ``name`` was given."""
        return self._identity

    @property
    def metric_names(self) -> tuple[str, ...]:
        """The metrics of :data:`LLAMAINDEX_METRICS` this judge has."""
        return tuple(m for m in LLAMAINDEX_METRICS if m in self._evaluators)

    def applicable(self, metric: str, sample: Sample) -> bool:
        """Contexts for the context-based metrics, a reference for the reference-based ones."""
        if metric not in self._evaluators:
            return False
        if metric in _NEEDS_CONTEXTS and not sample.contexts:
            return False
        return not (metric in _NEEDS_REFERENCE and not sample.reference)

    async def ascore(self, metric: str, sample: Sample) -> float:
        """Run the evaluator; an unreadable reply raises :class:`JudgementError`."""
        try:
            result = await self._evaluators[metric].aevaluate(
                query=sample.question,
                response=sample.answer,
                contexts=list(sample.contexts),
                reference=sample.reference,
            )
        except ValueError as error:
            # CorrectnessEvaluator's parser raises on a reply without a score line.
            raise JudgementError(f"{metric}: unreadable reply ({error})") from error
        if result.invalid_result:
            raise JudgementError(f"{metric}: {result.invalid_reason or 'invalid result'}")
        if result.score is None:
            reply = " ".join(str(result.feedback or "").split())[:160]
            raise JudgementError(f"{metric}: no score in the judge's reply {reply!r}")
        score = float(result.score)
        if metric == "li_correctness":
            score = (score - 1.0) / 4.0
        return min(1.0, max(0.0, score))

    def describe(self) -> dict[str, Any]:
        """Implementation, judge model, embedding model and metrics."""
        return {
            **super().describe(),
            "library": "llama-index-core evaluators",
            "llm": llm_label(self.llm),
            "embed_model": embed_label(self.embed_model) if self.embed_model else None,
        }


def make_judge(
    llm: Any, embed_model: Any = None, *, backend: str = "auto", name: str | None = None
) -> Judge:
    """A judge on ``llm``: ``backend="ragas"``, ``"llamaindex"`` or ``"auto"`` (RAGAS when it
    imports, LlamaIndex's evaluators otherwise)."""
    from llama_index.packs.self_rag_rse.evaluation.ragas_judge import RagasJudge, ragas_available

    if backend not in ("auto", "ragas", "llamaindex"):
        raise ValueError(f"judge backend must be 'auto', 'ragas' or 'llamaindex', got {backend!r}")
    if backend == "ragas" or (backend == "auto" and ragas_available()):
        return RagasJudge(llm, embed_model, name=name)
    return LlamaIndexJudge(llm, embed_model, name=name)
