"""Who closes what, and what a query does when its model is closed or being closed.

Every test here builds its own models (the conftest ones are shared by the session).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import _llama
from retrievers import FixedRetriever

from llama_index.packs.self_rag_rse import PromptedCritic, ReflectionCritic, SelfRAGQueryEngine
from llama_index.packs.self_rag_rse.llamacpp import compat
from llama_index.packs.self_rag_rse.llamacpp.compat import ModelClosedError

JOIN_TIMEOUT = 120.0


def test_engine_closes_the_model_it_loaded(tiny_gguf_paths: dict[str, Path]) -> None:
    engine = SelfRAGQueryEngine(
        str(tiny_gguf_paths["user_defined"]),
        FixedRetriever(),
        model_kwargs={"n_ctx": 512, "n_threads": 1},
    )
    llama = engine.critic.llm  # type: ignore[attr-defined]
    engine.query("q")
    engine.close()
    assert compat.is_closed(llama)
    with pytest.raises(ModelClosedError, match="create the engine"):
        engine.query("q")


def test_engine_leaves_a_passed_model_open(tiny_gguf_paths: dict[str, Path]) -> None:
    llm = _llama(tiny_gguf_paths["user_defined"])
    try:
        with SelfRAGQueryEngine(llm=llm, retriever=FixedRetriever()) as engine:
            engine.query("q")
        assert not compat.is_closed(llm)
        # A closed engine's critic can be used again: it re-creates its context.
        assert engine.query("q").response
    finally:
        llm.close()


def test_engine_does_not_close_a_critic_it_was_given(tiny_llm: Any) -> None:
    critic = ReflectionCritic(tiny_llm)
    engine = SelfRAGQueryEngine(retriever=FixedRetriever(), critic=critic)
    engine.close()
    assert critic.judge("q", ["p"])[0].error is None
    critic.close()


@pytest.mark.parametrize("critic", ["reflection", "prompted"])
def test_query_after_the_model_was_closed_raises_a_clear_error(
    tiny_gguf_paths: dict[str, Path], critic: str
) -> None:
    typing = "user_defined" if critic == "reflection" else "none"
    llm = _llama(tiny_gguf_paths[typing])
    engine = SelfRAGQueryEngine(llm=llm, retriever=FixedRetriever(), critic=critic)
    assert engine.critic.name == critic
    llm.close()  # the user frees the model under the engine
    with pytest.raises(ModelClosedError, match=r"the llama\.cpp model was closed"):
        engine.query("What does the while statement do?")
    with pytest.raises(ModelClosedError):
        engine.critic.judge("q", ["a paragraph"])


def test_query_after_llamacpp_model_close_raises(tiny_gguf_paths: dict[str, Path]) -> None:
    from llama_index.llms.llama_cpp import LlamaCPP

    llm = LlamaCPP(
        model_path=str(tiny_gguf_paths["none"]),
        model_kwargs={"n_ctx": 512, "n_threads": 1},
        verbose=False,
    )
    engine = SelfRAGQueryEngine(llm=llm, retriever=FixedRetriever())
    assert isinstance(engine.critic, PromptedCritic)
    llm._model.close()
    with pytest.raises(ModelClosedError):
        engine.query("q")


@pytest.mark.parametrize("critic", ["reflection", "prompted"])
def test_closing_the_critic_while_a_query_runs_waits_for_it(
    tiny_gguf_paths: dict[str, Path], critic: str
) -> None:
    typing = "user_defined" if critic == "reflection" else "none"
    llm = _llama(tiny_gguf_paths[typing])
    try:
        engine = SelfRAGQueryEngine(
            llm=llm,
            retriever=FixedRetriever(),
            critic=critic,
            # The tiny model has no digit tokens for the prompted utility scale: generate only.
            mode="always_retrieve" if critic == "reflection" else "no_retrieval",
            max_new_tokens=200,
        )
        expected = engine.query("What does the while statement do?").response
        result: dict[str, Any] = {}
        started = threading.Event()

        def query() -> None:
            started.set()
            try:
                result["answer"] = engine.query("What does the while statement do?").response
            except BaseException as exc:
                result["error"] = exc

        thread = threading.Thread(target=query)
        thread.start()
        started.wait(JOIN_TIMEOUT)
        engine.critic.close()  # must wait for (not free under) the running decode
        thread.join(JOIN_TIMEOUT)
        assert not thread.is_alive()
        assert result.get("answer") == expected, result.get("error")
        assert engine.query("What does the while statement do?").response == expected
        engine.close()
    finally:
        llm.close()
