"""The served critic against llama-cpp-python's own server (``python -m llama_cpp.server``),
started with its default settings on the tiny GGUFs.

That server applies ``repeat_penalty`` 1.1 unless a request says otherwise, and keys log-probs by
decoded text. The critic must still generate what the in-process critic generates (the
paragraphs below are ones where a penalty of 1.1 changes the greedy answer), score exactly,
fetching the reflection tokens a completion did not return, and refuse, loudly, what it cannot
do: CONTROL-typed tokens, and decoding that is not greedy.
"""

from __future__ import annotations

from typing import Any

import pytest
from llama_index.llms.openai_like import OpenAILike
from retrievers import FixedRetriever
from served.stub import Reply, StubServer, forward

from llama_index.packs.self_rag_rse import (
    ReflectionCritic,
    SelfRAGQueryEngine,
    ServedReflectionCritic,
)
from llama_index.packs.self_rag_rse.served import ReflectionTokensUnidentifiable, ServerNotGreedy

MAX_NEW = 30
TOL = 1e-3
#: (query, paragraphs): the first paragraph of each turns a repeat penalty of 1.1 into another
#: answer (found by comparing the server's output with and without it).
CASES = [
    ("and and", ["scattering river play", "Hamlet is a tragedy written by William Shakespeare."]),
    ("william paris river", ["play scattering denmark", "x"]),
    (
        "scattering prince",
        ["hamlet the william tower play written shakespeare tower light", "Paris is in France."],
    ),
]
#: Not seq_score: this server does not report the end-of-generation token, so its mean
#: log-prob is over the answer's other tokens.
SCORES = ("relevance", "support", "utility")


@pytest.fixture(scope="module")
def local(tiny_llm: Any) -> Any:
    critic = ReflectionCritic(tiny_llm, max_new_tokens=MAX_NEW, n_seq_max=2)
    yield critic
    critic.close()


@pytest.fixture(scope="module")
def server(llama_cpp_python_server: Any) -> Any:
    return llama_cpp_python_server("user_defined")


def critic(url: str, **kwargs: Any) -> ServedReflectionCritic:
    return ServedReflectionCritic(url + "/v1", max_new_tokens=MAX_NEW, timeout=30, **kwargs)


def test_default_settings_give_the_in_process_answers_and_scores(local: Any, server: Any) -> None:
    # The whole (tiny) vocabulary per position: every score is read, none fetched or bounded.
    with critic(server.url, top_logprobs=2048) as served:
        for query, paragraphs in CASES:
            judgements = served.judge(query, paragraphs)
            for s, r in zip(judgements, local.judge(query, paragraphs), strict=True):
                assert s.error is None, s.error
                assert s.answer == r.answer
                for name in SCORES:
                    assert getattr(s, name) == pytest.approx(getattr(r, name), abs=TOL), name
                assert s.details == {"api": "openai", "server": "llama-cpp-python"}
        assert served.info is not None and served.info.verified
        assert served.info.sampling["repeat_penalty"] == 1.0
        for query, _ in CASES:
            a, b = served.decide_retrieval(query, 0.5), local.decide_retrieval(query, 0.5)
            assert a.retrieve == b.retrieve and a.answer == b.answer
            assert a.probability == pytest.approx(b.probability, abs=TOL)


def test_the_servers_own_penalty_is_reported_not_used(server: Any) -> None:
    # request_options still win; here they put the server's default back, and the answer of the
    # first paragraph would differ from the greedy one: the judgement fails, naming why.
    with critic(server.url, top_logprobs=5, request_options={"repeat_penalty": 1.1}) as served:
        query, paragraphs = CASES[0]
        with pytest.raises(ServerNotGreedy) as caught:
            served.judge(query, paragraphs)
    message = str(caught.value)
    assert f"{server.url}/v1/completions (llama-cpp-python)" in message
    assert f"position {caught.value.position}" in message
    assert "request_options sets repeat_penalty=1.1" in message


def test_tokens_outside_the_top_n_are_fetched_exactly(local: Any, server: Any) -> None:
    # One log-prob per position: every group needs a follow-up, which asks this server for its
    # whole vocabulary, the answer regenerated up to the group's position.
    with critic(server.url, top_logprobs=1) as served:
        for query, paragraphs in CASES:
            expected = local.judge(query, paragraphs)
            for s, r in zip(served.judge(query, paragraphs), expected, strict=True):
                assert s.answer == r.answer
                for name in SCORES:
                    assert getattr(s, name) == pytest.approx(getattr(r, name), abs=TOL), name
                assert "relevance" in s.details["refetched"] and "bounded" not in s.details
                assert s.details["followup_requests"] == len(s.details["refetched"])
        gate = served.decide_retrieval(CASES[0][0], 0.5)
        assert gate.probability == pytest.approx(
            local.decide_retrieval(CASES[0][0], 0.5).probability, abs=TOL
        )


def test_bound_mode_is_flagged(server: Any) -> None:
    with critic(server.url, top_logprobs=1, missing_logprobs="bound") as served:
        for j in served.judge(*CASES[1]):
            assert "relevance" in j.details["bounded"] and "followup_requests" not in j.details


def test_control_typed_tokens_keep_the_clear_error(llama_cpp_python_server: Any) -> None:
    with (
        critic(llama_cpp_python_server("control").url) as served,
        pytest.raises(ReflectionTokensUnidentifiable, match="empty strings"),
    ):
        served.connect()


def test_a_penalty_the_client_cannot_turn_off_fails_the_judgement(server: Any) -> None:
    def penalise(method: str, path: str, body: Any) -> Reply:
        if path == "/v1/completions" and not body.get("echo"):
            body = {**body, "repeat_penalty": 1.5, "presence_penalty": 1.5}
        return forward(server.url, method, path, body)

    with (
        StubServer(penalise) as proxy,
        critic(proxy.url, top_logprobs=5) as served,
        pytest.raises(ServerNotGreedy) as caught,
    ):
        served.judge(*CASES[0])
    message = str(caught.value)
    assert f"{proxy.url}/v1/completions (llama-cpp-python)" in message
    assert f"at generated position {caught.value.position}" in message
    assert "applies something a request cannot turn off" in message


def test_the_engine_over_openailike_equals_the_in_process_engine(
    tiny_llm: Any, server: Any
) -> None:
    # The user's setup: the server's OpenAI API behind OpenAILike, the reflection critic.
    options: dict[str, Any] = {"max_new_tokens": MAX_NEW, "threshold": 0.0}
    llm = OpenAILike(
        api_base=f"{server.url}/v1",
        model="tiny-self-rag",
        api_key="none",
        is_chat_model=False,
        timeout=30,
        max_retries=0,
    )
    expected = SelfRAGQueryEngine(llm=tiny_llm, retriever=FixedRetriever(), **options)
    with SelfRAGQueryEngine(
        llm=llm, retriever=FixedRetriever(), critic="reflection", **options
    ) as served:
        got = served.query("What does the while statement do?")
    want = expected.query("What does the while statement do?")
    expected.close()
    a, b = got.metadata["self_rag"], want.metadata["self_rag"]
    assert got.response == want.response and a["best"] == b["best"]
    for x, y in zip(a["paragraphs"], b["paragraphs"], strict=True):
        assert x["answer"] == y["answer"]
        for key in ("relevance", "support", "utility"):
            assert x[key] == pytest.approx(y[key], abs=TOL), key
