"""The retrieval benchmark's scoring and the converter of Chroma's chunking evaluation set:
several gold excerpts per question, IoU next to recall and precision.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_several_excerpts_are_one_gold_and_iou_counts_their_union(tmp_path: Path) -> None:
    bench = _script("bench_rse_quality")
    text = "alpha beta gamma delta epsilon zeta eta theta"
    qa = tmp_path / "qa.jsonl"
    row = {"question": "q?", "document": "a.md", "evidence": ["beta", "delta"]}
    qa.write_text(json.dumps({**row, "evidence_starts": [6, 17]}) + "\n")
    [query] = bench.load_questions(qa, {"a.md": text})
    assert query.gold == [("a.md", 6, 10), ("a.md", 17, 22)]
    # Returned: "beta gamma" (10 chars, 4 of them gold): recall 4/9, precision 4/10, IoU 4/15.
    recall, precision, iou = bench.score([("a.md", 6, 16)], query)
    assert (recall, precision, iou) == pytest.approx((4 / 9, 4 / 10, 4 / 15))
    assert bench.score([], query) == (0.0, 0.0, 0.0)
    assert bench.score([("b.md", 6, 10)], query)[0] == 0.0
    qa.write_text(json.dumps({**row, "evidence_starts": [6, 18]}) + "\n")
    with pytest.raises(SystemExit, match="not at 18"):
        bench.load_questions(qa, {"a.md": text})


def test_the_converter_writes_docs_and_questions_and_checks_offsets(tmp_path: Path) -> None:
    convert = _script("convert_chunking_evaluation")
    data = tmp_path / "clone" / convert.DATA
    (data / "corpora").mkdir(parents=True)
    (data / "corpora" / "notes.md").write_text("one two three\nfour five six\n", "utf-8")
    with (data / "questions_df.csv").open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["question", "references", "corpus_id"])
        good = {"content": "two", "start_index": 4, "end_index": 7}
        shifted = {"content": "five", "start_index": 0, "end_index": 4}
        missing = {"content": "seven", "start_index": 0, "end_index": 5}
        writer.writerow(["Which?", json.dumps([good, shifted]), "notes"])
        writer.writerow(["Gone?", json.dumps([missing]), "notes"])
    counts = convert.convert(tmp_path / "clone", tmp_path / "out")
    assert counts == {
        "questions": 1,
        "excerpts": 3,
        "moved": 1,
        "dropped": 1,
        "questions dropped": 1,
    }
    [line] = (tmp_path / "out" / "questions.jsonl").read_text("utf-8").splitlines()
    assert json.loads(line) == {
        "question": "Which?",
        "document": "notes.md",
        "evidence": ["two", "five"],
        "evidence_starts": [4, 19],
    }
    bench = _script("bench_rse_quality")
    texts = bench.load_texts(tmp_path / "out" / "docs")
    [query] = bench.load_questions(tmp_path / "out" / "questions.jsonl", texts)
    assert query.gold == [("notes.md", 4, 7), ("notes.md", 19, 23)]


def test_variants_name_the_value_model_options() -> None:
    bench = _script("bench_rse_quality")
    assert bench.variant_options("spread+best", {}) == {"keep_top_hits": 1, "calibration": "spread"}
    assert bench.variant_options("default+top3+whole+bare", {"x": 1}) == {
        "x": 1,
        "keep_top_hits": 3,
        "partial_fill": False,
        "segment_headers": False,
    }
    assert bench.variant_options("default+best+min0.25", {}) == {
        "keep_top_hits": 1,
        "minimum_value": 0.25,
    }
    assert bench.variant_options("default+pen0.1+decay15", {}) == {
        "keep_top_hits": 0,
        "irrelevant_chunk_penalty": 0.1,
        "decay_rate": 15.0,
    }
    with pytest.raises(SystemExit, match="then \\+best"):
        bench.variant_options("spread+bogus", {})
    for bad in ("default+min", "default+pen", "default+decay1.2.3", "default+xmin1"):
        with pytest.raises(SystemExit, match="minX, \\+penX, \\+decayX"):
            bench.variant_options(bad, {})


def test_the_embedding_cache_gives_the_stored_vectors_back(tmp_path: Path) -> None:
    embedders = _script("embedders")
    from llama_index.core.embeddings import MockEmbedding
    from llama_index.core.schema import TextNode

    calls: list[int] = []

    def run() -> MockEmbedding:  # a fresh class per run, as a fresh process would have
        class Counting(MockEmbedding):
            def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
                calls.append(len(texts))
                return [[float(len(t)), 0.5] for t in texts]

        embed = Counting(embed_dim=2)
        embedders.cache_embeddings(embed, tmp_path, "counting")
        return embed

    first = run()([TextNode(text="one"), TextNode(text="three")])
    assert [n.embedding for n in first] == [[3.0, 0.5], [5.0, 0.5]]
    again = run()([TextNode(text="three"), TextNode(text="fifteen")])
    assert [n.embedding for n in again] == [[5.0, 0.5], [7.0, 0.5]]
    assert calls == [2, 1]  # "three" came from the file the first run wrote
    # Two runs at once, each loading before the other stores: neither loses the other's vectors.
    left, right = run(), run()
    left([TextNode(text="four")])
    right([TextNode(text="sixteen")])
    calls.clear()
    run()([TextNode(text="four"), TextNode(text="sixteen"), TextNode(text="one")])
    assert calls == []
    assert [p.name for p in tmp_path.iterdir()] == [next(tmp_path.iterdir()).name]  # no parts


def test_the_paired_comparison_counts_questions_and_bounds_the_mean() -> None:
    bench = _script("bench_rse_quality")
    # Recall per question (recall, precision, chars, IoU, recall by text): ours loses one
    # question of four outright, ties two, wins one by half.
    ours = [(1.0, 0, 0, 0, 0), (0.0, 0, 0, 0, 0), (0.5, 0, 0, 0, 0), (1.0, 0, 0, 0, 0)]
    theirs = [(1.0, 0, 0, 0, 0), (1.0, 0, 0, 0, 0), (0.0, 0, 0, 0, 0), (1.0, 0, 0, 0, 0)]
    results = {("a", 10): ours, ("b", 10): theirs}
    found = bench.paired(results, {"a - b": ("a", "b")}, [10])
    [row] = found["a - b"]
    assert (row["mean"], row["more"], row["less"]) == (-0.125, 1, 1)
    low, high = row["interval"]
    assert -1.0 <= low < -0.125 < high <= 0.5  # the set cannot tell this from chance
    assert bench.paired(results, {"a - b": ("a", "b")}, [10]) == found  # seeded: every run alike
    assert bench.paired(results, {"b - b": ("b", "b")}, [10])["b - b"][0] == {
        "mean": 0.0,
        "more": 0,
        "less": 0,
        "interval": [0.0, 0.0],
    }


def test_documents_are_known_by_their_text_not_their_path() -> None:
    """Ids from paths made the figures move (by up to 0.002) with the folder the documents lay
    in: Qdrant orders hits of equal score by point id, and stable chunk ids come from them.
    """
    bench = _script("bench_rse_quality")
    here = bench.content_ids({"a/x.txt": "one", "b/y.txt": "two", "c/z.txt": "one"})
    there = bench.content_ids({"elsewhere/q.txt": "two", "p.txt": "one"})
    assert here["b/y.txt"] == there["elsewhere/q.txt"]
    assert here["a/x.txt"] == there["p.txt"]
    assert here["c/z.txt"] not in (here["a/x.txt"], here["b/y.txt"])  # the same text twice
