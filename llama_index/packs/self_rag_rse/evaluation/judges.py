"""Judges: named metrics, each a LlamaIndex ``BaseEvaluator``, scoring one answer at a time.

Any LlamaIndex evaluator (or one of yours) is a metric; a :class:`Judge` names its metrics, says
which apply to an answer and reads each score, while the runner owns concurrency (core's
``BatchEvalRunner``), timeouts, retries and the cache. Built in: :class:`RagasJudge` (RAGAS's own
metric objects through its LlamaIndex wrappers) and :class:`LlamaIndexJudge` (core's evaluators,
``li_*`` metrics so a table never mixes the two; used when ``ragas`` is not installed). What
each metric measures is in the report's glossary. A reply without a score raises
:class:`JudgementError`, which the runner records.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import warnings
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llama_index.core.evaluation import (
    AnswerRelevancyEvaluator,
    BaseEvaluator,
    ContextRelevancyEvaluator,
    CorrectnessEvaluator,
    EvaluationResult,
    FaithfulnessEvaluator,
    RelevancyEvaluator,
    SemanticSimilarityEvaluator,
)
from llama_index.core.prompts.mixin import PromptDictType

from llama_index.packs.self_rag_rse.common.optional import optional_import

logger = logging.getLogger(__name__)

#: What a metric may need of a sample (see :class:`Judge`'s ``needs``).
CONTEXTS, REFERENCE, NO_REFERENCE = "contexts", "reference", "no reference"
#: Each built-in judge's metrics, in report order, with what they need of an answer.
RAGAS_METRICS = {
    "faithfulness": {CONTEXTS},
    "answer_relevancy": set(),
    "context_precision": {CONTEXTS, REFERENCE},
    "context_utilization": {CONTEXTS, NO_REFERENCE},
    "context_recall": {CONTEXTS, REFERENCE},
}
LLAMAINDEX_METRICS = {
    "li_faithfulness": {CONTEXTS},
    "li_relevancy": {CONTEXTS},
    "li_answer_relevancy": set(),
    "li_context_relevancy": {CONTEXTS},
    "li_correctness": {REFERENCE},
    "li_semantic_similarity": {REFERENCE},
}


@dataclass(frozen=True)
class Sample:
    """What a judge sees of one engine's answer to one question."""

    question: str
    answer: str
    contexts: tuple[str, ...] = ()
    reference: str | None = None


class JudgementError(RuntimeError):
    """The judge answered, but no score could be read from it (unparsable reply, NaN)."""


class PromptlessEvaluator(BaseEvaluator):
    """A ``BaseEvaluator`` whose prompts live elsewhere (in a RAGAS metric, in a judge)."""

    def _get_prompts(self) -> PromptDictType:
        return {}

    def _update_prompts(self, prompts_dict: PromptDictType) -> None:
        pass


class Judge:
    """Scores answers on named metrics (scores in [0, 1], higher is better).

    ``evaluators`` (``{metric: evaluator}``, in report order) are awaited as ``aevaluate(query=,
    response=, contexts=, reference=)``. ``name`` (implementation and model) is part of the cache
    key, so a judge never reuses another's judgements. ``needs`` (``{metric: {CONTEXTS,
    REFERENCE, NO_REFERENCE}}``) scores a metric only on answers with contexts, with a reference
    or without one. ``llm``, ``embed_model`` and ``library`` are what the report says. Example::

        judge = Judge({"faithful": FaithfulnessEvaluator(llm=llm)}, name="mine",
                      needs={"faithful": {CONTEXTS}})
    """

    #: Short name of the implementation (``"ragas"``, ``"llamaindex"``).
    backend: str = "judge"
    llm: Any = None
    embed_model: Any = None
    library: str | None = None

    def __init__(
        self,
        evaluators: Mapping[str, BaseEvaluator],
        *,
        name: str,
        needs: Mapping[str, Collection[str]] | None = None,
        llm: Any = None,
        embed_model: Any = None,
        library: str | None = None,
    ) -> None:
        self.evaluators = dict(evaluators)
        self.needs = {metric: set(need) for metric, need in (needs or {}).items()}
        self.identity = name  # the cache key's judge part
        self.llm, self.embed_model, self.library = llm, embed_model, library

    @property
    def metric_names(self) -> tuple[str, ...]:
        """Every metric this judge can score, in report order."""
        return tuple(self.evaluators)

    def applicable(self, metric: str, sample: Sample) -> bool:
        """Whether ``metric`` can be scored on ``sample`` (see ``needs``)."""
        need = self.needs.get(metric, set())
        return metric in self.evaluators and not (
            (CONTEXTS in need and not sample.contexts)
            or (REFERENCE in need and not sample.reference)
            or (NO_REFERENCE in need and sample.reference)
        )

    async def ascore(self, metric: str, sample: Sample) -> float:
        """The score of ``sample`` on ``metric``; raises when the judge cannot give one
        (:class:`JudgementError` for an invalid result or a reply without a score)."""
        result = await self.evaluators[metric].aevaluate(
            query=sample.question,
            response=sample.answer,
            contexts=list(sample.contexts),
            reference=sample.reference,
        )
        if result.invalid_result:
            raise JudgementError(f"{metric}: {result.invalid_reason or 'invalid result'}")
        if result.score is None:
            reply = " ".join(str(result.feedback or "").split())[:160]
            raise JudgementError(f"{metric}: no score in the judge's reply {reply!r}")
        return float(result.score)

    def describe(self) -> dict[str, Any]:
        """Facts for the report: implementation, metrics and, when known, models and library."""
        facts: dict[str, Any] = {
            "backend": self.backend,
            "identity": self.identity,
            "metrics": self.metric_names,
        }
        if self.llm is not None:
            facts["library"] = self.library
            facts["llm"] = llm_label(self.llm)
            facts["embed_model"] = embed_label(self.embed_model) if self.embed_model else None
        return facts


class LlamaIndexJudge(Judge):
    """LlamaIndex's evaluators judged by ``llm``, rubric scores mapped to [0, 1];
    ``li_semantic_similarity`` only with an ``embed_model``. ``name`` overrides the identity."""

    backend = "llamaindex"

    def __init__(self, llm: Any, embed_model: Any = None, *, name: str | None = None) -> None:
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
        super().__init__(
            evaluators,
            name=name or f"llamaindex / {llm_label(llm)}",
            needs=LLAMAINDEX_METRICS,
            llm=llm,
            embed_model=embed_model,
            library="llama-index-core evaluators",
        )

    async def ascore(self, metric: str, sample: Sample) -> float:
        """The evaluator's score in [0, 1]; an unreadable reply raises :class:`JudgementError`."""
        try:
            score = await super().ascore(metric, sample)
        except ValueError as error:
            # CorrectnessEvaluator's parser raises on a reply without a score line.
            raise JudgementError(f"{metric}: unreadable reply ({error})") from error
        if metric == "li_correctness":
            score = (score - 1.0) / 4.0
        return min(1.0, max(0.0, score))


class RagasMetric(PromptlessEvaluator):
    """A RAGAS metric object as an evaluator of one ``SingleTurnSample``; an unparsable reply or
    a NaN raises :class:`JudgementError`, other errors (the judge's server) pass through."""

    def __init__(self, name: str, metric: Any, run_config: Any) -> None:
        self.name, self.metric, self.run_config = name, metric, run_config

    async def aevaluate(
        self,
        query: str | None = None,
        response: str | None = None,
        contexts: Sequence[str] | None = None,
        reference: str | None = None,
        **kwargs: Any,
    ) -> EvaluationResult:
        """Score the answer; ``reference`` is the reference answer, if any."""
        from ragas import SingleTurnSample
        from ragas.exceptions import RagasOutputParserException

        sample = SingleTurnSample(
            user_input=query,
            response=response,
            retrieved_contexts=list(contexts or ()),
            reference=reference,
        )
        try:
            value = await self.metric.single_turn_ascore(sample, timeout=self.run_config.timeout)
        except RagasOutputParserException as error:
            raise JudgementError(f"ragas {self.name}: {error}") from error
        if value is None or math.isnan(value):
            raise JudgementError(
                f"ragas {self.name} gave no score (NaN): the judge's replies held nothing to "
                "count (e.g. no statements extracted)"
            )
        return EvaluationResult(
            query=query, response=response, contexts=contexts, score=float(value)
        )


class RagasJudge(Judge):
    """RAGAS metrics judged by ``llm`` (any LlamaIndex LLM); ``answer_relevancy`` only with an
    ``embed_model``. ``name`` overrides the identity; ``run_config`` is RAGAS's ``RunConfig``
    (default: one attempt per request, no time limit of its own: the runner bounds each judgement).

    RAGAS 0.4's LlamaIndex-compatible ("legacy") metrics: its ``metrics.collections`` take only
    instructor/OpenAI-client LLMs. ``answer_relevancy`` regenerates one question
    (``strictness=1``: the wrapper returns one generation per call). RAGAS's telemetry is off
    unless ``RAGAS_DO_NOT_TRACK`` says otherwise. Example::

        judge = RagasJudge(OpenAILike(model="qwen2.5-7b-instruct", api_base=URL), embed_model)
    """

    backend = "ragas"

    def __init__(
        self, llm: Any, embed_model: Any = None, *, name: str | None = None, run_config: Any = None
    ) -> None:
        ragas = _import_ragas()
        self.version = str(getattr(ragas, "__version__", "?"))
        config = run_config or ragas.run_config.RunConfig(
            max_retries=1, max_wait=1, timeout=24 * 3600
        )
        metrics = ragas.metrics
        with warnings.catch_warnings():
            # ragas 0.4 marks these deprecated in favour of metric collections that take only
            # instructor/OpenAI-client LLMs; they are its LlamaIndex-compatible path.
            warnings.simplefilter("ignore", DeprecationWarning)
            wrapped = ragas.llms.LlamaIndexLLMWrapper(llm, run_config=config)
            found: dict[str, Any] = {
                "faithfulness": metrics.Faithfulness(llm=wrapped),
                "context_precision": metrics.LLMContextPrecisionWithReference(llm=wrapped),
                "context_utilization": metrics.LLMContextPrecisionWithoutReference(llm=wrapped),
                "context_recall": metrics.LLMContextRecall(llm=wrapped),
            }
            if embed_model is not None:
                embeddings = ragas.embeddings.LlamaIndexEmbeddingsWrapper(
                    embed_model, run_config=config
                )
                found["answer_relevancy"] = metrics.AnswerRelevancy(
                    llm=wrapped, embeddings=embeddings, strictness=1
                )
            else:
                logger.info("RagasJudge: no embed_model, so answer_relevancy is left out")
        for metric in found.values():
            metric.init(config)
        super().__init__(
            {n: RagasMetric(n, found[n], config) for n in RAGAS_METRICS if n in found},
            name=name or f"ragas {self.version} / {llm_label(llm)}",
            needs=RAGAS_METRICS,
            llm=llm,
            embed_model=embed_model,
            library=f"ragas {self.version}",
        )


def ragas_available() -> bool:
    """Whether ``ragas`` imports here (its LlamaIndex wrappers included)."""
    try:
        _import_ragas()
    except ImportError:
        return False
    return True


def _import_ragas() -> Any:
    """``ragas`` with the submodules used here imported (an ``ImportError`` says how to install)."""
    os.environ.setdefault("RAGAS_DO_NOT_TRACK", "true")
    ragas = optional_import("ragas", "RAGAS metrics", "eval")
    for module in ("embeddings", "exceptions", "llms", "metrics", "run_config"):
        importlib.import_module(f"ragas.{module}")
    return ragas


def make_judge(
    llm: Any, embed_model: Any = None, *, backend: str = "auto", name: str | None = None
) -> Judge:
    """A judge on ``llm``: ``backend="ragas"``, ``"llamaindex"`` or ``"auto"`` (RAGAS when it
    imports, LlamaIndex's evaluators otherwise)."""
    if backend not in ("auto", "ragas", "llamaindex"):
        raise ValueError(f"judge backend must be 'auto', 'ragas' or 'llamaindex', got {backend!r}")
    if backend == "ragas" or (backend == "auto" and ragas_available()):
        return RagasJudge(llm, embed_model, name=name)
    return LlamaIndexJudge(llm, embed_model, name=name)


def llm_label(llm: Any) -> str:
    """A short, stable name for an LLM: its class, model (a GGUF's file name) and reply length."""
    model, tokens = "", None
    try:
        model = str(llm.metadata.model_name or "")
        tokens = llm.metadata.num_output
    except Exception:  # a label must never fail
        model = str(getattr(llm, "model", "") or "")
    if model.endswith(".gguf"):
        model = Path(model).name
    # The reply length changes what a judge can say (a JSON list cut short fails to parse).
    parts = [p for p in (model, f"{tokens} tokens" if isinstance(tokens, int) else "") if p]
    return f"{type(llm).__name__}({', '.join(parts)})" if parts else type(llm).__name__


def embed_label(embed_model: Any) -> str:
    """A short, stable name for an embedding model."""
    name = str(getattr(embed_model, "model_name", "") or "")
    if Path(name).is_absolute():
        # A local model folder: its last two parts name it (e.g. a package and its folder).
        name = "/".join(Path(name).parts[-2:])
    return f"{type(embed_model).__name__}({name})" if name else type(embed_model).__name__
