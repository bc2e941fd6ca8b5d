"""What an evaluation produced (a :class:`Record` per question and engine) and its report:
``report.md`` (engines × metrics, mean ± sd), ``report.png`` (a panel per measure: mean, ± 1 sd,
a dot per question; drawn without pyplot) and ``records.json``.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from llama_index.packs.self_rag_rse.common.urls import mask_url

logger = logging.getLogger(__name__)

#: Per-question measures that are not judgements, reported beside the metrics.
COST_MEASURES = ("latency_s", "model_calls")


@dataclass
class Record:
    """One engine's answer to one question; a metric's score is ``None`` when its judgement
    failed (``errors`` says why), absent when it does not apply.
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
            return cls(mean=None, std=None, n=0, failed=len(values))
        return cls(
            mean=statistics.fmean(ok),
            std=statistics.stdev(ok) if len(ok) > 1 else 0.0,
            n=len(ok),
            failed=len(values) - len(ok),
            values=ok,
        )


@dataclass
class EvaluationResult:
    """Every (question, engine) record, and what the report says of the run (caveats first)."""

    records: list[Record]
    engines: list[str]
    metrics: list[str]
    judge: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def values(self, engine: str, measure: str) -> list[float | None]:
        """Per-question values of a metric or cost measure for one engine (``None``: failed)."""
        rows = [r for r in self.records if r.engine == engine]
        if measure not in COST_MEASURES:
            return [r.metrics[measure] for r in rows if measure in r.metrics]
        costs = [getattr(row, measure) for row in rows]
        return [None if cost is None else float(cost) for cost in costs]

    def summary(self) -> dict[str, dict[str, MetricSummary]]:
        """``{engine: {measure: MetricSummary}}`` for every metric and cost measure."""
        measures = [*self.metrics, *COST_MEASURES]
        return {
            engine: {
                measure: MetricSummary.of(self.values(engine, measure)) for measure in measures
            }
            for engine in self.engines
        }

    @property
    def failures(self) -> list[tuple[str, str, str, str]]:
        """``(question, engine, metric or "answer", error)`` of every failed item."""
        return [(r.question, r.engine, m, e) for r in self.records for m, e in r.errors.items()]

    def to_json(self) -> list[dict[str, Any]]:
        """The records as JSON-ready dicts (``records.json``; failed scores are ``None``)."""
        return [asdict(r) for r in self.records]


#: Column titles for the cost measures.
COST_TITLES = {"latency_s": "latency (s)", "model_calls": "model calls"}
#: The setup lines of the report, from ``EvaluationResult.settings``.
SETUP = {
    "documents": "Documents",
    "llm": "Answering LLM",
    "embed_model": "Embedding model",
    "index": "Index",
    "engine_options": "Engine options",
}


def write_report(
    result: EvaluationResult, out_dir: str | Path, *, plot: bool = True
) -> dict[str, Path]:
    """Write ``records.json``, ``report.md`` (caveats, setup, the table, failures) and, with
    matplotlib, ``report.png`` into ``out_dir``; returns the paths keyed by what they hold.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # A password in a served model's URL (the command, the model's label, an error) is masked.
    records = mask_url(json.dumps(result.to_json(), indent=2, ensure_ascii=False))
    (out / "records.json").write_text(records + "\n", "utf-8", "backslashreplace")
    chart = write_chart(result, out / "report.png") if plot else None
    paths = {"records": out / "records.json", **({"chart": chart} if chart is not None else {})}
    settings = result.settings
    parts = ["# Evaluation: Self-RAG and RSE against top-k retrieval", ""]
    for note in result.notes:
        parts += [f"> **Caveat.** {note}", ""]
    parts += ["## Setup", ""]
    if settings.get("command"):
        parts += ["Command:", "", "```bash", str(settings["command"]), "```", ""]
    source = f" (`{settings['questions_file']}`)" if settings.get("questions_file") else ""
    parts.append(f"- Questions: {len(result.records) // max(1, len(result.engines))}{source}")
    parts += [f"- {title}: {_text(settings[k])}" for k, title in SETUP.items() if settings.get(k)]
    judge = settings.get("judge") or {"identity": "none (evidence, latency and model calls only)"}
    parts.append(f"- Judge: {judge['identity']}")
    if settings.get("engines"):
        parts.append("- Engines:")
        parts += [f"  - `{name}`: {text}" for name, text in settings["engines"].items()]
    parts += ["", "## Results", "", "Mean ± standard deviation over questions (n = scored).", ""]
    parts += [markdown_table(result), ""]
    if chart is not None:
        parts += [f"![metrics by engine]({chart.name})", ""]
    else:
        parts += ["(No chart: matplotlib is not installed; `pip install matplotlib`.)", ""]
    if failures := result.failures:
        parts += ["## Failures", "", f"{len(failures)} item(s) failed; left out of the means."]
        parts += ["", _row(["engine", "metric", "question", "error"]), _row(["---"] * 4)]
        for question, engine, metric, error in failures[:20]:
            parts.append(_row([engine, metric, _cell(question, 60), _cell(error, 120)]))
        if len(failures) > 20:
            parts.append(f"\n... and {len(failures) - 20} more in records.json.")
        parts.append("")
    parts.append(
        "Metrics: docs/evaluate.md of llama-index-packs-self-rag-rse. Records: `records.json`."
    )
    (out / "report.md").write_text(mask_url("\n".join([*parts, ""])), "utf-8", "backslashreplace")
    return {**paths, "report": out / "report.md"}


def format_cell(summary: MetricSummary, digits: int = 2) -> str:
    """``mean ± sd`` with the number of values, and failures when there were any."""
    failed = f", {summary.failed} failed" if summary.failed else ""
    if summary.mean is None:
        return f"– ({summary.failed} failed)" if summary.failed else "–"
    return f"{summary.mean:.{digits}f} ± {summary.std or 0.0:.{digits}f} (n={summary.n}{failed})"


def markdown_table(result: EvaluationResult) -> str:
    """Engines as rows, metrics then latency and model calls as columns."""
    summary = result.summary()
    measures = [*result.metrics, *COST_MEASURES]
    header = ["engine", *(COST_TITLES.get(measure, measure) for measure in measures)]
    rows = [header, ["---"] * len(header)]
    for engine in result.engines:
        cells = [
            format_cell(summary[engine][measure], 1 if measure == "model_calls" else 2)
            for measure in measures
        ]
        rows.append([engine, *cells])
    return "\n".join(_row(row) for row in rows)


def write_chart(result: EvaluationResult, path: str | Path) -> Path | None:
    """Draw the chart into ``path`` (PNG); ``None`` when matplotlib is missing."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        logger.warning("report.png skipped: matplotlib is not installed; pip install matplotlib")
        return None
    summary = result.summary()
    engines = result.engines
    measures = [*result.metrics, *COST_MEASURES]
    columns = min(3, len(measures))
    # Inches per panel: wide enough for every engine's bar and tilted name.
    width = max(3.2, 0.9 * len(engines) + 1.2)
    rows = math.ceil(len(measures) / columns)
    fig = Figure(figsize=(width * columns, 3.0 * rows + 0.4), layout="constrained")
    axes = list(fig.subplots(rows, columns, squeeze=False).flat)
    for ax, measure in zip(axes, measures, strict=False):
        # Bars at the engines' positions; an engine with no value has none.
        stats = {x: summary[engine][measure] for x, engine in enumerate(engines)}
        stats = {x: stat for x, stat in stats.items() if stat.mean is not None}
        ax.bar(
            list(stats),
            [stat.mean for stat in stats.values()],
            yerr=[stat.std for stat in stats.values()],
            width=0.6,
            color="#9ecae1",
            edgecolor="#3182bd",
            capsize=4,
        )
        for x, s in stats.items():
            # Deterministic jitter keeps overlapping per-question dots apart.
            jitter = [((k * 0.618) % 1.0 - 0.5) * 0.4 for k in range(s.n)]
            ax.scatter(
                [x + j for j in jitter], s.values, s=10, color="#08519c", alpha=0.7, zorder=3
            )
        ax.set_xticks(range(len(engines)), engines, rotation=30, ha="right", fontsize=7)
        ax.set_title(COST_TITLES.get(measure, measure), fontsize=9)
        if measure not in COST_TITLES:
            ax.set_ylim(0, 1.05)
        ax.tick_params(axis="y", labelsize=7)
    for ax in axes[len(measures) :]:
        ax.set_visible(False)
    title = "bar: mean over questions, line: ± 1 standard deviation, dots: questions"
    if result.notes:
        title += "\nCaveat: " + result.notes[0].split(". ")[0].rstrip(".") + "."
    fig.suptitle(title, fontsize=8)
    fig.savefig(path, dpi=110)
    return Path(path)


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _text(value: Any) -> str:
    mapping = isinstance(value, Mapping)
    return ", ".join(f"{key}={item}" for key, item in value.items()) if mapping else str(value)


def _cell(text: str, limit: int) -> str:
    flat = " ".join(str(text).split()).replace("|", "\\|")
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"
