"""Run query engines over one question set, judge every answer, resume after a crash.

Queries run one at a time (latencies do not inflate each other); each (answer, metric) is one job
for core's ``run_jobs``; each finished item is cached at once, failures never, so a rerun does only
what is missing or failed.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tenacity
from llama_index.core.async_utils import run_jobs
from llama_index.core.base.base_query_engine import BaseQueryEngine
from llama_index.core.bridge.pydantic import BaseModel, ConfigDict, Field
from llama_index.core.evaluation import BaseEvaluator
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events import llm as events
from llama_index.core.instrumentation.span_handlers import NullSpanHandler
from llama_index.core.utils import get_tqdm_iterable

from llama_index.packs.self_rag_rse.common.bridge import run_sync
from llama_index.packs.self_rag_rse.common.tracing import CRITIC_MODELS
from llama_index.packs.self_rag_rse.common.urls import mask_url
from llama_index.packs.self_rag_rse.evaluation import judges
from llama_index.packs.self_rag_rse.evaluation import questions as qs
from llama_index.packs.self_rag_rse.evaluation.names import EVIDENCE_METRICS
from llama_index.packs.self_rag_rse.evaluation.report import EvaluationResult, Record

logger = logging.getLogger(__name__)
dispatcher = get_dispatcher(__name__)

#: Seconds between attempts of a judgement: 1, 2, 4, ... up to 30.
RETRY_WAIT = tenacity.wait_exponential(multiplier=1, max=30)


def evaluate(*args: Any, **options: Any) -> EvaluationResult:
    """:func:`aevaluate`, blocking (safe inside a running event loop, e.g. a notebook)."""
    return run_sync(aevaluate(*args, **options))


@dispatcher.span
async def aevaluate(
    engines: Mapping[str, BaseQueryEngine],
    questions: Iterable[str | qs.Question],
    judge: Mapping[str, BaseEvaluator] | Any = None,
    *,
    embed_model: Any = None,
    judge_name: str | None = None,
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
    """Answer ``questions`` with every engine (each blocking ``query`` in a worker thread), judge
    the answers and their ``source_nodes``, return every record.

    ``judge``: ``{metric: BaseEvaluator}`` (name its model in ``judge_name``: it keys the cached
    judgements), an LLM (the built-in metrics, with ``embed_model``) or ``None``. ``documents``
    place the evidence; ``cache`` (a ``.jsonl`` path) resumes, under ``settings_key``; ``workers``
    judgements in flight, each attempt bounded by ``timeout_s``, ``retries`` more after a timeout or
    a server's error; ``settings`` and ``notes`` go into the report.
    """
    if not engines:
        raise ValueError("pass at least one engine: {name: query engine}")
    if workers < 1 or retries < 0:
        raise ValueError(
            f"workers must be 1 or more, retries 0 or more: got {workers}, {retries}; pass "
            "workers=1 or more (judgements in flight) and retries=0 or more (extra attempts)"
        )
    if not (items := qs.questions_from(questions, documents)):
        raise ValueError("pass at least one question")
    facts = None
    if judge is not None:
        # A mapping is the judge itself; an LLM judges the built-in metrics.
        llm = None if isinstance(judge, Mapping) else judge
        judge = dict(judge) if llm is None else judges.make_judge(llm, embed_model)
        facts = judges.describe_judge(judge, judge_name, llm)
    names = [*(judge or ()), *EVIDENCE_METRICS]
    if unknown := [metric for metric in metrics or () if metric not in names]:
        hint = "" if judge is not None else " (no judge: evidence metrics only)"
        raise ValueError(f"unknown metric(s) {unknown} for this judge; choose from {names}{hint}")
    wanted = set(names if metrics is None else metrics)
    store = cache if isinstance(cache, ResultCache) else ResultCache(cache)
    records = await _answer_all(
        engines,
        items,
        documents=documents,
        wanted=wanted,
        store=store,
        settings_key=settings_key,
        progress=progress,
    )
    if judge is not None and facts is not None:
        jobs = _judgement_jobs(
            records,
            judge,
            wanted=wanted,
            store=store,
            settings_key=settings_key,
            judge_identity=facts["identity"],
        )
        judgements = [
            _judge_one(job, store=store, timeout_s=timeout_s, retries=retries) for job in jobs
        ]
        await run_jobs(judgements, show_progress=progress and bool(judgements), workers=workers)
    if failed := [
        f"{metric} of {record.engine}: {error}"
        for record in records
        for metric, error in record.errors.items()
    ]:
        logger.warning(
            "%d item(s) failed (first: %s); they are left out of the means: rerun with the same "
            "cache to retry only those",
            len(failed),
            failed[0],
        )
    present = [metric for metric in names if any(metric in record.metrics for record in records)]
    return EvaluationResult(
        records=records,
        engines=list(engines),
        metrics=present,
        judge=facts["identity"] if facts is not None else None,
        settings={"judge": facts, **dict(settings or {})},
        notes=list(notes),
    )


async def _answer_all(
    engines: Mapping[str, BaseQueryEngine],
    questions: Sequence[qs.Question],
    *,
    documents: Mapping[str, str] | None,
    wanted: set[str],
    store: ResultCache,
    settings_key: str,
    progress: bool,
) -> list[Record]:
    """A record of every engine's answer to every question, one query at a time, each answer
    taken from ``store`` when it holds one and put there when it is new.
    """
    records: list[Record] = []
    pairs = [(question, name, engine) for question in questions for name, engine in engines.items()]
    with ModelCallCounter() as counter:
        for question, name, engine in get_tqdm_iterable(pairs, progress, "answering"):
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
            # The evidence scores' gold is in the key: a question may be asked of two spans.
            gold = tuple(map(str, question.evidence_span or ()))
            key = (settings_key, question.question, name, *gold)
            value = store.get("answer", key)
            record.cached = value is not None
            if value is None:
                try:
                    value = await _answer(engine, question, documents, counter)
                except Exception as error:
                    record.errors["answer"] = mask_url(f"{type(error).__name__}: {error}")
                    logger.warning(
                        "engine %s failed on %r: %s", name, question.question, mask_url(str(error))
                    )
                    continue
                store.put("answer", key, value)
            record.answer = value["answer"]
            record.contexts = list(value["contexts"])
            record.latency_s = value["latency_s"]
            record.model_calls = value["model_calls"]
            record.model_calls_detail = dict(value.get("model_calls_detail", {}))
            evidence = value.get("evidence", {}).items()
            record.metrics.update((metric, score) for metric, score in evidence if metric in wanted)
    return records


@dataclass
class JudgementJob:
    """One judgement still to make: ``metric`` of ``record``'s answer by ``evaluator``, cached
    under ``key`` once made.
    """

    record: Record
    metric: str
    evaluator: BaseEvaluator
    key: tuple[str, ...]


def _judgement_jobs(
    records: Sequence[Record],
    judge: Mapping[str, BaseEvaluator],
    *,
    wanted: set[str],
    store: ResultCache,
    settings_key: str,
    judge_identity: str,
) -> list[JudgementJob]:
    """The judgements ``store`` does not hold, of every wanted metric that applies to an answer;
    a cached score goes into its record at once.
    """
    jobs = []
    for record in records:
        if "answer" in record.errors or not record.answer.strip():
            continue
        # What was judged is in the key, so a new answer is judged afresh.
        judged = (record.answer, record.contexts, record.reference)
        digest = hashlib.sha256(json.dumps(judged).encode()).hexdigest()[:16]
        for metric, evaluator in judge.items():
            if metric not in wanted or not judges.applies(
                metric, record.contexts, record.reference
            ):
                continue
            key = (settings_key, record.question, record.engine, judge_identity, metric, digest)
            cached = store.get("judgement", key)
            # Each metric gets its place now, so the metrics keep the judge's order.
            record.metrics[metric] = None if cached is None else float(cached["score"])
            if cached is None:
                jobs.append(
                    JudgementJob(record=record, metric=metric, evaluator=evaluator, key=key)
                )
    return jobs


async def _answer(
    engine: BaseQueryEngine,
    question: qs.Question,
    documents: Mapping[str, str] | None,
    counter: ModelCallCounter,
) -> dict[str, Any]:
    """One engine's answer: text, contexts, latency, model calls and evidence scores."""
    counter.reset()
    started = time.perf_counter()
    # The blocking ``query`` in a worker thread: many engines' async paths need clients they were
    # not given (Qdrant local mode has none), and a copy of this context leaks no query's state.
    response = await asyncio.to_thread(_query, engine, question.question)
    latency = time.perf_counter() - started
    calls = counter.counts()
    texts, spans, unplaced = qs.retrieved_contexts(response.source_nodes or [], documents)
    gold = question.evidence_span
    scores = qs.evidence_scores(gold, spans, unplaced) if gold is not None else (None, None)
    pairs = zip(EVIDENCE_METRICS, scores, strict=True)
    return {
        "answer": str(response.response or ""),
        "contexts": texts,
        "evidence": {metric: score for metric, score in pairs if score is not None},
        "latency_s": round(latency, 4),
        "model_calls": calls.pop("model_calls"),
        "model_calls_detail": calls,
    }


def _query(engine: BaseQueryEngine, question: str) -> Any:
    """``engine.query(question)``, a streamed response read to its end (latency included)."""
    response = engine.query(question)
    return response if hasattr(response, "response") else response.get_response()


async def _judge_one(
    job: JudgementJob, *, store: ResultCache, timeout_s: float | None, retries: int
) -> None:
    """One judgement into its record and the cache; never raises. A timeout or a server's error
    is tried again after a wait, an unreadable reply (``JudgementError``) is not: same reply.
    """
    record = job.record
    attempts = tenacity.AsyncRetrying(
        stop=tenacity.stop_after_attempt(retries + 1),
        wait=RETRY_WAIT,
        # An unreadable reply would be read the same way again.
        retry=tenacity.retry_if_not_exception_type(judges.JudgementError),
        reraise=True,
    )
    try:
        async for attempt in attempts:
            with attempt:
                judgement = judges.ascore(
                    job.metric,
                    job.evaluator,
                    query=record.question,
                    response=record.answer,
                    contexts=record.contexts,
                    reference=record.reference,
                )
                score = await asyncio.wait_for(judgement, timeout_s)
    except asyncio.TimeoutError:
        record.errors[job.metric] = f"TimeoutError: no judgement within {timeout_s} s"
        return
    except Exception as error:
        record.errors[job.metric] = mask_url(f"{type(error).__name__}: {error}")
        return
    store.put("judgement", job.key, {"score": score})
    record.metrics[job.metric] = score


class _Shape(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False)


class _Line(_Shape):
    kind: str
    key: list[str]
    value: dict[str, Any]


class _Answer(_Shape):
    answer: str
    contexts: list[str]
    latency_s: float
    model_calls: int
    model_calls_detail: dict[str, int] = Field(default_factory=dict)
    evidence: dict[str, float] = Field(default_factory=dict)


class _Judgement(_Shape):
    score: float


#: The shape the runner reads of each kind of cached value.
SHAPES: dict[str, type[_Shape]] = {"answer": _Answer, "judgement": _Judgement}


class ResultCache:
    """Finished answers and judgements by ``(kind, key)``, in memory and in a ``.jsonl`` file; a
    damaged line or a value not of :data:`SHAPES` is skipped (warning: file, line) and redone.
    """

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self._items: dict[tuple[str, tuple[str, ...]], dict[str, Any]] = {}
        if self.path is not None and self.path.is_dir():
            raise ValueError(f"the cache {self.path} is a folder: pass the path of a .jsonl file")
        data = self.path.read_bytes() if self.path is not None and self.path.exists() else b""
        bad = []
        for number, raw in enumerate(data.split(b"\n"), start=1):
            try:  # pydantic's ValidationError is a ValueError
                if raw.strip():
                    line = _Line.model_validate(json.loads(raw))  # it reads "\udc80" too
                    SHAPES.get(line.kind, _Shape).model_validate(line.value)
                    self._items[(line.kind, tuple(line.key))] = line.value
            except ValueError:
                bad.append(str(number))
        if bad:
            more = f" and {len(bad) - 10} more" if len(bad) > 10 else ""
            logger.warning(
                "%s: skipped damaged line(s) %s%s; their items are done again",
                path,
                ", ".join(bad[:10]),
                more,
            )
        # After a line cut short, the next record starts a new line (or it is glued to it and lost).
        self._newline_first = bool(data) and not data.endswith(b"\n")

    def __len__(self) -> int:
        return len(self._items)

    def get(self, kind: str, key: tuple[str, ...]) -> dict[str, Any] | None:
        """The value stored for ``(kind, key)``, or ``None``."""
        return self._items.get((kind, tuple(key)))

    def put(self, kind: str, key: tuple[str, ...], value: dict[str, Any]) -> None:
        """Store ``value`` and append it to the file at once."""
        self._items[(kind, tuple(key))] = value
        line = json.dumps({"kind": kind, "key": list(key), "value": value}, ensure_ascii=False)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8", errors="backslashreplace") as out:
                # After a line cut short (see __init__), a newline first.
                out.write(("\n" if self._newline_first else "") + line + "\n")
            self._newline_first = False


class ModelCallCounter:
    """Counts model calls through instrumentation while attached (``with ModelCallCounter() as
    counter:``), from core's LLM events: each start event is one call, unless it comes from
    inside a call already counted (``LlamaCPP.chat`` calling ``complete``: one request). A
    critic's own model (a llama.cpp decode, one call per sequence; a served model, one per
    completion request) sends these events too, named in their ``model_dict``
    (:data:`~llama_index.packs.self_rag_rse.common.tracing.CRITIC_MODELS`).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events = _EventSink(owner=self)
        self._spans = _SpanSink()
        self._spans.owner = self  # BaseSpanHandler's __init__ takes no extra fields
        self.reset()

    def reset(self) -> None:
        """Start counting from zero."""
        with self._lock:
            self._llm = 0
            self._critic = 0
            self._parents: dict[str, str | None] = {}
            #: The spans of the calls counted.
            self._calls: set[str] = set()

    def counts(self) -> dict[str, int]:
        """``llm_requests`` (calls through a LlamaIndex LLM), ``critic_calls`` (calls of a
        critic's own model) and ``model_calls`` (both).
        """
        with self._lock:
            return {
                "llm_requests": self._llm,
                "critic_calls": self._critic,
                "model_calls": self._llm + self._critic,
            }

    def __enter__(self) -> ModelCallCounter:
        get_dispatcher().add_event_handler(self._events)
        get_dispatcher().add_span_handler(self._spans)
        return self

    def __exit__(self, *exc_info: object) -> None:
        root = get_dispatcher()
        root.event_handlers[:] = [h for h in root.event_handlers if h is not self._events]
        root.span_handlers[:] = [h for h in root.span_handlers if h is not self._spans]

    def _on_event(self, event: BaseEvent) -> None:
        if not isinstance(event, (events.LLMChatStartEvent, events.LLMCompletionStartEvent)):
            return
        with self._lock:
            span = event.span_id
            while span is not None:
                if span in self._calls:
                    return  # a request made by a request already counted
                span = self._parents.get(span)
            if event.span_id is not None:
                self._calls.add(event.span_id)
            if event.model_dict.get("class_name") in CRITIC_MODELS:
                self._critic += 1
            else:
                self._llm += 1

    def _on_span(self, id_: str, parent: str | None) -> None:
        with self._lock:
            self._parents[id_] = parent


class _EventSink(BaseEventHandler):
    owner: Any = None

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        self.owner._on_event(event)


class _SpanSink(NullSpanHandler):
    """Sees each span open, with its parent; keeps no span."""

    owner: Any = None

    def span_enter(self, *args: Any, **kwargs: Any) -> None:
        # The dispatcher passes id_ and parent_id by name.
        self.owner._on_span(kwargs["id_"], kwargs.get("parent_id"))
