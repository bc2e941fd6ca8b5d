"""The report: a Markdown table (engines × metrics, mean ± spread) and a chart of the same.

The chart draws one panel per metric and cost measure: every question's value as a dot, the
mean as a bar and one standard deviation either side as a line, so the spread over questions
is as visible as the mean. It is drawn on its own Agg canvas (never through pyplot), so the
caller's matplotlib backend and open figures are untouched. Needs matplotlib (the ``plot``
extra); without it the report says so and the chart is skipped.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llama_index.packs.self_rag_rse.evaluation.result import EvaluationResult, MetricSummary

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


def format_cell(summary: MetricSummary, *, digits: int = 2) -> str:
    """``mean ± sd`` with the number of values, and failures when there were any."""
    if summary.mean is None:
        return f"– ({summary.failed} failed)" if summary.failed else "–"
    std = summary.std if summary.std is not None else 0.0
    cell = f"{summary.mean:.{digits}f} ± {std:.{digits}f} (n={summary.n}"
    if summary.failed:
        cell += f", {summary.failed} failed"
    return cell + ")"


def markdown_table(result: EvaluationResult) -> str:
    """Engines as rows, metrics then latency and model calls as columns."""
    summary = result.summary()
    measures = [*result.metrics, "latency_s", "model_calls"]
    titles = [COST_TITLES.get(m, m) for m in measures]
    lines = [
        "| engine | " + " | ".join(titles) + " |",
        "| --- | " + " | ".join("---" for _ in measures) + " |",
    ]
    for engine in result.engines:
        cells = [
            format_cell(summary[engine][m], digits=1 if m == "model_calls" else 2) for m in measures
        ]
        lines.append(f"| {engine} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_markdown(result: EvaluationResult, path: str | Path, chart: Path | None = None) -> Path:
    """Write ``report.md``: caveats, setup, the table, failures, the glossary."""
    out = Path(path)
    settings = dict(result.settings)
    questions = len({r.question for r in result.records})
    parts = ["# Evaluation: Self-RAG and RSE against top-k retrieval", ""]
    for note in result.notes:
        parts += [f"> **Caveat.** {note}", ""]
    parts += ["## Setup", ""]
    if settings.get("command"):
        parts += ["Command:", "", "```bash", str(settings["command"]), "```", ""]
    parts.append(f"- Questions: {questions}" + _suffix(settings.get("questions_file")))
    for key, title in (
        ("documents", "Documents"),
        ("llm", "Answering LLM"),
        ("embed_model", "Embedding model"),
        ("index", "Index"),
        ("engine_options", "Engine options"),
    ):
        if settings.get(key):
            parts.append(f"- {title}: {_text(settings[key])}")
    judge = settings.get("judge")
    if judge:
        parts.append(
            f"- Judge: {judge.get('llm', judge.get('identity'))} through "
            f"{judge.get('library', judge.get('backend'))}"
            + (f", embeddings {judge['embed_model']}" if judge.get("embed_model") else "")
        )
    else:
        parts.append("- Judge: none (evidence, latency and model calls only)")
    descriptions = settings.get("engines") or {}
    if descriptions:
        parts += ["- Engines:"]
        parts += [f"  - `{name}`: {text}" for name, text in descriptions.items()]
    parts += ["", "## Results", "", "Mean ± standard deviation over questions (n = scored).", ""]
    parts += [markdown_table(result), ""]
    if chart is not None:
        parts += [f"![metrics by engine]({chart.name})", ""]
    else:
        parts += ["(No chart: matplotlib is not installed; `pip install matplotlib`.)", ""]
    failures = result.failures
    if failures:
        parts += [
            "## Failures",
            "",
            f"{len(failures)} item(s) failed; they are left out of the means.",
        ]
        parts += ["", "| engine | metric | question | error |", "| --- | --- | --- | --- |"]
        for question, engine, metric, error in failures[:20]:
            parts.append(f"| {engine} | {metric} | {_cell(question, 60)} | {_cell(error, 120)} |")
        if len(failures) > 20:
            parts.append(f"\n... and {len(failures) - 20} more in records.json.")
        parts.append("")
    parts += ["## Metrics", ""]
    for measure in [*result.metrics, "latency_s", "model_calls"]:
        parts.append(f"- `{measure}`: {GLOSSARY.get(measure, 'custom metric')}")
    parts += [
        "",
        "Every per-question record (answer, contexts, scores, errors) is in `records.json`.",
        "",
    ]
    out.write_text("\n".join(parts), encoding="utf-8")
    return out


def write_chart(result: EvaluationResult, path: str | Path) -> Path | None:
    """Draw the chart into ``path`` (PNG); ``None`` when matplotlib is missing."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        logger.warning("report.png skipped: matplotlib is not installed (pip install matplotlib)")
        return None
    measures = [*result.metrics, "latency_s", "model_calls"]
    columns = min(3, len(measures))
    rows = math.ceil(len(measures) / columns)
    width = max(3.2, 0.9 * len(result.engines) + 1.2)
    fig = Figure(figsize=(width * columns, 3.0 * rows + 0.4), layout="constrained")
    FigureCanvasAgg(fig)  # attaches itself: savefig renders with Agg
    axes = fig.subplots(rows, columns, squeeze=False)
    for i, measure in enumerate(measures):
        ax = axes[i // columns][i % columns]
        _panel(ax, result, measure)
    for j in range(len(measures), rows * columns):
        axes[j // columns][j % columns].set_visible(False)
    title = "bar: mean over questions, line: ± 1 standard deviation, dots: questions"
    if result.notes:
        title += "\nCaveat: " + result.notes[0].split(". ")[0].rstrip(".") + "."
    fig.suptitle(title, fontsize=8)
    out = Path(path)
    fig.savefig(out, dpi=110)
    return out


def _panel(ax: Any, result: EvaluationResult, measure: str) -> None:
    positions = range(len(result.engines))
    for x, engine in zip(positions, result.engines, strict=True):
        values = [v for v in result.values(engine, measure) if v is not None]
        if not values:
            continue
        mean = sum(values) / len(values)
        std = (
            math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
            if len(values) > 1
            else 0.0
        )
        ax.bar(x, mean, width=0.6, color="#9ecae1", edgecolor="#3182bd")
        ax.errorbar(x, mean, yerr=std, color="black", capsize=4, linewidth=1)
        # Deterministic jitter keeps overlapping per-question dots apart.
        offsets = [((k * 0.618) % 1.0 - 0.5) * 0.4 for k in range(len(values))]
        ax.scatter([x + o for o in offsets], values, s=10, color="#08519c", alpha=0.7, zorder=3)
    ax.set_xticks(list(positions))
    ax.set_xticklabels(result.engines, rotation=30, ha="right", fontsize=7)
    ax.set_title(COST_TITLES.get(measure, measure), fontsize=9)
    if measure not in COST_TITLES:
        ax.set_ylim(0, 1.05)
    ax.tick_params(axis="y", labelsize=7)


def _text(value: Any) -> str:
    if isinstance(value, Mapping):
        return ", ".join(f"{k}={v}" for k, v in value.items())
    return str(value)


def _suffix(value: Any) -> str:
    return f" (`{value}`)" if value else ""


def _cell(text: str, limit: int) -> str:
    flat = " ".join(str(text).split()).replace("|", "\\|")
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"
