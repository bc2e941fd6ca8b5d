"""The ``self-rag-rse`` command line: parsing loads nothing heavy, and a typo names the fix."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from llama_index.packs.self_rag_rse.cli import main

#: Runs the command line in a fresh process and prints what it imported.
PARSE_ONLY = """
import json, sys
from llama_index.packs.self_rag_rse.cli import main
try:
    status = main(sys.argv[1:])
except SystemExit as stop:
    status = stop.code
loaded = sorted(name for name in sys.modules if name.startswith("llama_index.core"))
print(json.dumps({"status": status, "core": loaded[:3]}))
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["download-llamapack", "--help"],
        ["evaluate", "--help"],
        ["evaluat"],
        ["evaluate", "--docs", "d", "--qa", "q", "--out", "o", "--top-kk", "3"],
        ["evaluate", "--docs", "d", "--qa", "q", "--out", "o", "--timeout", "0"],
        ["list"],
    ],
)
def test_parsing_loads_no_llama_index_core(argv):
    """``--help`` and every argparse error took 3 to 7 s: the command imported llama-index-core
    (for evaluate) before it parsed anything.
    """
    done = subprocess.run(
        [sys.executable, "-c", PARSE_ONLY, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["status"] in (0, 2), done.stderr
    assert result["core"] == []


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    return capsys.readouterr().err


EVALUATE = ["evaluate", "--docs", "docs", "--qa", "qa.jsonl", "--out", "out"]


def test_a_mistyped_command_names_the_closest(capsys):
    err = _error(["evaluat"], capsys)
    assert "invalid choice: 'evaluat'" in err and "(did you mean 'evaluate'?)" in err
    err = _error(["downlod-llamapack", "SelfRAGPack", "-d", "pack"], capsys)
    assert "did you mean 'download-llamapack'?" in err
    # Nothing close: argparse's list of choices is the whole message.
    assert "did you mean" not in _error(["zzz"], capsys)


def test_a_mistyped_flag_names_the_closest(capsys):
    err = _error([*EVALUATE, "--top-kk", "3"], capsys)
    assert "unrecognized arguments: --top-kk 3" in err
    assert "did you mean '--top-k'?" in err
    err = _error([*EVALUATE, "--ndocz=3", "--no-progess"], capsys)
    assert "arguments: --ndocz=3 --no-progess (did you mean '--ndocs', '--no-progress'?)" in err
    err = _error(["download-llamapack", "SelfRAGPack", "-d", "pack", "--ovewrite"], capsys)
    assert "did you mean '--overwrite'?" in err
    # The usage shown is the command's own.
    assert "usage: self-rag-rse download-llamapack" in err


def test_a_mistyped_choice_names_the_closest(capsys):
    err = _error([*EVALUATE, "--judge-backend", "raga"], capsys)
    assert "did you mean 'ragas'?" in err
    err = _error([*EVALUATE, "--self-rag-mode", "always_retreive"], capsys)
    assert "did you mean 'always_retrieve'?" in err
