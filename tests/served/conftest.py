"""Fixtures for the served critic: llama-cpp-python's own OpenAI-compatible server.

``llama_cpp_python_server(typing)`` starts ``python -m llama_cpp.server`` (the ``server`` extra of
llama-cpp-python, in the dev install) on a tiny GGUF, once per test module and typing, on
127.0.0.1 and a free port, with its default sampling settings. Like the in-process models it
keeps an F32 KV cache, one thread and 1024 positions, and ``--logits_all true``, which its
``logprobs`` need. The module's teardown stops it. A test that needs it fails (not skips) when
the extra is missing. (llama.cpp's ``llama-server`` is in the top conftest.)
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from servers import ServerProcess, free_port

GGML_TYPE_F32 = "0"


class LlamaCppPythonServer(ServerProcess):
    """A running ``python -m llama_cpp.server``: its root URL and how to stop it."""

    def __init__(self, model: Path, log: Path) -> None:
        port = free_port()
        command = [
            sys.executable,
            *("-m", "llama_cpp.server", "--model", str(model)),
            *("--host", "127.0.0.1", "--port", str(port)),
            *("--logits_all", "true", "--n_ctx", "1024"),
            *("--n_threads", "1", "--n_threads_batch", "1"),
            *("--type_k", GGML_TYPE_F32, "--type_v", GGML_TYPE_F32, "--verbose", "false"),
        ]
        url = f"http://127.0.0.1:{port}"
        super().__init__("llama_cpp.server", command, url, "/v1/models", log)


@pytest.fixture(scope="module")
def llama_cpp_python_server(
    tiny_gguf_paths: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """``llama_cpp_python_server(typing)``: llama-cpp-python's server on that tiny GGUF (or on the
    GGUF at a path), started on first use and stopped when the module's tests are done.
    """
    try:
        import llama_cpp.server.app  # noqa: F401
    except ImportError as exc:
        pytest.fail(
            f"llama-cpp-python's server cannot start ({exc}): install the dev extra "
            "(pip install -e '.[dev]', which includes llama-cpp-python[server])",
            pytrace=False,
        )
    running: dict[str | Path, LlamaCppPythonServer] = {}
    logs = tmp_path_factory.mktemp("llama_cpp_python_server")

    def get(model: str | Path) -> LlamaCppPythonServer:
        if model not in running:
            path = model if isinstance(model, Path) else tiny_gguf_paths[model]
            running[model] = LlamaCppPythonServer(path, logs / f"{path.stem}.log")
        return running[model]

    yield get
    for server in running.values():
        server.stop()
