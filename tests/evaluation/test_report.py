"""The report: records.json, the Markdown table (mean ± spread), caveats, the chart."""

from __future__ import annotations

import json

import pytest

from llama_index.packs.self_rag_rse.evaluation import EvaluationResult, Record, write_report
from llama_index.packs.self_rag_rse.evaluation.report import MetricSummary


def record(question, engine, faithfulness, latency=1.0, calls=2, **extra):
    return Record(
        question=question,
        engine=engine,
        answer=f"{engine} says",
        latency_s=latency,
        model_calls=calls,
        metrics={"faithfulness": faithfulness, "evidence_recall": 0.5},
        **extra,
    )


@pytest.fixture
def result():
    records = [
        record("q1", "top-k", 0.2, latency=1.0),
        record("q1", "self-rag", 1.0, latency=3.0, calls=4),
        record("q2", "top-k", 0.6, latency=2.0),
        record(
            "q2",
            "self-rag",
            None,
            latency=5.0,
            calls=6,
            errors={"faithfulness": "JudgementError: unreadable | reply"},
        ),
    ]
    return EvaluationResult(
        records=records,
        engines=["top-k", "self-rag"],
        metrics=["faithfulness", "evidence_recall"],
        judge="ragas 0.4.3 / LlamaCPP(tiny.gguf)",
        settings={
            "command": "self-rag-rse evaluate --docs d --qa q.jsonl --out o",
            "llm": "tiny.gguf (llama.cpp)",
            "judge": {"identity": "ragas 0.4.3 / LlamaCPP(tiny)"},
            "engines": {"top-k": "plain", "self-rag": "Self-RAG"},
        },
        notes=["The judge is tiny. Numbers mean little."],
    )


def test_summary_mean_spread_and_failures(result):
    summary = result.summary()
    top = summary["top-k"]["faithfulness"]
    assert top.mean == pytest.approx(0.4) and top.std == pytest.approx(0.2828427, abs=1e-6)
    assert (top.n, top.failed) == (2, 0)
    selfrag = summary["self-rag"]["faithfulness"]
    assert (selfrag.mean, selfrag.std, selfrag.n, selfrag.failed) == (1.0, 0.0, 1, 1)
    assert summary["self-rag"]["latency_s"].mean == 4.0
    assert summary["self-rag"]["model_calls"].mean == 5.0
    assert MetricSummary.of([None, None]) == MetricSummary(None, None, 0, 2)


def test_files_written(result, tmp_path):
    import matplotlib

    backend = matplotlib.get_backend()
    paths = write_report(result, tmp_path / "out")
    assert matplotlib.get_backend() == backend  # the global backend is left alone
    assert paths["chart"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    records = json.loads(paths["records"].read_text())
    assert len(records) == 4
    for item in records:
        assert {"question", "engine", "answer", "latency_s", "metrics"} <= set(item)
    assert records[3]["metrics"]["faithfulness"] is None

    report = paths["report"].read_text()
    assert "> **Caveat.** The judge is tiny. Numbers mean little." in report
    assert "self-rag-rse evaluate --docs d --qa q.jsonl --out o" in report
    assert "- Answering LLM: tiny.gguf (llama.cpp)" in report
    assert "- Judge: ragas 0.4.3 / LlamaCPP(tiny)" in report
    header = "| engine | faithfulness | evidence_recall | latency (s) | model calls |"
    assert header in report
    assert "| top-k | 0.40 ± 0.28 (n=2) | 0.50 ± 0.00 (n=2) | 1.50 ± 0.71 (n=2) |" in report
    assert "| self-rag | 1.00 ± 0.00 (n=1, 1 failed) |" in report
    assert "## Failures" in report and "unreadable \\| reply" in report
    assert "![metrics by engine](report.png)" in report
    assert "Metrics: docs/evaluate.md" in report


def test_no_matplotlib_still_writes_the_report(result, tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("no matplotlib here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    paths = write_report(result, tmp_path)
    assert "chart" not in paths
    assert "No chart: matplotlib is not installed" in paths["report"].read_text()


def test_a_lone_surrogate_in_a_question_is_written_as_its_escape(result, tmp_path):
    # A --qa line holding an escaped lone surrogate ("\udc80") reaches the records as one: the
    # strict UTF-8 write failed on it after the whole run and left records.json empty.
    result.records[3].question = "q2 \udc80"  # a failed item: its question is in the report
    paths = write_report(result, tmp_path, plot=False)
    assert json.loads(paths["records"].read_text())[3]["question"] == "q2 \udc80"
    assert "q2 \\udc80" in paths["report"].read_text(encoding="utf-8")
