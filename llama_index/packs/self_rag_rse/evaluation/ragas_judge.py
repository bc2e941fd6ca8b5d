"""RAGAS metrics with any LlamaIndex LLM as the judge, through RAGAS's own LlamaIndex wrappers.

Nothing of RAGAS is re-implemented here: each metric is a RAGAS metric object
(``ragas.metrics``: ``Faithfulness``, ``AnswerRelevancy``, ``LLMContextPrecisionWithReference``,
``LLMContextPrecisionWithoutReference``, ``LLMContextRecall``) scoring one
``SingleTurnSample`` with ``single_turn_ascore``; the judge LLM is wrapped in
``ragas.llms.LlamaIndexLLMWrapper`` and the embedding model in
``ragas.embeddings.LlamaIndexEmbeddingsWrapper``. These are RAGAS 0.4's LlamaIndex-compatible
("legacy") metrics: its newer ``ragas.metrics.collections`` accept only instructor/OpenAI-client
LLMs, not LlamaIndex ones.

Metric names and what they need:

- ``faithfulness``: share of the answer's statements the retrieved contexts support.
- ``answer_relevancy``: a question regenerated from the answer, compared with the real one by
  embedding cosine (0 when the answer is non-committal). RAGAS asks for 3 generations; its
  LlamaIndex wrapper returns one per call, so one regenerated question is compared
  (``strictness=1``). Needs an embedding model.
- ``context_precision``: whether the useful contexts are ranked first (average precision),
  usefulness judged against the reference answer. Only with a reference.
- ``context_utilization``: the same, judged against the engine's own answer (RAGAS's
  ``LLMContextPrecisionWithoutReference``). Only without a reference, so the two never mix.
- ``context_recall``: share of the reference answer's sentences attributable to the contexts.
  Only with a reference.

RAGAS's usage telemetry is turned off (``RAGAS_DO_NOT_TRACK=true``) unless the environment says
otherwise. Its internal retries are off too: the evaluation runner retries and times out.
"""

from __future__ import annotations

import logging
import math
import os
import warnings
from typing import Any

from llama_index.packs.self_rag_rse.common.optional import optional_import
from llama_index.packs.self_rag_rse.evaluation.protocol import (
    Judge,
    JudgementError,
    Sample,
    embed_label,
    llm_label,
)

logger = logging.getLogger(__name__)

#: Every metric this judge scores, in report order.
RAGAS_METRICS = (
    "faithfulness",
    "answer_relevancy",
    "context_precision",
    "context_utilization",
    "context_recall",
)
_NEEDS_CONTEXTS = {"faithfulness", "context_precision", "context_utilization", "context_recall"}
_NEEDS_REFERENCE = {"context_precision", "context_recall"}


def ragas_available() -> bool:
    """Whether ``ragas`` imports here (its LlamaIndex wrappers included)."""
    try:
        _import_ragas()
    except ImportError:
        return False
    return True


def _import_ragas() -> dict[str, Any]:
    os.environ.setdefault("RAGAS_DO_NOT_TRACK", "true")
    ragas = optional_import("ragas", "RAGAS metrics", "eval")
    with warnings.catch_warnings():
        # ragas 0.4 marks these imports deprecated in favour of metric collections that take
        # only instructor/OpenAI-client LLMs; they are its LlamaIndex-compatible path.
        warnings.simplefilter("ignore", DeprecationWarning)
        from ragas import SingleTurnSample
        from ragas.embeddings import LlamaIndexEmbeddingsWrapper
        from ragas.exceptions import RagasOutputParserException
        from ragas.llms import LlamaIndexLLMWrapper
        from ragas.metrics import (
            AnswerRelevancy,
            Faithfulness,
            LLMContextPrecisionWithoutReference,
            LLMContextPrecisionWithReference,
            LLMContextRecall,
        )
        from ragas.run_config import RunConfig
    return {
        "version": getattr(ragas, "__version__", "?"),
        "SingleTurnSample": SingleTurnSample,
        "LlamaIndexLLMWrapper": LlamaIndexLLMWrapper,
        "LlamaIndexEmbeddingsWrapper": LlamaIndexEmbeddingsWrapper,
        "Faithfulness": Faithfulness,
        "AnswerRelevancy": AnswerRelevancy,
        "LLMContextPrecisionWithReference": LLMContextPrecisionWithReference,
        "LLMContextPrecisionWithoutReference": LLMContextPrecisionWithoutReference,
        "LLMContextRecall": LLMContextRecall,
        "RunConfig": RunConfig,
        "RagasOutputParserException": RagasOutputParserException,
    }


class RagasJudge(Judge):
    """RAGAS metrics judged by a LlamaIndex LLM (see the module docstring for each metric).

    Args:
        llm: the judge, any LlamaIndex LLM (keep it separate from the answering model).
        embed_model: a LlamaIndex embedding model for ``answer_relevancy``; without one that
            metric is left out.
        name: overrides the judge's identity in the cache and report (default: RAGAS version,
            LLM class and model).

    Example::

        judge = RagasJudge(OpenAILike(model="qwen2.5-7b-instruct", api_base=URL), embed_model)
        result = evaluate(engines, questions, judge=judge)
    """

    backend = "ragas"

    def __init__(self, llm: Any, embed_model: Any = None, *, name: str | None = None) -> None:
        ragas = _import_ragas()
        self.llm = llm
        self.embed_model = embed_model
        self.version = str(ragas["version"])
        self._sample_type = ragas["SingleTurnSample"]
        self._parser_error = ragas["RagasOutputParserException"]
        # One attempt per call: the runner owns retries and timeouts.
        run_config = ragas["RunConfig"](max_retries=1, max_wait=1, timeout=24 * 3600)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            wrapped = ragas["LlamaIndexLLMWrapper"](llm, run_config=run_config)
            embeddings = (
                ragas["LlamaIndexEmbeddingsWrapper"](embed_model, run_config=run_config)
                if embed_model is not None
                else None
            )
        metrics: dict[str, Any] = {
            "faithfulness": ragas["Faithfulness"](llm=wrapped),
            "context_precision": ragas["LLMContextPrecisionWithReference"](llm=wrapped),
            "context_utilization": ragas["LLMContextPrecisionWithoutReference"](llm=wrapped),
            "context_recall": ragas["LLMContextRecall"](llm=wrapped),
        }
        if embeddings is not None:
            metrics["answer_relevancy"] = ragas["AnswerRelevancy"](
                llm=wrapped, embeddings=embeddings, strictness=1
            )
        else:
            logger.info("RagasJudge: no embed_model, so answer_relevancy is left out")
        for metric in metrics.values():
            metric.init(run_config)
        self._metrics = metrics
        self._identity = name or f"ragas {self.version} / {llm_label(llm)}"

    @property
    def identity(self) -> str:
        """``ragas <version> / <LLM class>(<model>)`` unless ``name`` was given."""
        return self._identity

    @property
    def metric_names(self) -> tuple[str, ...]:
        """The metrics of :data:`RAGAS_METRICS` this judge has (``answer_relevancy`` needs an
        embedding model)."""
        return tuple(m for m in RAGAS_METRICS if m in self._metrics)

    def applicable(self, metric: str, sample: Sample) -> bool:
        """Contexts for the context metrics and faithfulness; a reference for precision and
        recall, none for utilization."""
        if metric not in self._metrics:
            return False
        if metric in _NEEDS_CONTEXTS and not sample.contexts:
            return False
        if metric in _NEEDS_REFERENCE and not sample.reference:
            return False
        return not (metric == "context_utilization" and sample.reference)

    async def ascore(self, metric: str, sample: Sample) -> float:
        """Score ``sample`` with the RAGAS metric object.

        Replies RAGAS could not parse (after its own format-fixing retries) and NaN scores raise
        :class:`JudgementError`; other errors (the judge's server) pass through.
        """
        ragas_sample = self._sample_type(
            user_input=sample.question,
            response=sample.answer,
            retrieved_contexts=list(sample.contexts),
            reference=sample.reference,
        )
        try:
            value = await self._metrics[metric].single_turn_ascore(ragas_sample)
        except self._parser_error as error:
            raise JudgementError(f"ragas {metric}: {error}") from error
        score = float(value) if value is not None else math.nan
        if math.isnan(score):
            raise JudgementError(
                f"ragas {metric} gave no score (NaN): the judge's replies held nothing to "
                "count (e.g. no statements extracted)"
            )
        return score

    def describe(self) -> dict[str, Any]:
        """Implementation, judge model, embedding model and metrics."""
        return {
            **super().describe(),
            "library": f"ragas {self.version}",
            "llm": llm_label(self.llm),
            "embed_model": embed_label(self.embed_model) if self.embed_model else None,
        }
