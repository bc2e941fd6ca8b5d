"""What an evaluation produced and keeps: one record per (question, engine), summaries, the cache.

Records and summaries are plain data (:func:`.report.write_report` writes them out). The cache is
an append-only JSON-lines file, so a rerun after a crash resumes where the last run stopped: one
line per finished answer or judgement, flushed as it is written. A line cut short by a crash is
skipped on reading (with one warning) and its item done again; failures are never written, so a
rerun retries exactly those.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: Per-question measures that are not judgements, reported beside the metrics.
COST_MEASURES = ("latency_s", "model_calls")


@dataclass
class Record:
    """One engine's answer to one question, with its costs and scores.

    ``metrics`` maps a metric name to its score, or ``None`` when its judgement failed
    (``errors`` says why); a metric that does not apply (no reference, no contexts) is absent.
    ``model_calls_detail`` splits ``model_calls`` into LLM requests and critic operations.
    ``cached`` says whether the answer came from the cache of an earlier run.
    """

    question: str
    engine: str
    answer: str
    latency_s: float | None
    model_calls: int | None
    metrics: dict[str, float | None] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    contexts: list[str] = field(default_factory=list)
    reference: str | None = None
    document: str | None = None
    model_calls_detail: dict[str, int] = field(default_factory=dict)
    cached: bool = False

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (NaN never appears: failed scores are ``None``)."""
        return asdict(self)


@dataclass(frozen=True)
class MetricSummary:
    """A metric over the questions of one engine: mean and sample standard deviation."""

    mean: float | None
    std: float | None
    n: int
    failed: int
    values: tuple[float, ...] = ()

    @classmethod
    def of(cls, values: list[float | None]) -> MetricSummary:
        """Summarise scores; ``None`` (and NaN) entries count as failed."""
        ok = tuple(float(v) for v in values if v is not None and not math.isnan(v))
        if not ok:
            return cls(None, None, 0, len(values))
        std = statistics.stdev(ok) if len(ok) > 1 else 0.0
        return cls(statistics.fmean(ok), std, len(ok), len(values) - len(ok), ok)


@dataclass
class EvaluationResult:
    """Records of every (question, engine), in question order then engine order.

    ``metrics`` lists the metric names that appear, in report order; ``settings`` holds what the
    report prints about the run (models, judge, command line); ``notes`` are caveats the report
    shows first.
    """

    records: list[Record]
    engines: list[str]
    metrics: list[str]
    judge: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def values(self, engine: str, measure: str) -> list[float | None]:
        """Per-question values of a metric or cost measure for one engine (``None``: failed)."""
        rows = [r for r in self.records if r.engine == engine]
        if measure in COST_MEASURES:
            return [None if (v := getattr(r, measure)) is None else float(v) for r in rows]
        return [r.metrics[measure] for r in rows if measure in r.metrics]

    def summary(self) -> dict[str, dict[str, MetricSummary]]:
        """``{engine: {measure: MetricSummary}}`` for every metric and cost measure."""
        measures = [*self.metrics, *COST_MEASURES]
        return {e: {m: MetricSummary.of(self.values(e, m)) for m in measures} for e in self.engines}

    @property
    def failures(self) -> list[tuple[str, str, str, str]]:
        """``(question, engine, metric or "answer", error)`` of every failed item."""
        return [
            (r.question, r.engine, m, error) for r in self.records for m, error in r.errors.items()
        ]

    def to_json(self) -> list[dict[str, Any]]:
        """The records as JSON-ready dicts (the content of ``records.json``)."""
        return [r.to_dict() for r in self.records]


class ResultCache:
    """Finished answers and judgements by ``(kind, key)``, in memory and (with ``path``) in a
    ``.jsonl`` file."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self._items: dict[tuple[str, tuple[str, ...]], dict[str, Any]] = {}
        text = self.path.read_text(encoding="utf-8") if self.path and self.path.exists() else ""
        bad = 0
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                self._items[(item["kind"], tuple(item["key"]))] = item["value"]
            except (json.JSONDecodeError, KeyError, TypeError):
                bad += 1
        if bad:
            logger.warning(
                "%s: skipped %d unreadable line(s) (a run cut short?); those items are redone",
                self.path,
                bad,
            )
        # A run cut short mid-line leaves no final newline: the next record starts a new line,
        # or it would be glued to the broken one and lost with it.
        self._newline_first = bool(text) and not text.endswith("\n")

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
            with self.path.open("a", encoding="utf-8") as out:
                out.write(("\n" if self._newline_first else "") + line + "\n")
            self._newline_first = False
