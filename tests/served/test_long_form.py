"""Long form over a served Self-RAG model equals long form in process.

llama.cpp's llama-server on the long-form tiny GGUFs (both token typings), through its native
``/completion`` API and its ``/v1/completions``: the same segments, citations, scores and beams
as the in-process critic on the same file. A server that speaks text only (llama-cpp-python's)
cannot send back the tokens a path was written in: a clear error says what to serve instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from retrievers import FixedRetriever

from llama_index.packs.self_rag_rse import (
    ReflectionCritic,
    SelfRAGQueryEngine,
    ServedReflectionCritic,
)

QUESTIONS = ["What does the while statement do?", "Who wrote Hamlet?"]
MAX_NEW = 30
TOL = 1e-3
OPTIONS: dict[str, Any] = dict(long_form=True, beam_width=2, max_segments=4, max_new_tokens=MAX_NEW)


@pytest.fixture(scope="module", params=["user_defined", "control"])
def typing(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def local(typing: str, long_form_ggufs: dict[str, Path]) -> Iterator[ReflectionCritic]:
    from models import load_llama as _llama

    llm = _llama(long_form_ggufs[typing])
    critic = ReflectionCritic(llm, max_new_tokens=MAX_NEW)
    yield critic
    critic.close()
    llm.close()


def assert_same(served: Any, local: Any) -> None:
    assert served.response == local.response
    a, b = served.metadata["self_rag"], local.metadata["self_rag"]
    assert a["depth"] == b["depth"]
    assert len(a["segments"]) == len(b["segments"])
    for x, y in zip(a["segments"], b["segments"], strict=True):
        assert (x["text"], x["node_id"], x["citation"]) == (y["text"], y["node_id"], y["citation"])
        for name in ("relevance", "support", "utility", "seq_score", "score"):
            assert x[name] == pytest.approx(y[name], abs=TOL), name
    for kept, expected in zip(a["beams"], b["beams"], strict=True):
        assert [p["node_ids"] for p in kept] == [p["node_ids"] for p in expected]
        assert [p["score"] for p in kept] == pytest.approx([p["score"] for p in expected], abs=TOL)
    assert [n.node.node_id for n in served.source_nodes] == [
        n.node.node_id for n in local.source_nodes
    ]


@pytest.mark.parametrize("api", ["llama.cpp", "openai"])
@pytest.mark.parametrize(
    "mode, threshold", [("always_retrieve", None), ("adaptive_retrieval", 0.3)]
)
def test_served_long_form_equals_in_process(
    api: str,
    mode: str,
    threshold: float | None,
    typing: str,
    local: ReflectionCritic,
    long_form_ggufs: dict[str, Path],
    llama_server: Any,
) -> None:
    url = llama_server(long_form_ggufs[typing]).url
    with ServedReflectionCritic(url, api=api, max_new_tokens=MAX_NEW, timeout=30) as served:
        for question in QUESTIONS:
            options = dict(OPTIONS, mode=mode, threshold=threshold)
            expected = SelfRAGQueryEngine(critic=local, retriever=FixedRetriever(), **options)
            engine = SelfRAGQueryEngine(critic=served, retriever=FixedRetriever(), **options)
            assert_same(engine.query(question), expected.query(question))


def test_a_text_only_server_gets_a_clear_error(
    long_form_ggufs: dict[str, Path], llama_cpp_python_server: Any
) -> None:
    url = llama_cpp_python_server(long_form_ggufs["user_defined"]).url
    with ServedReflectionCritic(url, api="openai", max_new_tokens=MAX_NEW, timeout=30) as served:
        engine = SelfRAGQueryEngine(
            critic=served, retriever=FixedRetriever(), mode="always_retrieve", **OPTIONS
        )
        with pytest.raises(ValueError, match="needs prompts and answers as token ids") as caught:
            engine.query(QUESTIONS[0])
    assert "llama-server" in str(caught.value) and url in str(caught.value)


def test_a_passage_cut_to_fit_the_slot_is_shown_in_its_segments_row(
    long_form_ggufs: dict[str, Path], llama_server: Any
) -> None:
    url = llama_server(long_form_ggufs["user_defined"]).url
    with ServedReflectionCritic(url, max_new_tokens=MAX_NEW, timeout=30, n_ctx=120) as served:
        engine = SelfRAGQueryEngine(
            critic=served, retriever=FixedRetriever(), mode="always_retrieve", **OPTIONS
        )
        rows = engine.query(QUESTIONS[0]).metadata["self_rag"]["segments"]
    # Depth 1 fits; at depth 2 the path's context leaves less room than the passage needs.
    assert rows[0]["passage_cut"] == 0 and rows[-1]["passage_cut"] > 0
