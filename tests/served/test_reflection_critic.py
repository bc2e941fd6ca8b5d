"""The served reflection critic against llama.cpp's llama-server on the tiny F32 GGUFs.

The key property: on the same model, the served critic's answers and scores equal the
in-process critic's (to 1e-3), for CONTROL- and USER_DEFINED-typed reflection tokens alike,
through the native API and through llama-server's ``/v1/completions``; and a server that does
not decode greedily fails the judgement instead of changing it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llama_index.packs.self_rag_rse import BaseCritic, ReflectionCritic, ServedReflectionCritic
from llama_index.packs.self_rag_rse.critic.reflection import MissingReflectionTokens
from llama_index.packs.self_rag_rse.served import ServerNotGreedy

QUERIES = ["What is the capital of France?", "Who wrote Hamlet?", "why is the sky blue"]
PARAGRAPHS = [
    "France\nParis is the capital and largest city of France.",
    "Hamlet is a tragedy written by William Shakespeare.",
    "x",
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris.",
    "Rayleigh scattering makes the sky look blue.",
]
MAX_NEW = 30
TOL = 1e-3
SCORES = ("relevance", "support", "utility", "seq_score")


def assert_same(served: list[Any], local: list[Any]) -> None:
    assert len(served) == len(local)
    for s, r in zip(served, local, strict=True):
        assert s.error is None, s.error
        assert s.answer == r.answer
        for name in SCORES:
            assert getattr(s, name) == pytest.approx(getattr(r, name), abs=TOL), name


@pytest.fixture(scope="module", params=["user_defined", "control"])
def critics(
    request: pytest.FixtureRequest, tiny_llm: Any, tiny_llm_control: Any, llama_server: Any
) -> Any:
    """(in-process critic, served critic) on the same GGUF, one pair per token typing."""
    llm = tiny_llm if request.param == "user_defined" else tiny_llm_control
    local = ReflectionCritic(llm, max_new_tokens=MAX_NEW, n_seq_max=4)
    served = ServedReflectionCritic(
        llama_server(request.param).url, max_new_tokens=MAX_NEW, timeout=30
    )
    served.connect()
    yield local, served
    local.close()
    served.close()


@pytest.fixture(scope="module")
def talkative(talkative_gguf: Path, llama_server: Any) -> Iterator[dict[str, tuple[Any, str]]]:
    """Per token typing, a Llama on the talkative model and the URL of a llama-server on the same
    GGUF: the tiny model answers '' after [No Retrieval], so its served answers match trivially.
    """
    from models import load_llama as _llama  # the tests' loader (one settings table for all)
    from tiny_gguf import write_tiny_gguf

    control = write_tiny_gguf(
        talkative_gguf.with_name("talkative_control.gguf"), typing="control", seed=6
    )
    paths = {"user_defined": talkative_gguf, "control": control}
    models = {typing: (_llama(path), llama_server(path).url) for typing, path in paths.items()}
    yield models
    for llm, _ in models.values():
        llm.close()


@pytest.fixture(scope="module", params=["user_defined", "control"])
def talkative_critics(request: pytest.FixtureRequest, talkative: Any) -> Any:
    """(in-process critic, served critic) on the talkative model, one pair per token typing."""
    llm, url = talkative[request.param]
    local = ReflectionCritic(llm, max_new_tokens=MAX_NEW, n_seq_max=4)
    served = ServedReflectionCritic(url, max_new_tokens=MAX_NEW, timeout=30)
    yield local, served
    local.close()
    served.close()


def test_served_scores_equal_the_in_process_scores(critics: Any) -> None:
    local, served = critics
    assert isinstance(served, BaseCritic) and served.name == "reflection"
    for query in QUERIES[:2]:
        before = served.requests
        judgements = served.judge(query, PARAGRAPHS)
        assert_same(judgements, local.judge(query, PARAGRAPHS))
        # One /tokenize for the query and all paragraphs, one /completion per paragraph, and a
        # follow-up only where a needed reflection token was outside the top 20.
        refetches = sum(j.details.get("followup_requests", 0) for j in judgements)
        assert served.requests - before == 1 + len(PARAGRAPHS) + refetches
    assert served.info.api == "llama.cpp" and served.info.verified
    judgements = served.judge(QUERIES[0], PARAGRAPHS)
    assert any(j.support > 0 for j in judgements) and any(j.utility != 0 for j in judgements)


def test_served_gate_and_answers_equal_the_in_process_ones(talkative_critics: Any) -> None:
    local, served = talkative_critics
    for query in QUERIES:
        for threshold in (None, 0.5, 1.0):
            a = served.decide_retrieval(query, threshold)
            b = local.decide_retrieval(query, threshold)
            assert a.retrieve == b.retrieve and a.answer == b.answer
            assert a.probability == pytest.approx(b.probability, abs=TOL)
        answer = local.generate(query)
        assert answer and served.generate(query) == answer


def test_tokens_outside_the_top_n_are_fetched_exactly(critics: Any) -> None:
    local, served = critics
    with ServedReflectionCritic(served.root, max_new_tokens=MAX_NEW, top_logprobs=1) as narrow:
        judgements = narrow.judge(QUERIES[2], PARAGRAPHS)
        assert_same(judgements, local.judge(QUERIES[2], PARAGRAPHS))
        # With one candidate per position, every group needs a follow-up (never a KeyError,
        # never a silent -100).
        assert all("relevance" in j.details["refetched"] for j in judgements)
        gate = narrow.decide_retrieval(QUERIES[0], 0.5)
        assert gate.probability == pytest.approx(
            local.decide_retrieval(QUERIES[0], 0.5).probability, abs=TOL
        )


def test_bound_mode_is_flagged(critics: Any) -> None:
    _, served = critics
    with ServedReflectionCritic(
        served.root, max_new_tokens=MAX_NEW, top_logprobs=1, missing_logprobs="bound"
    ) as bounded:
        for j in bounded.judge(QUERIES[0], PARAGRAPHS):
            # Only the greedy token is shown; the other relevance token gets its log-prob as an
            # upper bound, so both count equally, and the judgement says so.
            assert "relevance" in j.details["bounded"]
            assert j.relevance == pytest.approx(0.5)


@pytest.mark.parametrize("typing", ["user_defined", "control"])
def test_llama_servers_openai_completions_equal_the_in_process_scores(
    typing: str, tiny_llm: Any, tiny_llm_control: Any, llama_server: Any, talkative: Any
) -> None:
    # llama-server's /v1 entries carry token ids, and its /tokenize gives the prompts' ids: both
    # typings work, and follow-ups go to the same server's native API.
    llm = tiny_llm if typing == "user_defined" else tiny_llm_control
    url = llama_server(typing).url + "/v1"
    with (
        ReflectionCritic(llm, max_new_tokens=MAX_NEW, n_seq_max=4) as local,
        ServedReflectionCritic(url, api="openai", max_new_tokens=MAX_NEW, top_logprobs=2) as served,
    ):
        judgements = served.judge(QUERIES[0], PARAGRAPHS)
        assert_same(judgements, local.judge(QUERIES[0], PARAGRAPHS))
        assert all(j.details["server"] == "llama.cpp" for j in judgements)
        assert not any("bounded" in j.details for j in judgements)
        assert any("refetched" in j.details for j in judgements)
        assert served.info.api == "openai" and served.info.verified
        gate = served.decide_retrieval(QUERIES[1], 0.5)
        assert gate.probability == pytest.approx(
            local.decide_retrieval(QUERIES[1], 0.5).probability, abs=TOL
        )
    # The tiny model answers '' with no evidence: the answers are compared on the talkative one.
    model, root = talkative[typing]
    with (
        ReflectionCritic(model, max_new_tokens=MAX_NEW) as local,
        ServedReflectionCritic(root + "/v1", api="openai", max_new_tokens=MAX_NEW) as served,
    ):
        answer = local.generate(QUERIES[2])
        assert answer and served.generate(QUERIES[2]) == answer


def test_a_penalty_the_client_cannot_turn_off_fails_the_judgement(llama_server: Any) -> None:
    from served.stub import Reply, StubServer, forward

    upstream = llama_server("user_defined").url

    def penalise(method: str, path: str, body: Any) -> Reply:
        # As if the server (or a proxy before it) ignored the request's sampler chain.
        if path == "/completion" and not body.get("post_sampling_probs"):
            body = {**body, "samplers": ["penalties", "top_k"], "presence_penalty": 1.5}
        return forward(upstream, method, path, body)

    with (
        StubServer(penalise) as proxy,
        ServedReflectionCritic(proxy.url, max_new_tokens=MAX_NEW, timeout=30) as served,
        pytest.raises(ServerNotGreedy) as caught,
    ):
        for query in QUERIES:
            served.judge(query, PARAGRAPHS)
    message = str(caught.value)
    assert f"{proxy.url}/completion (llama.cpp)" in message
    assert f"at generated position {caught.value.position}" in message
    assert "cannot turn off" in message


def test_a_model_without_reflection_tokens_is_refused(llama_server: Any) -> None:
    with (
        ServedReflectionCritic(llama_server("none").url) as served,
        pytest.raises(MissingReflectionTokens, match="critic='prompted'"),
    ):
        served.connect()


def test_a_group_that_cannot_be_isolated_falls_back_to_the_whole_vocabulary(
    tiny_llm: Any, llama_server: Any
) -> None:
    from served.stub import Reply, StubServer, forward

    upstream = llama_server("user_defined").url

    def spoil(method: str, path: str, body: Any) -> Reply:
        if path == "/completion" and body.get("post_sampling_probs"):
            # As if another token had outranked the biased group.
            foreign = {"id": 3, "token": "x", "bytes": [120], "prob": 0.5}
            entry = {"id": 3, "token": "x", "bytes": [120], "prob": 0.5, "top_probs": [foreign]}
            return Reply.json({"tokens": [3], "completion_probabilities": [entry]})
        return forward(upstream, method, path, body)

    with ReflectionCritic(tiny_llm, max_new_tokens=MAX_NEW, n_seq_max=4) as local:
        with (
            StubServer(spoil) as proxy,
            ServedReflectionCritic(proxy.url, max_new_tokens=MAX_NEW, top_logprobs=1) as served,
        ):
            judgements = served.judge(QUERIES[1], PARAGRAPHS[:3])
        assert_same(judgements, local.judge(QUERIES[1], PARAGRAPHS[:3]))
    # Per paragraph: the group request, then the whole-vocabulary one.
    assert all(j.details["followup_requests"] >= 2 for j in judgements)


def test_a_paragraph_cut_to_fit_the_slot_is_shown_in_its_row(
    tiny_llm: Any, llama_server: Any
) -> None:
    # As in process: the paragraph is shortened from its end, with a warning, and its row says
    # by how many tokens; a paragraph that fits has no such entry.
    paragraphs = ["lorem ipsum " * 60, PARAGRAPHS[0]]
    url = llama_server("user_defined").url
    with (
        ServedReflectionCritic(url, max_new_tokens=MAX_NEW, timeout=30, n_ctx=120) as served,
        ReflectionCritic(tiny_llm, max_new_tokens=MAX_NEW, n_ctx=120) as local,
        pytest.warns(UserWarning, match="truncated"),
    ):
        cut, whole = served.judge(QUERIES[0], paragraphs)
        expected = local.judge(QUERIES[0], paragraphs)
    assert cut.error is None and cut.details["passage_cut"] > 50
    assert cut.details["passage_cut"] == expected[0].details["passage_cut"]
    assert "passage_cut" not in whole.details
    assert_same([cut, whole], expected)
