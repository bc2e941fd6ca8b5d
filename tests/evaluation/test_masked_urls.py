"""``evaluate --llm http://user:secret@host/v1#model``: the password is sent to the server and
written nowhere: not in ``report.md``, ``records.json``, the console or its log.
"""

from __future__ import annotations

import json
import logging
import socket
from pathlib import Path
from typing import Any

import pytest
from corpus import CORPUS

from llama_index.packs.self_rag_rse.cli import main

SECRET = "s3cret-pw"
QUESTION = {
    "question": "What is a code block in Python?",
    "document": "execmodel.txt",
    "evidence": "A *block* is a piece\nof Python program text that is executed as a unit.",
}


@pytest.fixture
def inputs(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "execmodel.txt").write_text((CORPUS / "execmodel.txt").read_text())
    qa = tmp_path / "qa.jsonl"
    qa.write_text(json.dumps(QUESTION) + "\n")
    return ["--docs", str(docs), "--qa", str(qa), "--out", str(tmp_path / "out")]


def unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_server_that_is_down_is_named_without_the_password(inputs, capsys):
    port = unused_port()
    llm = f"http://user:{SECRET}@127.0.0.1:{port}/v1#m"
    extra = ["--llm", llm, "--judge-backend", "none", "--engines", "self-rag", "--no-progress"]
    assert main(["evaluate", *inputs, *extra]) == 1
    err = capsys.readouterr().err
    assert f"evaluate: error: cannot connect to http://user:***@127.0.0.1:{port}" in err
    assert SECRET not in err


def test_a_served_run_writes_the_url_masked(
    inputs: list[str], llama_server: Any, capsys: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # report.md held the password twice (the command and the model), the console log once per
    # request ("HTTP Request: POST http://user:<password>@..."). The console shows INFO and up
    # (the openai library's DEBUG lines name the URL as given: a debug log is the user's choice).
    caplog.set_level(logging.INFO)
    url = llama_server("user_defined").url.replace("http://", f"http://user:{SECRET}@")
    out = Path(inputs[-1])
    extra = ["--llm", f"{url}/v1#m", "--judge-backend", "none", "--engines", "top-k"]
    tiny = ["--top-k", "1", "--max-new-tokens", "8", "--no-progress"]
    assert main(["evaluate", *inputs, *extra, *tiny]) == 0
    printed = capsys.readouterr()
    written = [(out / name).read_text(encoding="utf-8") for name in ("report.md", "records.json")]
    masked = url.replace(SECRET, "***")
    assert f"m at {masked}/v1" in written[0] and f"{masked}/v1#m" in written[0]
    for text in [*written, printed.out, printed.err, caplog.text]:
        assert SECRET not in text
