"""``self-rag-rse evaluate``: model specifications, argument errors before anything loads, a real
run offline.
"""

from __future__ import annotations

import json
import time

import pytest
from corpus import CORPUS

from llama_index.packs.self_rag_rse.cli import main
from llama_index.packs.self_rag_rse.evaluation import command
from llama_index.packs.self_rag_rse.evaluation.command import ModelSpec, load_llm, parse_spec

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


def test_parse_spec(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert parse_spec("bundled") == ModelSpec("bundled")
    assert parse_spec(str(gguf)) == ModelSpec("gguf", str(gguf))
    assert parse_spec("http://h/v1#qwen") == ModelSpec("served", "qwen", "http://h/v1")
    assert parse_spec("https://h/v1", chat=True) == ModelSpec("served", None, "https://h/v1", True)
    # The form before URL[#MODEL] was never released: it is no model form now.
    with pytest.raises(ValueError, match=r"pass bundled, PATH\.gguf or URL"):
        parse_spec("openai-like-chat:x", flag="--judge")
    with pytest.raises(ValueError, match="does not exist"):
        parse_spec(str(tmp_path / "absent.gguf"))


def test_served_model_is_an_openai_like():
    pytest.importorskip("llama_index.llms.openai_like")
    spec = parse_spec("http://127.0.0.1:9/v1#judge-7b", flag="--judge", chat=True)
    llm, label, close = load_llm(spec, 99, 4096)
    assert type(llm).__name__ == "OpenAILike"
    assert llm.model == "judge-7b" and llm.is_chat_model
    assert llm.max_tokens == 99 and llm.api_base == "http://127.0.0.1:9/v1"
    assert not load_llm(parse_spec("http://127.0.0.1:9/v1#m"), 8, 512)[0].is_chat_model
    assert label == "judge-7b at http://127.0.0.1:9/v1"
    close()  # holds nothing


def test_bundled_model_uses_its_own_chat_template():
    llm, label, close = load_llm(parse_spec("bundled"), 4, 512)
    try:
        assert label.startswith("LlamaCPP(SmolLM2-135M")
        prompt = llm.completion_to_prompt("Hi?")
        assert prompt.endswith("<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n")
    finally:
        close()


def test_help_lists_evaluate_and_keeps_the_other_commands(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "evaluate" in out and "download-llamapack" in out and "list" in out
    with pytest.raises(SystemExit):
        main(["evaluate", "--help"])
    out = capsys.readouterr().out
    for flag in ("--docs", "--qa", "--out", "--llm", "--judge", "--workers"):
        assert flag in out
    assert "URL[#MODEL]" in out
    assert main(["list"]) == 0
    assert "SelfRAGQueryEngine" in capsys.readouterr().out


def evaluate_with(inputs, *extra):
    """Exit code and stderr of ``evaluate`` on the fixture's inputs; no model may load."""
    docs, qa, out = inputs
    try:
        code = main(["evaluate", "--docs", str(docs), "--qa", str(qa), "--out", str(out), *extra])
    except SystemExit as stop:  # an argparse error
        code = stop.code
    return code


@pytest.fixture
def no_loading(monkeypatch):
    """Loading a model, an embedding or an index fails the test: errors come first."""

    def loaded(*args, **kwargs):
        raise AssertionError("something loaded before the arguments were checked")

    for name in ("load_llm", "optional_import"):  # optional_import: the embedding, a server
        monkeypatch.setattr(command, name, loaded)
    monkeypatch.setattr(command.setup, "build_index", loaded)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--judge-url", "http://x/v1"], "unrecognized arguments: --judge-url"),
        (["--llm", "missing.gguf"], "missing.gguf does not exist"),
        (["--llm", "gpt-7"], "--llm 'gpt-7': pass bundled, PATH.gguf or URL[#MODEL]"),
        (["--engines", "top-k,best"], "--engines: unknown ['best']"),
        (["--metrics", "faithfulnes"], "--metrics: unknown ['faithfulnes']"),
        (["--workers", "0"], "--workers: must be a whole number of at least 1, got '0'"),
        (["--rse-context-chars", "0"], "--rse-context-chars: must be a whole number from 1"),
    ],
)
def test_bad_arguments_fail_fast_with_the_fix(inputs, capsys, no_loading, extra, message):
    assert evaluate_with(inputs, *extra) in (1, 2)  # 2: argparse's own errors
    assert message in capsys.readouterr().err
    assert not inputs[2].exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--timeout", "0"], "--timeout: must be a number of seconds above 0, got '0'"),
        (["--timeout", "-5"], "--timeout: must be a number of seconds above 0, got '-5'"),
        (["--timeout", "nan"], "--timeout: must be a number of seconds above 0, got 'nan'"),
        (["--retries", "-1"], "--retries: must be 0 or more, got '-1'"),
        (["--top-k", "two"], "--top-k: must be a whole number of at least 1, got 'two'"),
        (["--rse-max-length", "0"], "--rse-max-length: must be a whole number of at least 1"),
        (
            ["--rse-context-chars", "100000000"],
            "--rse-context-chars: must be a whole number from "
            "1 to 10,000,000 (characters), got '100000000'",
        ),
    ],
)
def test_every_flag_is_checked_before_anything_loads(inputs, capsys, no_loading, extra, message):
    assert evaluate_with(inputs, *extra) == 2
    assert message in capsys.readouterr().err


def test_a_budget_and_an_overall_length_together_are_refused(inputs, capsys, no_loading):
    """--rse-overall-max-length was dropped without a word when --rse-context-chars was given."""
    extra = ["--rse-context-chars", "2000", "--rse-overall-max-length", "12"]
    assert evaluate_with(inputs, *extra) == 1
    err = capsys.readouterr().err
    assert "--rse-context-chars replaces --rse-overall-max-length" in err
    assert "keep --rse-context-chars for a budget in characters or --rse-overall" in err
    assert not inputs[2].exists()


def test_inputs_and_the_output_folder_are_checked_in_the_flags_words(inputs, capsys, no_loading):
    docs, qa, out = inputs
    assert evaluate_with((docs, qa.parent, out)) == 1
    assert f"--qa {qa.parent} is a folder: pass a .jsonl file" in capsys.readouterr().err
    (out / "cache.jsonl").mkdir(parents=True)
    assert evaluate_with(inputs) == 1
    assert f"--out {out}: its cache.jsonl is a folder" in capsys.readouterr().err
    (docs / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    assert evaluate_with(inputs) == 1
    assert "latin.txt line 1 is not UTF-8" in capsys.readouterr().err


def test_an_out_folder_inside_docs_is_refused(inputs, capsys, no_loading):
    """A rerun read the last run's report.md as a document: it was indexed and retrieved as
    evidence, and its new text changed the settings key, so every cached answer was redone.
    """
    docs, qa, _ = inputs
    for out in (docs / "eval-out", docs):
        (docs / "eval-out").mkdir(exist_ok=True)
        (docs / "eval-out" / "report.md").write_text("| engine | faithfulness |")
        assert evaluate_with((docs, qa, out)) == 1
        assert f"--out {out} is inside --docs: pass a folder outside it" in capsys.readouterr().err


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
    assert "The judge is the bundled SmolLM2-135M, a 135M-parameter model" in report
    assert "- Judge: llama-index-core evaluators / LlamaCPP(" in report
    assert "self-rag-rse evaluate --docs" in report
    assert "| self-rag+corrective |" in report
    assert (out / "report.png").read_bytes()[:4] == b"\x89PNG"

    # A rerun finds every answer in the cache (no judge this time: evidence only).
    assert main([*args, "--judge-backend", "none"]) == 0
    again = json.loads((out / "records.json").read_text())
    assert all(r["cached"] for r in again)
    assert [r["answer"] for r in again] == [r["answer"] for r in records]


@pytest.mark.slow
def test_ctrl_c_mid_run_exits_cleanly_and_the_cache_resumes(inputs):
    """Ctrl-C while a worker thread is inside llama.cpp: no crash (the models are not freed
    under it), exit 130 with the resume hint, and the cache stays readable.
    """
    import signal
    import subprocess
    import sys

    docs, qa, out = inputs
    qa.write_text(
        "\n".join(json.dumps({**QUESTIONS[i % 2], "question": f"Q{i}?"}) for i in range(12))
    )
    # As from a terminal: a test runner started in the background passes SIGINT on ignored, and
    # a Python started so never raises KeyboardInterrupt; the child restores Python's handler.
    start = (
        "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "runpy.run_module('llama_index.packs.self_rag_rse', run_name='__main__', alter_sys=True)"
    )
    command = [
        sys.executable,
        "-c",
        start,
        "evaluate",
        "--docs",
        str(docs),
        "--qa",
        str(qa),
        "--out",
        str(out),
        "--engines",
        "top-k",
        "--judge-backend",
        "none",
        "--max-new-tokens",
        "48",
        "--no-progress",
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    cache = out / "cache.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and process.poll() is None:
        if cache.exists() and cache.read_text().count("\n") >= 1:
            break
        time.sleep(0.2)
    assert process.poll() is None, process.communicate()
    time.sleep(0.3)  # the next answer is being generated now
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=240)
    assert process.returncode == 130, (process.returncode, err[-2000:])
    assert "interrupted" in err and "resume" in err
    lines = [line for line in cache.read_text().splitlines() if line.strip()]
    assert lines and all(json.loads(line)["kind"] for line in lines)


def test_the_served_model_is_listed_with_the_api_key(monkeypatch):
    # --llm URL without #MODEL lists the server's models without OPENAI_API_KEY, which the
    # OpenAILike built next sends: a server that wants a key answered 401, and the error said
    # only "('data')".
    from served.stub import Reply, StubServer

    def handle(method, path, body):
        if stub.headers.get("Authorization") != "Bearer sk-test":
            return Reply.json({"error": {"message": "invalid key"}}, status=401)
        return Reply.json({"data": [{"id": "served-model"}]})

    with StubServer(handle) as stub:
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
        _, label, _ = load_llm(ModelSpec("served", None, f"{stub.url}/v1"), 16, 2048)
        assert label == f"served-model at {stub.url}/v1"
        monkeypatch.delenv("OPENAI_API_KEY")
        with pytest.raises(ValueError, match=r"no model list at .*/v1/models \(.*401.*URL#MODEL"):
            load_llm(ModelSpec("served", None, f"{stub.url}/v1"), 16, 2048)


def test_a_served_model_that_is_not_running_is_an_error_not_a_traceback(inputs, capsys):
    # Nothing listens on the port: the served critic's connection error escaped as a traceback
    # after the whole index was built.
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    extra = ["--llm", f"http://127.0.0.1:{port}/v1#m", "--judge-backend", "none"]
    assert evaluate_with(inputs, *extra, "--engines", "self-rag", "--no-progress") == 1
    err = capsys.readouterr().err
    assert f"evaluate: error: cannot connect to http://127.0.0.1:{port}" in err
    assert "Traceback" not in err


# -- a served model that is down, a run where everything failed ----------------------------------


@pytest.mark.parametrize("flag", ["--llm", "--judge"])
def test_a_served_model_that_is_down_stops_the_run_before_indexing(inputs, capsys, flag):
    """With URL#MODEL nothing asked the server before the run: the index was built, every
    question failed on its request, and the run exited 0.
    """
    from servers import free_port

    url = f"http://127.0.0.1:{free_port()}/v1"
    extra = [flag, f"{url}#m", "--engines", "top-k", "--no-progress"]
    assert evaluate_with(inputs, *extra) == 1
    captured = capsys.readouterr()
    assert f"evaluate: error: cannot connect to {url}" in captured.err
    assert "start the server" in captured.err and "Indexing" not in captured.out
    assert not inputs[2].exists()


def test_a_run_where_every_answer_failed_exits_1(inputs, capsys):
    """The server answers its model list but refuses every completion (vLLM, asked for a model
    it does not serve): every answer failed, and the run exited 0 as if it had measured
    something.
    """
    from served.stub import Reply, StubServer

    def handle(method, path, body):
        if path.endswith("/models"):
            return Reply.json({"object": "list", "data": [{"id": "qwen", "object": "model"}]})
        message = f"The model `{body['model']}` does not exist."
        return Reply.json({"error": {"message": message, "code": 404}}, status=404)

    with StubServer(handle) as stub:
        extra = ["--llm", f"{stub.url}/v1#gpt-7", "--engines", "top-k", "--judge-backend", "none"]
        assert evaluate_with(inputs, *extra, "--no-progress") == 1
    captured = capsys.readouterr()
    assert "every answer failed (first: NotFoundError" in captured.err
    assert "gpt-7" in captured.err and "nothing was measured" in captured.err
    records = json.loads((inputs[2] / "records.json").read_text())
    assert len(records) == 2 and all("answer" in record["errors"] for record in records)


# -- Ctrl-C while loading, a folder in use ------------------------------------------------------

#: The command as from a terminal (see test_ctrl_c_mid_run_exits_cleanly_and_the_cache_resumes),
#: saying "ready" once the command line module is imported.
FROM_A_TERMINAL = (
    "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "from llama_index.packs.self_rag_rse.cli import main; "
    "print('ready', file=sys.stderr, flush=True); sys.exit(main(sys.argv[1:]))"
)


def start_evaluate(inputs, *extra):
    """``self-rag-rse evaluate`` on the fixture's inputs in a new process, once it is ready."""
    import subprocess
    import sys

    docs, qa, out = inputs
    argv = ["evaluate", "--docs", str(docs), "--qa", str(qa), "--out", str(out), *extra]
    process = subprocess.Popen(
        [sys.executable, "-c", FROM_A_TERMINAL, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr is not None and process.stderr.readline() == "ready\n"
    return process


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["importing", "indexing"])
def test_ctrl_c_while_loading_exits_130_in_one_line(inputs, moment):
    """Ctrl-C in the first seconds (llama-index-core importing, the embedding model loading,
    the index building) printed a traceback of some 60 lines, with no resume hint.
    """
    import signal

    process = start_evaluate(inputs, "--engines", "top-k", "--judge-backend", "none")
    if moment == "importing":
        time.sleep(0.3)
    else:
        assert process.stdout is not None and "Indexing" in process.stdout.readline()
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=240)
    assert process.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert err.strip().splitlines()[-1].startswith("interrupted: ")
    assert "run the same command again to resume" in err
    out = inputs[2]
    assert not out.exists() or [path.name for path in out.iterdir()] == []


@pytest.mark.slow
def test_two_runs_on_one_out_folder(inputs, capsys, monkeypatch, no_loading):
    """A second run on the same --out computed every item again, both appending to one cache:
    now it stops at once, naming the folder and what to do; a lock left by a killed run is
    taken over.
    """
    import signal

    out = inputs[2]
    first = start_evaluate(inputs, "--engines", "top-k", "--judge-backend", "none")
    assert first.stdout is not None and "Indexing" in first.stdout.readline()
    try:
        assert evaluate_with(inputs, "--engines", "top-k", "--judge-backend", "none") == 1
        err = capsys.readouterr().err
        lock = out / "evaluate.lock"
        assert f"--out {out} is in use by another evaluate run (its process id is in {lock})" in err
        assert "wait for it to finish, or pass another --out; if no run is alive, remove" in err
        assert lock.read_text() == f"{first.pid}\n"
    finally:
        first.send_signal(signal.SIGKILL)  # as a crash: its lock stays behind
        first.communicate(timeout=60)
    assert "evaluate.lock" in [path.name for path in out.iterdir()]
    monkeypatch.undo()  # the third run loads the bundled models
    tiny = ["--engines", "top-k", "--judge-backend", "none", "--limit", "1", "--no-progress"]
    assert evaluate_with(inputs, *tiny, "--max-new-tokens", "4") == 0
    assert sorted(path.name for path in out.iterdir()) == [
        "cache.jsonl",
        "records.json",
        "report.md",
        "report.png",
    ]
