"""What an evaluation produced: one record per (question, engine), and summaries over questions.

Pure data: no model, no LlamaIndex. :meth:`EvaluationResult.save` writes ``records.json``,
``report.md`` and ``report.png`` through :mod:`.report`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

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
    """A metric over the questions of one engine: mean, sample standard deviation, quartiles."""

    mean: float | None
    std: float | None
    n: int
    failed: int
    values: tuple[float, ...] = ()

    @classmethod
    def of(cls, values: list[float | None]) -> MetricSummary:
        """Summarise scores; ``None`` entries count as failed."""
        ok = tuple(float(v) for v in values if v is not None and not math.isnan(v))
        failed = len(values) - len(ok)
        if not ok:
            return cls(None, None, 0, failed)
        mean = sum(ok) / len(ok)
        std = math.sqrt(sum((v - mean) ** 2 for v in ok) / (len(ok) - 1)) if len(ok) > 1 else 0.0
        return cls(mean, std, len(ok), failed, ok)


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
        out: list[float | None] = []
        for record in self.records:
            if record.engine != engine:
                continue
            if measure == "latency_s":
                out.append(record.latency_s)
            elif measure == "model_calls":
                out.append(None if record.model_calls is None else float(record.model_calls))
            elif measure in record.metrics:
                out.append(record.metrics[measure])
        return out

    def summary(self) -> dict[str, dict[str, MetricSummary]]:
        """``{engine: {measure: MetricSummary}}`` for every metric and cost measure."""
        return {
            engine: {
                measure: MetricSummary.of(self.values(engine, measure))
                for measure in [*self.metrics, *COST_MEASURES]
            }
            for engine in self.engines
        }

    @property
    def failures(self) -> list[tuple[str, str, str, str]]:
        """``(question, engine, metric or "answer", error)`` of every failed item."""
        return [
            (r.question, r.engine, metric, error)
            for r in self.records
            for metric, error in r.errors.items()
        ]

    def to_json(self) -> list[dict[str, Any]]:
        """The records as JSON-ready dicts (the content of ``records.json``)."""
        return [r.to_dict() for r in self.records]

    def save(self, out_dir: str | Path, *, plot: bool = True) -> dict[str, Path]:
        """Write ``records.json``, ``report.md`` and (with matplotlib) ``report.png``.

        Returns the paths written, keyed ``records``, ``report`` and ``chart``.
        """
        from llama_index.packs.self_rag_rse.evaluation.report import write_chart, write_markdown

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {"records": out / "records.json"}
        paths["records"].write_text(
            json.dumps(self.to_json(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
        )
        if plot:
            chart = write_chart(self, out / "report.png")
            if chart is not None:
                paths["chart"] = chart
        paths["report"] = write_markdown(self, out / "report.md", chart=paths.get("chart"))
        return paths
