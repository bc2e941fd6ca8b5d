"""``self-rag-rse evaluate``: argument errors before anything loads; a real run, offline."""

from __future__ import annotations

import json
import time

import pytest
from corpus import CORPUS

from llama_index.packs.self_rag_rse.cli import main

QUESTIONS = [
    {
        "question": "What is a code block in Python?",
        "document": "execmodel.txt",
        "evidence": "A *block* is a piece\nof Python program text that is executed as a unit.",
        "reference": "A piece of Python program text that is executed as a unit.",
    },
    {
        "question": "What happens when a name is not found at all?",
        "document": "execmodel.txt",
        "evidence": 'When a name is not found at all, a "NameError" exception is raised.',
    },
]


@pytest.fixture
def inputs(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "execmodel.txt").write_text((CORPUS / "execmodel.txt").read_text())
    qa = tmp_path / "qa.jsonl"
    qa.write_text("\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
    return docs, qa, tmp_path / "out"


def test_help_lists_evaluate_and_keeps_the_other_commands(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "evaluate" in out and "download-llamapack" in out and "list" in out
    with pytest.raises(SystemExit):
        main(["evaluate", "--help"])
    out = capsys.readouterr().out
    for flag in ("--docs", "--qa", "--out", "--llm", "--judge", "--judge-url", "--workers"):
        assert flag in out
    assert "openai-like-chat[:MODEL]" in out
    assert main(["list"]) == 0
    assert "SelfRAGQueryEngine" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--llm", "openai-like:qwen"], "needs the server's base URL: pass --llm-url"),
        (["--judge-url", "http://x/v1"], "--judge-url is for a served model"),
        (["--llm", "missing.gguf"], "missing.gguf does not exist"),
        (["--llm", "gpt-7"], "cannot read the model specification 'gpt-7'"),
        (["--engines", "top-k,best"], "--engines: unknown ['best']"),
        (["--metrics", "faithfulnes"], "--metrics: unknown ['faithfulnes']"),
        (["--workers", "0"], "--workers must be at least 1"),
    ],
)
def test_bad_arguments_fail_fast_with_the_fix(inputs, capsys, extra, message):
    docs, qa, out = inputs
    started = time.perf_counter()
    code = main(["evaluate", "--docs", str(docs), "--qa", str(qa), "--out", str(out), *extra])
    assert code == 1
    assert message in capsys.readouterr().err
    assert time.perf_counter() - started < 5  # nothing was loaded
    assert not out.exists()


def test_bad_question_file_names_the_line(inputs, capsys):
    docs, qa, out = inputs
    qa.write_text(json.dumps({"question": "q", "document": "nope.txt"}) + "\n")
    assert main(["evaluate", "--docs", str(docs), "--qa", str(qa), "--out", str(out)]) == 1
    assert "line 1: document 'nope.txt' is not a file in --docs" in capsys.readouterr().err


@pytest.mark.slow
def test_end_to_end_offline_with_the_bundled_models_and_resume(inputs, capsys):
    docs, qa, out = inputs
    # Tiny settings: the bundled 135M model answers and judges; this proves the plumbing.
    tiny = ["--top-k", "2", "--ndocs", "1", "--max-new-tokens", "12", "--no-progress"]
    args = ["evaluate", "--docs", str(docs), "--qa", str(qa), "--out", str(out), *tiny]
    # Default judge backend: with the bundled judge, "auto" means LlamaIndex's evaluators.
    judged = ["--judge-max-tokens", "12", "--workers", "2"]
    metrics = ["--metrics", "li_answer_relevancy,evidence_recall,evidence_precision"]
    assert main([*args, *judged, *metrics]) == 0
    printed = capsys.readouterr().out
    assert "| engine | li_answer_relevancy | evidence_recall |" in printed

    records = json.loads((out / "records.json").read_text())
    engines = ["top-k", "top-k+rse", "self-rag", "self-rag+rse", "self-rag+corrective"]
    assert [(r["question"], r["engine"]) for r in records] == [
        (q["question"], e) for q in QUESTIONS for e in engines
    ]
    for record in records:
        assert record["answer"].strip(), record
        assert record["latency_s"] > 0 and record["model_calls"] >= 1
        assert 0.0 <= record["metrics"]["evidence_recall"] <= 1.0
        # Scored, or failed with the reason recorded: never silently missing.
        assert "li_answer_relevancy" in record["metrics"]
        if record["metrics"]["li_answer_relevancy"] is None:
            assert record["errors"]["li_answer_relevancy"]
    calls = {r["engine"]: r["model_calls_detail"] for r in records}
    assert calls["top-k"] == {"llm_requests": 1, "critic_calls": 0}
    assert calls["self-rag"]["critic_calls"] >= 1 and calls["self-rag"]["llm_requests"] == 0

    report = (out / "report.md").read_text()
    assert "bundled SmolLM2-135M, a 135M-parameter model" in report
    assert "through llama-index-core evaluators" in report
    assert "self-rag-rse evaluate --docs" in report
    assert "| self-rag+corrective |" in report
    assert (out / "report.png").read_bytes()[:4] == b"\x89PNG"

    # A rerun finds every answer in the cache (no judge this time: evidence only).
    assert main([*args, "--judge-backend", "none"]) == 0
    again = json.loads((out / "records.json").read_text())
    assert all(r["cached"] for r in again)
    assert [r["answer"] for r in again] == [r["answer"] for r in records]
