"""Run query engines over one question set, judge every answer, resume after a crash.

Two phases. **Answering**: every engine answers every question, one query at a time (so
latencies are not inflated by each other and model calls can be counted per query), question by
question so load noise spreads over all engines alike. **Judging**: every (answer, metric) the
judge can score runs concurrently, at most ``workers`` at once, each with a timeout and retries;
a failure is recorded in its record and never stops the run.

Both phases write each finished item to the cache at once; a rerun with the same cache reuses
answers (keyed by settings, question, engine) and judgements (keyed by settings, question,
engine, judge identity, metric and a digest of the judged answer and contexts), and does only
what is missing, including what failed before.
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
from llama_index.core.instrumentation import get_dispatcher

from llama_index.packs.self_rag_rse.common.bridge import run_sync
from llama_index.packs.self_rag_rse.evaluation.cache import ResultCache
from llama_index.packs.self_rag_rse.evaluation.calls import ModelCallCounter
from llama_index.packs.self_rag_rse.evaluation.contexts import retrieved_contexts
from llama_index.packs.self_rag_rse.evaluation.evidence import evidence_scores
from llama_index.packs.self_rag_rse.evaluation.protocol import Judge, JudgementError, Sample
from llama_index.packs.self_rag_rse.evaluation.questions import Question, questions_from
from llama_index.packs.self_rag_rse.evaluation.result import EvaluationResult, Record

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
        engines: ``{name: query engine}``, e.g. from :func:`.engines.default_engines`. Each
            engine's blocking ``query`` runs in a worker thread, one query at a time; its
            ``source_nodes`` are the contexts judged.
        questions: strings or :class:`~.questions.Question` (with ``document``/``evidence``
            for evidence recall/precision, ``reference`` for the reference-based metrics).
        judge: a :class:`~.protocol.Judge`, or a LlamaIndex LLM (wrapped by
            :func:`.llamaindex_judge.make_judge`: RAGAS when installed, else LlamaIndex's
            evaluators), or ``None`` (no judged metric: evidence, latency and model calls only).
        embed_model: with an LLM as ``judge``, the embedding model its metrics use.
        documents: ``{file name: text}`` the evidence is located in (see
            :func:`.questions.read_documents`).
        metrics: the metrics to compute (judge metrics and/or ``evidence_recall``,
            ``evidence_precision``); default: all that apply.
        cache: a ``.jsonl`` path (or a :class:`~.cache.ResultCache`) to resume from and append
            to; ``None`` keeps nothing between runs.
        settings_key: a string naming whatever changes the answers (models, documents, engine
            options): answers and judgements cached under another key are not reused.
        workers: judgements in flight at once.
        timeout_s: per judgement attempt (``None``: no limit). An in-process model that blocks
            the event loop cannot be interrupted; the limit applies to awaitable judges.
        retries: extra attempts within this run for a judgement that timed out or raised
            (a server error); an unreadable reply (:class:`~.protocol.JudgementError`) is not
            asked again until the next run.
        progress: show progress bars (tqdm, when installed).
        settings, notes: copied into the result for the report.
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
        from llama_index.packs.self_rag_rse.evaluation.llamaindex_judge import make_judge

        judge = make_judge(judge, embed_model)
    wanted = _check_metrics(metrics, judge)
    store = cache if isinstance(cache, ResultCache) else ResultCache(cache)

    records = await _answer_all(engines, items, documents, store, settings_key, wanted, progress)
    if judge is not None:
        await _judge_all(
            records, judge, store, settings_key, wanted, workers, timeout_s, retries, progress
        )
    failed_answers = sum(1 for r in records if "answer" in r.errors)
    failed = sum(len(r.errors) for r in records) - failed_answers
    if failed:
        first = next(
            f"{metric} of {r.engine} on {r.question!r}: {error}"
            for r in records
            for metric, error in r.errors.items()
            if metric != "answer"
        )
        logger.warning(
            "%d judgement(s) failed and are left out of the means (first: %s); "
            "rerun with the same cache to retry only those",
            failed,
            first,
        )
    present = {m for r in records for m in r.metrics}
    order = [*(judge.metric_names if judge is not None else ()), *EVIDENCE_METRICS]
    return EvaluationResult(
        records=records,
        engines=list(engines),
        metrics=[m for m in order if m in present],
        judge=judge.identity if judge is not None else None,
        settings={**dict(settings or {}), "judge": judge.describe() if judge else None},
        notes=list(notes),
    )


def _check_metrics(metrics: Sequence[str] | None, judge: Judge | None) -> set[str] | None:
    if metrics is None:
        return None
    valid = [*(judge.metric_names if judge is not None else ()), *EVIDENCE_METRICS]
    unknown = [m for m in metrics if m not in valid]
    if unknown:
        raise ValueError(
            f"unknown metric(s) {unknown} for this judge; choose from {valid}"
            + ("" if judge is not None else " (no judge: evidence metrics only)")
        )
    return set(metrics)


# -- answering ---------------------------------------------------------------------------------


async def _answer_all(
    engines: Mapping[str, BaseQueryEngine],
    questions: list[Question],
    documents: Mapping[str, str] | None,
    store: ResultCache,
    settings_key: str,
    wanted: set[str] | None,
    progress: bool,
) -> list[Record]:
    records: list[Record] = []
    todo: list[tuple[Record, Question, BaseQueryEngine]] = []
    for question in questions:
        for name, engine in engines.items():
            record = Record(
                question=question.question,
                engine=name,
                answer="",
                latency_s=None,
                model_calls=None,
                reference=question.reference,
                document=question.document,
            )
            records.append(record)
            cached = store.get("answer", (settings_key, question.question, name))
            if cached is not None:
                _fill(record, cached, wanted)
                record.cached = True
            else:
                todo.append((record, question, engine))
    if not todo:
        return records
    bar = _progress(len(todo), "answering", progress)
    with ModelCallCounter() as counter:
        for record, question, engine in todo:
            counter.reset()
            started = time.perf_counter()
            try:
                # The blocking ``query`` in a worker thread: many engines' async paths need
                # clients they were not given (Qdrant local mode has no async client), and the
                # thread gets a copy of this context, so no query's state leaks into the next.
                response = await asyncio.to_thread(engine.query, question.question)
            except Exception as error:
                record.errors["answer"] = f"{type(error).__name__}: {error}"
                logger.warning("engine %s failed on %r: %s", record.engine, record.question, error)
                bar.update(1)
                continue
            latency = time.perf_counter() - started
            calls = counter.counts()
            found = retrieved_contexts(getattr(response, "source_nodes", None) or [], documents)
            value: dict[str, Any] = {
                "answer": str(getattr(response, "response", None) or ""),
                "contexts": found.texts,
                "latency_s": round(latency, 4),
                "model_calls": calls["model_calls"],
                "model_calls_detail": {k: v for k, v in calls.items() if k != "model_calls"},
                "evidence": _evidence(question, found.spans, found.unplaced_chars),
            }
            store.put("answer", (settings_key, question.question, record.engine), value)
            _fill(record, value, wanted)
            bar.update(1)
    bar.close()
    return records


def _evidence(question: Question, spans: list[Any], unplaced: int) -> dict[str, float]:
    if question.evidence_span is None:
        return {}
    recall, precision = evidence_scores(question.evidence_span, spans, unplaced)
    scores = {"evidence_recall": recall}
    if precision is not None:
        scores["evidence_precision"] = precision
    return scores


def _fill(record: Record, value: Mapping[str, Any], wanted: set[str] | None) -> None:
    record.answer = value["answer"]
    record.contexts = list(value["contexts"])
    record.latency_s = value["latency_s"]
    record.model_calls = value["model_calls"]
    record.model_calls_detail = dict(value.get("model_calls_detail", {}))
    for metric, score in value.get("evidence", {}).items():
        if wanted is None or metric in wanted:
            record.metrics[metric] = score


# -- judging -----------------------------------------------------------------------------------


async def _judge_all(
    records: list[Record],
    judge: Judge,
    store: ResultCache,
    settings_key: str,
    wanted: set[str] | None,
    workers: int,
    timeout_s: float | None,
    retries: int,
    progress: bool,
) -> None:
    jobs: list[tuple[Record, Sample, str, tuple[str, ...]]] = []
    for record in records:
        if "answer" in record.errors or not record.answer.strip():
            continue
        sample = Sample(record.question, record.answer, tuple(record.contexts), record.reference)
        digest = _digest(sample)
        for metric in judge.metric_names:
            if (wanted is not None and metric not in wanted) or not judge.applicable(
                metric, sample
            ):
                continue
            key = (settings_key, record.question, record.engine, judge.identity, metric, digest)
            cached = store.get("judgement", key)
            if cached is not None:
                record.metrics[metric] = float(cached["score"])
            else:
                jobs.append((record, sample, metric, key))
    if not jobs:
        return
    limit = asyncio.Semaphore(workers)
    bar = _progress(len(jobs), f"judging ({judge.backend})", progress)

    async def one(record: Record, sample: Sample, metric: str, key: tuple[str, ...]) -> None:
        async with limit:
            outcome = await _attempts(judge, metric, sample, timeout_s, retries)
            if isinstance(outcome, float):
                store.put("judgement", key, {"score": outcome})
                record.metrics[metric] = outcome
                record.errors.pop(metric, None)
            else:
                record.metrics[metric] = None
                record.errors[metric] = outcome
                logger.debug(
                    "%s of %s on %r failed: %s", metric, record.engine, record.question, outcome
                )
            bar.update(1)

    await asyncio.gather(*(one(*job) for job in jobs))
    bar.close()


async def _attempts(
    judge: Judge, metric: str, sample: Sample, timeout_s: float | None, retries: int
) -> float | str:
    """The score, or the last error as text. Timeouts and other failures (a server down)
    are tried again up to ``retries`` times; an unreadable reply (:class:`JudgementError`) is
    not: a greedy judge asked the same question replies the same. A rerun retries both."""
    error = ""
    for _ in range(retries + 1):
        try:
            score = float(await asyncio.wait_for(judge.ascore(metric, sample), timeout_s))
            if not math.isfinite(score):
                raise JudgementError(f"the judge returned {score}")
            return score
        except asyncio.TimeoutError:
            error = f"TimeoutError: no judgement within {timeout_s} s"
        except JudgementError as exc:
            return f"{type(exc).__name__}: {exc}"
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
    return error


def _digest(sample: Sample) -> str:
    """What was judged (answer, contexts, reference), so a new answer is judged afresh."""
    text = json.dumps([sample.answer, list(sample.contexts), sample.reference])
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


class _NoBar:
    def update(self, n: int = 1) -> None:
        """Nothing to show."""

    def close(self) -> None:
        """Nothing to close."""


def _progress(total: int, desc: str, enabled: bool) -> Any:
    """A tqdm bar when tqdm is installed and ``enabled``, else a silent stand-in."""
    if not enabled:
        return _NoBar()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, unit="item", leave=True)
