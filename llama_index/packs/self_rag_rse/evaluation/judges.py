"""A judge is ``{metric name: BaseEvaluator}``: core's evaluators (``li_*`` metrics, so a table
never mixes them with RAGAS's), RAGAS's metrics wrapped by :class:`RagasMetric`, or your own;
:func:`ascore` reads one score, and raises :class:`JudgementError` when a reply holds none.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from llama_index.core import evaluation as core
from llama_index.core.prompts.mixin import PromptDictType

from llama_index.packs.self_rag_rse.common.optional import optional_import
from llama_index.packs.self_rag_rse.evaluation.names import (
    CONTEXTS,
    LLAMAINDEX_METRICS,
    NO_REFERENCE,
    RAGAS_METRICS,
    REFERENCE,
)


class JudgementError(RuntimeError):
    """The judge answered, but no score could be read from it (unparsable reply, NaN)."""


class RagasMetric(core.BaseEvaluator):
    """A RAGAS 0.4 metric object as a LlamaIndex evaluator: an unparsable reply raises
    :class:`JudgementError`; other errors (the judge's server) pass through, to be retried.
    """

    def __init__(self, name: str, metric: Any, version: str = "?") -> None:
        self.name = name
        self.metric = metric
        self.version = version

    def _get_prompts(self) -> PromptDictType:
        return {}  # the prompts live in the RAGAS metric

    def _update_prompts(self, prompts_dict: PromptDictType) -> None:
        """Nothing to update here: the prompts live in the RAGAS metric."""

    async def aevaluate(
        self,
        query: str | None = None,
        response: str | None = None,
        contexts: Sequence[str] | None = None,
        reference: str | None = None,
        **kwargs: Any,
    ) -> core.EvaluationResult:
        """Score the answer (no time limit here: the runner bounds each attempt)."""
        from ragas import SingleTurnSample
        from ragas.exceptions import RagasOutputParserException

        sample = SingleTurnSample(
            user_input=query,
            response=response,
            reference=reference,
            retrieved_contexts=list(contexts or ()),
        )
        try:
            score = await self.metric.single_turn_ascore(sample, timeout=None)
        except RagasOutputParserException as error:
            raise JudgementError(f"ragas {self.name}: {error}") from error
        return core.EvaluationResult(query=query, response=response, score=score)


def make_judge(
    llm: Any, embed_model: Any = None, *, backend: str = "auto"
) -> dict[str, core.BaseEvaluator]:
    """The built-in metrics judged by ``llm``, in report order: ``backend`` ``"ragas"``,
    ``"llamaindex"`` or ``"auto"`` (RAGAS when it imports; its telemetry off by default).
    ``answer_relevancy`` and ``li_semantic_similarity`` need ``embed_model``.
    """
    if backend not in ("auto", "ragas", "llamaindex"):
        raise ValueError(f"judge backend must be 'auto', 'ragas' or 'llamaindex', got {backend!r}")
    if backend != "llamaindex":
        try:
            return _ragas_judge(llm, embed_model)
        except ImportError:
            if backend == "ragas":
                raise
    judge: dict[str, core.BaseEvaluator] = {
        "li_faithfulness": core.FaithfulnessEvaluator(llm=llm),
        "li_relevancy": core.RelevancyEvaluator(llm=llm),
        "li_answer_relevancy": core.AnswerRelevancyEvaluator(llm=llm),
        "li_context_relevancy": core.ContextRelevancyEvaluator(llm=llm),
        "li_correctness": core.CorrectnessEvaluator(llm=llm),
    }
    if embed_model is not None:
        judge["li_semantic_similarity"] = core.SemanticSimilarityEvaluator(embed_model=embed_model)
    return judge


def _ragas_judge(llm: Any, embed_model: Any) -> dict[str, core.BaseEvaluator]:
    os.environ.setdefault("RAGAS_DO_NOT_TRACK", "true")
    ragas = optional_import("ragas", "RAGAS metrics", "eval")
    for module in ("embeddings", "exceptions", "llms", "metrics", "run_config"):
        importlib.import_module(f"ragas.{module}")  # an ImportError says how to install
    # One attempt per request: the runner retries a judgement, with backoff.
    config = ragas.run_config.RunConfig(max_retries=1, max_wait=1)
    metrics = ragas.metrics
    with warnings.catch_warnings():
        # Deprecated in ragas 0.4 for collections that take no LlamaIndex LLM: still the way in.
        warnings.simplefilter("ignore", DeprecationWarning)
        wrapped = ragas.llms.LlamaIndexLLMWrapper(llm, run_config=config)
        found: dict[str, Any] = {
            "faithfulness": metrics.Faithfulness(llm=wrapped),
            "context_precision": metrics.LLMContextPrecisionWithReference(llm=wrapped),
            "context_utilization": metrics.LLMContextPrecisionWithoutReference(llm=wrapped),
            "context_recall": metrics.LLMContextRecall(llm=wrapped),
        }
        if embed_model is not None:
            embed = ragas.embeddings.LlamaIndexEmbeddingsWrapper(embed_model, run_config=config)
            # One regenerated question: the wrapper returns one generation per call.
            found["answer_relevancy"] = metrics.AnswerRelevancy(
                llm=wrapped, embeddings=embed, strictness=1
            )
    for metric in found.values():
        metric.init(config)
    version = str(getattr(ragas, "__version__", "?"))
    return {n: RagasMetric(n, found[n], version) for n in RAGAS_METRICS if n in found}


def applies(metric: str, contexts: Sequence[str], reference: str | None) -> bool:
    """Whether ``metric`` can score an answer with these contexts and reference."""
    need = {**RAGAS_METRICS, **LLAMAINDEX_METRICS}.get(metric, set())
    missing = (CONTEXTS in need and not contexts) or (REFERENCE in need and not reference)
    # context_utilization is context_precision without a reference: never both for one answer.
    return not (missing or (NO_REFERENCE in need and reference))


async def ascore(
    metric: str,
    evaluator: core.BaseEvaluator,
    query: str,
    response: str,
    contexts: Sequence[str] = (),
    reference: str | None = None,
) -> float:
    """``evaluator``'s score of one answer (``li_*`` scores mapped into [0, 1]); raises
    :class:`JudgementError` when the reply holds no finite score, other errors pass through.
    """
    try:
        result = await evaluator.aevaluate(
            query=query, response=response, contexts=list(contexts), reference=reference
        )
    except ValueError as error:
        # CorrectnessEvaluator's parser raises on a reply without a score line.
        raise JudgementError(f"{metric}: unreadable reply ({error})") from error
    if result.invalid_result:
        raise JudgementError(f"{metric}: {result.invalid_reason or 'invalid result'}")
    if result.score is None:
        reply = " ".join(str(result.feedback or "").split())[:160]
        raise JudgementError(f"{metric}: no score in the judge's reply {reply!r}")
    if not math.isfinite(score := float(result.score)):
        # RAGAS gives NaN when the judge's replies held nothing to count (no statements).
        raise JudgementError(
            f"the judge returned {score} for {metric}: its replies held nothing to score (e.g. "
            "no statements taken from the answer); a more capable judge model gives one"
        )
    if metric == "li_correctness":
        score = (score - 1.0) / 4.0  # a 1-5 rubric
    return min(1.0, max(0.0, score)) if metric in LLAMAINDEX_METRICS else score


def describe_judge(judge: Mapping[str, core.BaseEvaluator], name: str | None, llm: Any) -> dict:
    """The judge's ``identity``, which keys its cached judgements (so a judge never reuses
    another's: name your evaluators' model in ``name``), and what the report says of it.
    """
    ragas = [e.version for e in judge.values() if isinstance(e, RagasMetric)]
    library = f"ragas {ragas[0]}" if ragas else "llama-index-core evaluators"
    who = (
        llm_label(llm)
        if llm is not None
        else ", ".join(type(evaluator).__name__ for evaluator in judge.values())
    )
    return {"identity": name or f"{library} / {who}", "metrics": list(judge)}


def llm_label(llm: Any) -> str:
    """A short, stable name for an LLM: class, model (a GGUF's name and size) and reply length."""
    model = str(getattr(llm, "model", "") or "")
    tokens = size = None
    with contextlib.suppress(Exception):  # a label must never fail
        metadata = llm.metadata
        name = str(metadata.model_name or "")
        tokens = metadata.num_output
        model = name  # only once both were read
        if model.endswith(".gguf"):
            # Two GGUFs of one name are told apart by their size.
            size = f"{Path(model).stat().st_size:,} bytes"
    # The reply length changes what a judge can say (a JSON list cut short fails to parse).
    parts = [Path(model).name if size else model, size, tokens and f"{tokens} tokens"]
    return f"{type(llm).__name__}({', '.join(part for part in parts if part)})".replace("()", "")


def embed_label(embed_model: Any) -> str:
    """A short, stable name for an embedding model (a local folder: its last two parts)."""
    name = str(getattr(embed_model, "model_name", "") or "")
    if Path(name).is_absolute():
        name = "/".join(Path(name).parts[-2:])
    return f"{type(embed_model).__name__}({name})" if name else type(embed_model).__name__
