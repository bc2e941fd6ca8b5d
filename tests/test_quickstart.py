"""The README's demo runs end to end offline: Qdrant local mode, MiniLM, the bundled GGUF."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart.py"


@pytest.fixture(scope="module")
def quickstart():
    spec = importlib.util.spec_from_file_location("quickstart", QUICKSTART)
    module = importlib.util.module_from_spec(spec)
    sys.modules["quickstart"] = module
    spec.loader.exec_module(module)
    return module


def test_quickstart_end_to_end_and_reuses_the_index(quickstart, tmp_path, capsys):
    question = "What happens when a name is not found?"
    code = quickstart.main(
        ["--small", "--storage", str(tmp_path), "--ndocs", "2", "--question", question]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "Indexed" in out and "Critic: prompted" in out
    assert f"Question: {question}" in out
    answer = out.split("Answer (", 1)[1].split("\n", 1)[0]
    assert answer.split(": ", 1)[1].strip(), "the demo must print a non-empty answer"
    assert "step=retrieve" in out and "Source segments" in out and "chunks " in out

    # A second run finds the same files already indexed and does not embed again.
    args = quickstart.parse_args(["--small", "--storage", str(tmp_path)])
    client, store = quickstart.open_store(args)
    quickstart.ingest(args, client, store, embed=None)
    assert "Reusing the indexed collection" in capsys.readouterr().out
    client.close()


def test_quickstart_rejects_a_missing_folder(quickstart, tmp_path):
    with pytest.raises(SystemExit, match="not a folder"):
        args = quickstart.parse_args(["--docs", str(tmp_path / "nope"), "--storage", str(tmp_path)])
        client, store = quickstart.open_store(args)
        try:
            quickstart.ingest(args, client, store, embed=None)
        finally:
            client.close()


def test_quickstart_context_budget(quickstart, tmp_path, capsys):
    """--context-chars sizes RSE's output: the segments shown fit the budget together."""
    code = quickstart.main(
        ["--small", "--storage", str(tmp_path), "--ndocs", "2", "--context-chars", "900"]
    )
    assert code == 0
    out = capsys.readouterr().out.split("Source segments", 1)[1]
    sizes = [int(m) for m in re.findall(r"^  \[(?:.*?, )?(\d+) chars, score", out, re.MULTILINE)]
    assert sizes and sum(sizes) <= 900
