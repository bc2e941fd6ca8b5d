"""The resumable cache of finished answers and judgements."""

from __future__ import annotations

import json
from pathlib import Path

from llama_index.packs.self_rag_rse.evaluation.result import ResultCache


def test_a_line_cut_short_does_not_swallow_the_next_record(tmp_path: Path) -> None:
    path = tmp_path / "cache.jsonl"
    good = json.dumps({"kind": "answer", "key": ["a"], "value": {"text": "kept"}})
    path.write_text(good + "\n" + '{"kind": "answer", "key": ["b"], "val', encoding="utf-8")
    first = ResultCache(path)
    assert first.get("answer", ("a",)) == {"text": "kept"} and len(first) == 1
    first.put("answer", ("c",), {"text": "new"})
    again = ResultCache(path)
    assert again.get("answer", ("c",)) == {"text": "new"}
    assert again.get("answer", ("a",)) == {"text": "kept"} and len(again) == 2
