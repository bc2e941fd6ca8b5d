"""Run query engines over one question set, judge every answer, resume after a crash.

Answering: every engine answers every question, one query at a time (latencies do not inflate
each other; model calls are counted per query), question by question so load noise spreads over
all engines alike. Judging: every (answer, metric) goes through core's ``BatchEvalRunner`` as one
evaluator, :class:`_Judgement`, which adds what the runner lacks: a timeout per attempt, retries
that tell a server error from an unreadable reply, a failure recorded instead of raised. Each
finished item is cached at once, keyed by what it depends on, so a rerun does only what is
missing or failed.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from llama_index.core.base.base_query_engine import BaseQueryEngine
from llama_index.core.evaluation import BatchEvalRunner
from llama_index.core.evaluation import EvaluationResult as Judged
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.utils import get_tqdm_iterable

from llama_index.packs.self_rag_rse.common.bridge import run_sync
from llama_index.packs.self_rag_rse.evaluation.calls import ModelCallCounter
from llama_index.packs.self_rag_rse.evaluation.judges import (
    Judge,
    JudgementError,
    PromptlessEvaluator,
    Sample,
    make_judge,
)
from llama_index.packs.self_rag_rse.evaluation.questions import (
    Question,
    evidence_scores,
    questions_from,
    retrieved_contexts,
)
from llama_index.packs.self_rag_rse.evaluation.result import EvaluationResult, Record, ResultCache

logger = logging.getLogger(__name__)
dispatcher = get_dispatcher(__name__)

#: Metrics computed from the retrieved text and the gold evidence, without any model.
EVIDENCE_METRICS = ("evidence_recall", "evidence_precision")


def evaluate(
    engines: Mapping[str, BaseQueryEngine],
    questions: Iterable[str | Question],
    judge: Judge | Any = None,
    **options: Any,
) -> EvaluationResult:
    """Blocking :func:`aevaluate` (safe inside a running event loop, e.g. a notebook)."""
    return run_sync(aevaluate(engines, questions, judge, **options))


@dispatcher.span
async def aevaluate(
    engines: Mapping[str, BaseQueryEngine],
    questions: Iterable[str | Question],
    judge: Judge | Any = None,
    *,
    embed_model: Any = None,
    documents: Mapping[str, str] | None = None,
    metrics: Sequence[str] | None = None,
    cache: str | Path | ResultCache | None = None,
    settings_key: str = "",
    workers: int = 4,
    timeout_s: float | None = 600.0,
    retries: int = 1,
    progress: bool = True,
    settings: Mapping[str, Any] | None = None,
    notes: Sequence[str] = (),
) -> EvaluationResult:
    """Answer ``questions`` with every engine, judge the answers, return every record.

    Args:
        engines: ``{name: query engine}`` (e.g. :func:`.engines.default_engines`); each blocking
            ``query`` runs in a worker thread, one at a time; its ``source_nodes`` are judged.
        questions: strings or :class:`~.questions.Question` (``document``/``evidence`` give
            evidence recall/precision, ``reference`` the reference-based metrics).
        judge: a :class:`~.judges.Judge`, a LlamaIndex LLM (:func:`.judges.make_judge` with
            ``embed_model``) or ``None`` (evidence, latency and model calls only).
        documents: ``{file name: text}`` the evidence lies in (:func:`.questions.read_documents`).
        metrics: the metrics to compute (default: all that apply).
        cache: a ``.jsonl`` path (or :class:`~.result.ResultCache`) to resume from and append to.
        settings_key: names whatever changes the answers (models, documents, engine options):
            what was cached under another key is not reused.
        workers, timeout_s: judgements in flight; seconds per attempt (``None``: no limit; an
            in-process model blocking the event loop cannot be interrupted).
        retries: extra attempts after a timeout or an error (a server's); an unreadable reply
            (:class:`~.judges.JudgementError`) is only asked again in the next run.
        progress, settings, notes: progress bars; what the report says about the run.
    """
    if not engines:
        raise ValueError("pass at least one engine: {name: query engine}")
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    if retries < 0:
        raise ValueError(f"retries must be 0 or more, got {retries}")
    items = questions_from(questions, documents)
    if not items:
        raise ValueError("pass at least one question")
    if judge is not None and not isinstance(judge, Judge):
        judge = make_judge(judge, embed_model)
    names = [*(judge.metric_names if judge is not None else ()), *EVIDENCE_METRICS]
    if unknown := [m for m in metrics or () if m not in names]:
        raise ValueError(
            f"unknown metric(s) {unknown} for this judge; choose from {names}"
            + ("" if judge is not None else " (no judge: evidence metrics only)")
        )
    wanted = set(names if metrics is None else metrics)
    store = cache if isinstance(cache, ResultCache) else ResultCache(cache)

    records: list[Record] = []
    todo: list[tuple[Record, Question, BaseQueryEngine]] = []
    for question in items:
        for name, engine in engines.items():
            record = Record(question.question, name, "", None, None)
            record.reference, record.document = question.reference, question.document
            records.append(record)
            cached = store.get("answer", (settings_key, question.question, name))
            if cached is None:
                todo.append((record, question, engine))
            else:
                record.cached = True
                _fill(record, cached, wanted)
    with ModelCallCounter() as counter:
        for record, question, engine in get_tqdm_iterable(
            todo, progress and bool(todo), "answering"
        ):
            counter.reset()
            started = time.perf_counter()
            try:
                # The blocking ``query`` in a worker thread: many engines' async paths need
                # clients they were not given (Qdrant local mode has no async client), and the
                # thread gets a copy of this context, so no query's state leaks into the next.
                response = await asyncio.to_thread(_answer, engine, question.question)
            except Exception as error:
                record.errors["answer"] = f"{type(error).__name__}: {error}"
                logger.warning("engine %s failed on %r: %s", record.engine, record.question, error)
                continue
            latency, calls = time.perf_counter() - started, counter.counts()
            found = retrieved_contexts(getattr(response, "source_nodes", None) or [], documents)
            scores = (
                evidence_scores(question.evidence_span, found.spans, found.unplaced_chars)
                if question.evidence_span is not None
                else ()
            )
            value: dict[str, Any] = {
                "answer": str(getattr(response, "response", None) or ""),
                "contexts": found.texts,
                "latency_s": round(latency, 4),
                "model_calls": calls.pop("model_calls"),
                "model_calls_detail": calls,
                "evidence": {
                    m: s for m, s in zip(EVIDENCE_METRICS, scores, strict=False) if s is not None
                },
            }
            store.put("answer", (settings_key, question.question, record.engine), value)
            _fill(record, value, wanted)

    if judge is not None:
        await _judge_all(
            records, judge, store, settings_key, wanted, workers, timeout_s, retries, progress
        )
    failed = [
        f"{metric} of {r.engine} on {r.question!r}: {error}"
        for r in records
        for metric, error in r.errors.items()
        if metric != "answer"
    ]
    if failed:
        logger.warning(
            "%d judgement(s) failed and are left out of the means (first: %s); "
            "rerun with the same cache to retry only those",
            len(failed),
            failed[0],
        )
    present = {m for r in records for m in r.metrics}
    return EvaluationResult(
        records=records,
        engines=list(engines),
        metrics=[m for m in names if m in present],
        judge=judge.identity if judge is not None else None,
        settings={**dict(settings or {}), "judge": judge.describe() if judge else None},
        notes=list(notes),
    )


def _fill(record: Record, value: Mapping[str, Any], wanted: set[str]) -> None:
    """Copy a new or cached answer into ``record`` (of its evidence scores, the wanted ones)."""
    record.answer, record.contexts = value["answer"], list(value["contexts"])
    record.latency_s, record.model_calls = value["latency_s"], value["model_calls"]
    record.model_calls_detail = dict(value.get("model_calls_detail", {}))
    record.metrics.update((m, s) for m, s in value.get("evidence", {}).items() if m in wanted)


async def _judge_all(
    records: list[Record],
    judge: Judge,
    store: ResultCache,
    settings_key: str,
    wanted: set[str],
    workers: int,
    timeout_s: float | None,
    retries: int,
    progress: bool,
) -> None:
    """Judge every answer on every wanted, applicable metric whose score is not cached."""
    jobs: list[tuple[Record, Sample, str, tuple[str, ...]]] = []
    for record in records:
        if "answer" in record.errors or not record.answer.strip():
            continue
        sample = Sample(record.question, record.answer, tuple(record.contexts), record.reference)
        # What was judged is in the key, so a new answer is judged afresh.
        judged = json.dumps([sample.answer, list(sample.contexts), sample.reference])
        digest = hashlib.sha256(judged.encode("utf-8")).hexdigest()[:16]
        for metric in judge.metric_names:
            if metric not in wanted or not judge.applicable(metric, sample):
                continue
            key = (settings_key, record.question, record.engine, judge.identity, metric, digest)
            cached = store.get("judgement", key)
            # A job's score goes into its place, so the metrics keep the judge's order.
            record.metrics[metric] = float(cached["score"]) if cached is not None else None
            if cached is None:
                jobs.append((record, sample, metric, key))
    if jobs:
        judgement = _Judgement(judge, store, timeout_s, retries)
        runner = BatchEvalRunner({judge.backend: judgement}, workers, show_progress=progress)
        per_job: dict[str, Any] = {"job": jobs}  # each job's own keyword for the evaluator
        await runner.aevaluate_response_strs([j[1].question for j in jobs], **per_job)


class _Judgement(PromptlessEvaluator):
    """One judgement for ``BatchEvalRunner``, written into its record and the cache at once; it
    never raises, so one failure never stops the batch. A timeout or another error (a server
    down) is tried again up to ``retries`` times, an unreadable reply (:class:`JudgementError`)
    is not: a greedy judge asked the same question replies the same."""

    def __init__(
        self, judge: Judge, store: ResultCache, timeout_s: float | None, retries: int
    ) -> None:
        self.judge, self.store, self.timeout_s, self.retries = judge, store, timeout_s, retries

    async def aevaluate(
        self,
        query: str | None = None,
        response: str | None = None,
        contexts: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> Judged:
        """Judge the ``job`` keyword's ``(record, sample, metric, cache key)``."""
        record, sample, metric, key = kwargs["job"]
        error = ""
        for _ in range(self.retries + 1):
            try:
                score = float(
                    await asyncio.wait_for(self.judge.ascore(metric, sample), self.timeout_s)
                )
                if not math.isfinite(score):
                    raise JudgementError(f"the judge returned {score}")
            except asyncio.TimeoutError:
                error = f"TimeoutError: no judgement within {self.timeout_s} s"
                continue
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
                if isinstance(exc, JudgementError):
                    break
                continue
            self.store.put("judgement", key, {"score": score})
            record.metrics[metric] = score
            return Judged(query=query, score=score)
        record.errors[metric] = error
        logger.debug("%s of %s on %r failed: %s", metric, record.engine, record.question, error)
        return Judged(query=query, invalid_result=True, invalid_reason=error)


def _answer(engine: BaseQueryEngine, question: str) -> Any:
    """``engine.query(question)``, a streamed response read to its end (latency included)."""
    response = engine.query(question)
    read = getattr(response, "get_response", None)
    return read() if callable(read) and not hasattr(response, "response") else response
