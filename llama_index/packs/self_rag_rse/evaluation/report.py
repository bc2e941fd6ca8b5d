"""The report: ``records.json``, a Markdown table (engines × metrics, mean ± spread), a chart.

The chart has one panel per metric and cost measure: every question's value as a dot, the mean
as a bar and one standard deviation either side as a line, so the spread over questions is as
visible as the mean. It is drawn on a bare ``Figure`` (never through pyplot), so the caller's
matplotlib backend and open figures are untouched. Without matplotlib (the ``plot`` extra) the
report says so and the chart is skipped.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from llama_index.packs.self_rag_rse.evaluation.result import (
    COST_MEASURES,
    EvaluationResult,
    MetricSummary,
)

logger = logging.getLogger(__name__)

#: What each column means, for the report's glossary.
GLOSSARY = {
    "faithfulness": "RAGAS: share of the answer's statements supported by the retrieved contexts",
    "answer_relevancy": (
        "RAGAS: cosine similarity of a question regenerated from the answer to the real one "
        "(0 when the answer is non-committal)"
    ),
    "context_precision": (
        "RAGAS: are the contexts useful for the reference answer ranked first (average precision)"
    ),
    "context_utilization": (
        "RAGAS context precision without reference: usefulness judged against the engine's "
        "own answer"
    ),
    "context_recall": "RAGAS: share of the reference answer attributable to the contexts",
    "li_faithfulness": "LlamaIndex FaithfulnessEvaluator: contexts support the answer (0/1)",
    "li_relevancy": "LlamaIndex RelevancyEvaluator: answer and contexts match the question (0/1)",
    "li_answer_relevancy": "LlamaIndex AnswerRelevancyEvaluator: rubric score / 2",
    "li_context_relevancy": "LlamaIndex ContextRelevancyEvaluator: rubric score / 4",
    "li_correctness": "LlamaIndex CorrectnessEvaluator vs the reference: (score 1–5 − 1) / 4",
    "li_semantic_similarity": "LlamaIndex SemanticSimilarityEvaluator: answer/reference cosine",
    "evidence_recall": "gold evidence characters among the retrieved text / gold characters",
    "evidence_precision": "gold evidence characters retrieved / characters retrieved",
    "latency_s": "seconds per query (answering only, queries run one at a time)",
    "model_calls": (
        "calls to the answering model per query: LLM requests, plus Self-RAG critic operations "
        "served in process (one retrieval decision, one batched judgement of all paragraphs, "
        "one generation each)"
    ),
}
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
    """Write ``records.json``, ``report.md`` and (with matplotlib) ``report.png`` into ``out_dir``.

    Returns the paths written, keyed ``records``, ``report`` and ``chart``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"records": out / "records.json"}
    records = json.dumps(result.to_json(), indent=2, ensure_ascii=False)
    paths["records"].write_text(records + "\n", encoding="utf-8")
    chart = write_chart(result, out / "report.png") if plot else None
    if chart is not None:
        paths["chart"] = chart
    paths["report"] = write_markdown(result, out / "report.md", chart=chart)
    return paths


def format_cell(summary: MetricSummary, *, digits: int = 2) -> str:
    """``mean ± sd`` with the number of values, and failures when there were any."""
    failed = f", {summary.failed} failed" if summary.failed else ""
    if summary.mean is None:
        return f"– ({summary.failed} failed)" if summary.failed else "–"
    return f"{summary.mean:.{digits}f} ± {summary.std or 0.0:.{digits}f} (n={summary.n}{failed})"


def markdown_table(result: EvaluationResult) -> str:
    """Engines as rows, metrics then latency and model calls as columns."""
    summary = result.summary()
    measures = [*result.metrics, *COST_MEASURES]
    rows = [["engine", *(COST_TITLES.get(m, m) for m in measures)], ["---"] * (len(measures) + 1)]
    for engine in result.engines:
        cells = [
            format_cell(summary[engine][m], digits=1 if m == "model_calls" else 2) for m in measures
        ]
        rows.append([engine, *cells])
    return "\n".join(_row(row) for row in rows)


def write_markdown(result: EvaluationResult, path: str | Path, chart: Path | None = None) -> Path:
    """Write ``report.md``: caveats, setup, the table, failures, the glossary."""
    settings = result.settings
    parts = ["# Evaluation: Self-RAG and RSE against top-k retrieval", ""]
    for note in result.notes:
        parts += [f"> **Caveat.** {note}", ""]
    parts += ["## Setup", ""]
    if settings.get("command"):
        parts += ["Command:", "", "```bash", str(settings["command"]), "```", ""]
    source = f" (`{settings['questions_file']}`)" if settings.get("questions_file") else ""
    parts.append(f"- Questions: {len({r.question for r in result.records})}{source}")
    parts += [f"- {title}: {_text(settings[k])}" for k, title in SETUP.items() if settings.get(k)]
    judge = settings.get("judge")
    if judge:
        embed = f", embeddings {judge['embed_model']}" if judge.get("embed_model") else ""
        parts.append(
            f"- Judge: {judge.get('llm', judge.get('identity'))} through "
            f"{judge.get('library', judge.get('backend'))}{embed}"
        )
    else:
        parts.append("- Judge: none (evidence, latency and model calls only)")
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
        parts += [
            "## Failures",
            "",
            f"{len(failures)} item(s) failed; they are left out of the means.",
        ]
        parts += ["", _row(["engine", "metric", "question", "error"]), _row(["---"] * 4)]
        for question, engine, metric, error in failures[:20]:
            parts.append(_row([engine, metric, _cell(question, 60), _cell(error, 120)]))
        if len(failures) > 20:
            parts.append(f"\n... and {len(failures) - 20} more in records.json.")
        parts.append("")
    parts += ["## Metrics", ""]
    for measure in [*result.metrics, *COST_MEASURES]:
        parts.append(f"- `{measure}`: {GLOSSARY.get(measure, 'custom metric')}")
    parts += [
        "",
        "Every per-question record (answer, contexts, scores, errors) is in `records.json`.",
    ]
    out = Path(path)
    out.write_text("\n".join([*parts, ""]), encoding="utf-8")
    return out


def write_chart(result: EvaluationResult, path: str | Path) -> Path | None:
    """Draw the chart into ``path`` (PNG); ``None`` when matplotlib is missing."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        logger.warning("report.png skipped: matplotlib is not installed (pip install matplotlib)")
        return None
    summary, engines = result.summary(), result.engines
    measures = [*result.metrics, *COST_MEASURES]
    columns = min(3, len(measures))
    rows = math.ceil(len(measures) / columns)
    width = max(3.2, 0.9 * len(engines) + 1.2)
    fig = Figure(figsize=(width * columns, 3.0 * rows + 0.4), layout="constrained")
    axes = list(fig.subplots(rows, columns, squeeze=False).flat)
    for ax, measure in zip(axes, measures, strict=False):
        stats = {x: summary[engine][measure] for x, engine in enumerate(engines)}
        stats = {x: s for x, s in stats.items() if s.mean is not None}
        ax.bar(
            list(stats),
            [s.mean for s in stats.values()],
            yerr=[s.std for s in stats.values()],
            width=0.6,
            color="#9ecae1",
            edgecolor="#3182bd",
            capsize=4,
            error_kw={"linewidth": 1},
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
    if isinstance(value, Mapping):
        return ", ".join(f"{k}={v}" for k, v in value.items())
    return str(value)


def _cell(text: str, limit: int) -> str:
    flat = " ".join(str(text).split()).replace("|", "\\|")
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"
