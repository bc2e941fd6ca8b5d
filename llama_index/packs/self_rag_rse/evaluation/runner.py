"""Run query engines over one question set, judge every answer, resume after a crash.

Queries run one at a time (latencies do not inflate each other); each (answer, metric) is one job
for core's ``run_jobs``; each finished item is cached at once, failures never, so a rerun does only
what is missing or failed.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import json
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
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
from llama_index.packs.self_rag_rse.critic.contract import BaseCritic
from llama_index.packs.self_rag_rse.evaluation import judges
from llama_index.packs.self_rag_rse.evaluation import questions as qs
from llama_index.packs.self_rag_rse.evaluation.report import EvaluationResult, Record

logger = logging.getLogger(__name__)
dispatcher = get_dispatcher(__name__)

#: Metrics computed from the retrieved text and the gold evidence, without any model.
EVIDENCE_METRICS = ("evidence_recall", "evidence_precision")
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
        raise ValueError(f"workers must be 1 or more, retries 0 or more: got {workers}, {retries}")
    if not (items := qs.questions_from(questions, documents)):
        raise ValueError("pass at least one question")
    facts = None
    if judge is not None:
        llm = None if isinstance(judge, Mapping) else judge
        judge = dict(judge) if llm is None else judges.make_judge(llm, embed_model)
        facts = judges.describe_judge(judge, judge_name, llm)
    names = [*(judge or ()), *EVIDENCE_METRICS]
    if unknown := [m for m in metrics or () if m not in names]:
        hint = "" if judge is not None else " (no judge: evidence metrics only)"
        raise ValueError(f"unknown metric(s) {unknown} for this judge; choose from {names}{hint}")
    wanted = set(names if metrics is None else metrics)
    store = cache if isinstance(cache, ResultCache) else ResultCache(cache)
    records: list[Record] = []
    pairs = [(q, name, engine) for q in items for name, engine in engines.items()]
    with ModelCallCounter() as counter:
        for question, name, engine in get_tqdm_iterable(pairs, progress, "answering"):
            record = Record(question.question, name, "", None, None, reference=question.reference)
            gold = tuple(map(str, question.evidence_span or ()))  # the evidence scores' gold
            record.document, key = question.document, (settings_key, question.question, name, *gold)
            records.append(record)
            value = store.get("answer", key)
            record.cached = value is not None
            if value is None:
                try:
                    value = await _answer(engine, question, documents, counter)
                except Exception as error:
                    record.errors["answer"] = f"{type(error).__name__}: {error}"
                    logger.warning("engine %s failed on %r: %s", name, question.question, error)
                    continue
                store.put("answer", key, value)
            record.answer, record.contexts = value["answer"], list(value["contexts"])
            record.latency_s, record.model_calls = value["latency_s"], value["model_calls"]
            record.model_calls_detail = dict(value.get("model_calls_detail", {}))
            evidence = value.get("evidence", {}).items()
            record.metrics.update((m, s) for m, s in evidence if m in wanted)
    if judge is not None and facts is not None:
        jobs = []
        for record in records:
            if "answer" in record.errors or not record.answer.strip():
                continue
            # What was judged is in the key, so a new answer is judged afresh.
            sample = (record.question, record.answer, record.contexts, record.reference)
            digest = hashlib.sha256(json.dumps(sample[1:]).encode()).hexdigest()[:16]
            for metric, evaluator in judge.items():
                if metric not in wanted or not judges.applies(metric, *sample[2:]):
                    continue
                where = (settings_key, record.question, record.engine, facts["identity"], metric)
                cached = store.get("judgement", (*where, digest))
                # Each metric gets its place now, so the metrics keep the judge's order.
                record.metrics[metric] = None if cached is None else float(cached["score"])
                if cached is None:
                    job = (record, metric, evaluator, sample, (*where, digest))
                    jobs.append(_judge_one(job, store, timeout_s, retries))
        await run_jobs(jobs, show_progress=progress and bool(jobs), workers=workers)
    if failed := [f"{m} of {r.engine}: {e}" for r in records for m, e in r.errors.items()]:
        why = f"{len(failed)} item(s) failed (first: {failed[0]})"
        logger.warning("%s; left out of the means, retried by a rerun on the same cache", why)
    present = [m for m in names if any(m in r.metrics for r in records)]
    identity, report = (facts or {}).get("identity"), {"judge": facts, **dict(settings or {})}
    return EvaluationResult(records, list(engines), present, identity, report, list(notes))


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
    latency, calls = time.perf_counter() - started, counter.counts()
    texts, spans, unplaced = qs.retrieved_contexts(response.source_nodes or [], documents)
    gold = question.evidence_span
    scores = qs.evidence_scores(gold, spans, unplaced) if gold is not None else ()
    evidence = {m: s for m, s in zip(EVIDENCE_METRICS, scores, strict=False) if s is not None}
    value: dict[str, Any] = {"answer": str(response.response or ""), "contexts": texts}
    value.update(evidence=evidence, latency_s=round(latency, 4))
    return {**value, "model_calls": calls.pop("model_calls"), "model_calls_detail": calls}


def _query(engine: BaseQueryEngine, question: str) -> Any:
    """``engine.query(question)``, a streamed response read to its end (latency included)."""
    response = engine.query(question)
    return response if hasattr(response, "response") else response.get_response()


async def _judge_one(
    job: tuple[Any, ...], store: ResultCache, timeout_s: float | None, retries: int
) -> None:
    """One judgement into its record and the cache; never raises. A timeout or a server's error
    is tried again after a wait, an unreadable reply (``JudgementError``) is not: same reply.
    """
    record, metric, evaluator, sample, key = job
    retry = tenacity.retry_if_not_exception_type(judges.JudgementError)
    attempts = tenacity.AsyncRetrying(
        stop=tenacity.stop_after_attempt(retries + 1), wait=RETRY_WAIT, retry=retry, reraise=True
    )
    try:
        async for attempt in attempts:
            with attempt:
                score = await asyncio.wait_for(judges.ascore(metric, evaluator, *sample), timeout_s)
    except Exception as error:
        timed_out = isinstance(error, asyncio.TimeoutError)
        why = f"no judgement within {timeout_s} s" if timed_out else str(error)
        record.errors[metric] = f"{'TimeoutError' if timed_out else type(error).__name__}: {why}"
        return
    store.put("judgement", key, {"score": score})
    record.metrics[metric] = score


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
            shown = ", ".join(bad[:10]) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
            logger.warning("%s: skipped damaged line(s) %s; their items are redone", path, shown)
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
                out.write(("\n" if self._newline_first else "") + line + "\n")
            self._newline_first = False


#: Methods of the critic contract whose spans count as model calls.
CRITIC_METHODS = frozenset({"adecide_retrieval", "ajudge", "agenerate"})

_DEPTH: contextvars.ContextVar[int] = contextvars.ContextVar("self_rag_rse_llm_depth", default=0)


class ModelCallCounter:
    """Counts model calls through instrumentation while attached (``with ModelCallCounter() as
    counter:``): LLM requests (one inside another, as ``LlamaCPP.chat`` calling ``complete``,
    once), plus each critic method's span with no LLM request in it (an in-process critic).
    """

    def __init__(self) -> None:
        self._lock, self._events = threading.Lock(), _EventSink(owner=self)
        self._spans = _SpanSink()
        self._spans.owner = self  # BaseSpanHandler's __init__ takes no extra fields
        self.reset()

    def reset(self) -> None:
        """Start counting from zero."""
        with self._lock:
            self._llm = 0
            self._parents: dict[str, str | None] = {}
            self._critic_spans: set[str] = set()
            self._critic_with_llm: set[str] = set()

    def counts(self) -> dict[str, int]:
        """``llm_requests``, ``critic_calls`` (those served without one) and ``model_calls``."""
        with self._lock:
            llm, native = self._llm, len(self._critic_spans - self._critic_with_llm)
        return {"llm_requests": llm, "critic_calls": native, "model_calls": llm + native}

    def __enter__(self) -> ModelCallCounter:
        get_dispatcher().add_event_handler(self._events)
        get_dispatcher().add_span_handler(self._spans)
        return self

    def __exit__(self, *exc_info: object) -> None:
        root = get_dispatcher()
        root.event_handlers[:] = [h for h in root.event_handlers if h is not self._events]
        root.span_handlers[:] = [h for h in root.span_handlers if h is not self._spans]

    def _on_event(self, event: BaseEvent) -> None:
        if isinstance(event, (events.LLMChatEndEvent, events.LLMCompletionEndEvent)):
            _DEPTH.set(max(0, _DEPTH.get() - 1))
        if not isinstance(event, (events.LLMChatStartEvent, events.LLMCompletionStartEvent)):
            return
        depth = _DEPTH.get()
        _DEPTH.set(depth + 1)
        if depth:
            return  # a request made by a request already counted
        with self._lock:
            self._llm += 1
            span: str | None = event.span_id
            while span is not None:
                if span in self._critic_spans:
                    self._critic_with_llm.add(span)
                span = self._parents.get(span)

    def _on_span(self, id_: str, parent: str | None, instance: Any) -> None:
        method = id_.rsplit("-", 5)[0].rsplit(".", 1)[-1]  # "Class.method-<uuid>"
        with self._lock:
            self._parents[id_] = parent
            if method in CRITIC_METHODS and isinstance(instance, BaseCritic):
                self._critic_spans.add(id_)


class _EventSink(BaseEventHandler):
    owner: Any = None

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        self.owner._on_event(event)


class _SpanSink(NullSpanHandler):
    """Sees each span open, with the instance whose method it wraps; keeps no span."""

    owner: Any = None

    def span_enter(self, *args: Any, **kwargs: Any) -> None:
        # The dispatcher passes id_, instance and parent_id by name.
        self.owner._on_span(kwargs["id_"], kwargs.get("parent_id"), kwargs.get("instance"))
