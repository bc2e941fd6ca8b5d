"""The shipped question set: every evidence occurs exactly once in its chapter, and no question
is a section heading (a header holding that heading would repeat the query).
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
QA = ROOT / "benchmarks" / "data" / "python_reference_qa.jsonl"
CORPUS = ROOT / "examples" / "data" / "python_reference"


def test_every_evidence_occurs_exactly_once() -> None:
    from llama_index.packs.self_rag_rse.context.headings import find_headings

    rows = [json.loads(line) for line in QA.read_text(encoding="utf-8").splitlines()]
    assert 30 <= len(rows) <= 45
    assert len({row["question"] for row in rows}) == len(rows)
    headings = set()
    for path in CORPUS.glob("*.txt"):
        headings |= {h.title.lower() for h in find_headings(path.read_text(encoding="utf-8"))}
    for row in rows:
        text = (CORPUS / row["document"]).read_text(encoding="utf-8")
        assert text.count(row["evidence"]) == 1, row["question"]
        assert len(row["evidence"]) >= 40, row["question"]
        assert row["question"].rstrip("?").lower() not in headings


def _bench():
    import importlib.util
    import sys

    path = ROOT / "benchmarks" / "bench_rse_quality.py"
    spec = importlib.util.spec_from_file_location("bench_rse_quality", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_rse_quality"] = module
    spec.loader.exec_module(module)
    return module


def test_the_benchmark_checks_a_question_file(tmp_path: Path) -> None:
    import pytest

    bench = _bench()
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Title\n\nThe answer is here. The answer is here.\n")
    texts = bench.load_texts(tmp_path / "docs")
    qa = tmp_path / "qa.jsonl"
    row = {"question": "Where?", "document": "a.md", "evidence": "The answer is here."}
    qa.write_text(json.dumps(row) + "\n")
    with pytest.raises(SystemExit, match="occurs 2 times"):
        bench.load_questions(qa, texts)
    qa.write_text(json.dumps({**row, "document": "b.md"}) + "\n")
    with pytest.raises(SystemExit, match=r"not a \.txt/\.md file"):
        bench.load_questions(qa, texts)
    qa.write_text(json.dumps({**row, "evidence": "# Title"}) + "\n")
    [query] = bench.load_questions(qa, texts)
    assert (query.doc, query.start, query.end) == ("a.md", 0, 7)
    # Heading queries also come from Markdown # headings.
    assert [q.text for q in bench.heading_queries(texts, 10)] == ["Title"]


def test_recall_by_text_counts_a_verbatim_copy_of_the_evidence() -> None:
    # A corpus that holds a passage twice: the gold is given at the second copy, a method that
    # returns the first scores 0 by offsets and the whole evidence by text.
    bench = _bench()
    passage = "The board approved a repurchase of 11.2 million shares."
    texts = {"a.md": f"Intro. {passage} Middle. {passage} End.", "b.md": f"Else: {passage}"}
    second = texts["a.md"].rindex(passage)
    query = bench.Query("How many shares?", "a.md", second, second + len(passage))
    assert bench.find_copies([query], texts) == 1
    assert query.copies == [[("a.md", 7), ("a.md", second), ("b.md", 6)]]
    first = [("a.md", 7, 7 + len(passage))]
    assert bench.score(first, query)[0] == 0.0
    assert bench.text_recall(first, query) == 1.0
    half = [("b.md", 6, 6 + len(passage) // 2)]
    assert bench.text_recall(half, query) == (len(passage) // 2) / len(passage)
    alone = bench.Query("q", "a.md", 0, 6)  # "Intro." stands once: both figures agree
    assert bench.find_copies([alone], texts) == 0
    assert bench.text_recall([("a.md", 0, 3)], alone) == bench.score([("a.md", 0, 3)], alone)[0]
