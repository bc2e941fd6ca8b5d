"""The engine on a served model, chosen from an OpenAI-compatible LLM (factory selection).

``SelfRAGQueryEngine(llm=OpenAILike(api_base=...), critic="reflection" | "auto")`` must give the
same response and ``metadata["self_rag"]`` as the engine on the same model in process; the
prompted critic over the same kind of LLM reads label log-probs when the server returns them.
"""

from __future__ import annotations

from typing import Any

import pytest
from llama_index.llms.openai_like import OpenAILike
from retrievers import FixedRetriever
from served.stub import Reply, StubServer, forward

from llama_index.packs.self_rag_rse import (
    PromptedCritic,
    SelfRAGQueryEngine,
    ServedReflectionCritic,
)
from llama_index.packs.self_rag_rse.evaluation.runner import ModelCallCounter

QUESTION = "What does the while statement do?"


def served_llm(url: str, **kwargs: Any) -> OpenAILike:
    options: dict[str, Any] = {
        "api_base": f"{url}/v1",
        "model": "tiny-self-rag",
        "api_key": "none",
        "is_chat_model": False,
        "timeout": 30,
        "max_retries": 0,
    }
    options.update(kwargs)
    return OpenAILike(**options)


@pytest.mark.parametrize("typing", ["user_defined", "control"])
def test_served_engine_equals_the_in_process_engine(
    typing: str, tiny_llm: Any, tiny_llm_control: Any, llama_server: Any
) -> None:
    llm = tiny_llm if typing == "user_defined" else tiny_llm_control
    options: dict[str, Any] = {"max_new_tokens": 30, "threshold": 0.0, "use_seqscore": True}
    local = SelfRAGQueryEngine(llm=llm, retriever=FixedRetriever(), **options)
    with SelfRAGQueryEngine(
        llm=served_llm(llama_server(typing).url),
        retriever=FixedRetriever(),
        critic="reflection",
        **options,
    ) as served:
        assert isinstance(served.critic, ServedReflectionCritic)
        with ModelCallCounter() as served_calls:
            got = served.query(QUESTION)
        with ModelCallCounter() as local_calls:
            expected = local.query(QUESTION)
    local.close()
    a, b = got.metadata["self_rag"], expected.metadata["self_rag"]
    # Neither critic goes through an LLM request; both report their model's calls: in process
    # the gate's sequence and one per paragraph; served, a completion request each, and the
    # follow-ups that read log-probs the server left out.
    assert local_calls.counts() == {"llm_requests": 0, "critic_calls": 4, "model_calls": 4}
    followups = sum(row["details"].get("followup_requests", 0) for row in a["paragraphs"])
    calls = 4 + followups
    assert served_calls.counts() == {"llm_requests": 0, "critic_calls": calls, "model_calls": calls}
    assert got.response == expected.response
    assert a["critic"] == b["critic"] == "reflection"
    assert (a["retrieve"], a["best"]) == (b["retrieve"], b["best"])
    assert a["retrieve_prob"] == pytest.approx(b["retrieve_prob"], abs=1e-3)
    for x, y in zip(a["paragraphs"], b["paragraphs"], strict=True):
        assert x["node_id"] == y["node_id"] and x["answer"] == y["answer"]
        for key in ("relevance", "support", "utility", "seq_score", "score"):
            assert x[key] == pytest.approx(y[key], abs=1e-3), key
    assert [n.node.node_id for n in got.source_nodes] == [
        n.node.node_id for n in expected.source_nodes
    ]


def test_auto_picks_the_critic_from_what_the_server_serves(llama_server: Any) -> None:
    def engine(url: str, is_chat_model: bool = False) -> SelfRAGQueryEngine:
        llm = served_llm(url, is_chat_model=is_chat_model)
        return SelfRAGQueryEngine(llm=llm, retriever=FixedRetriever(), critic="auto")

    with (
        engine(llama_server("control").url) as reflection,
        engine(llama_server("none").url) as plain,
        engine(llama_server("control").url, is_chat_model=True) as chat,
    ):
        assert isinstance(reflection.critic, ServedReflectionCritic)
        assert isinstance(plain.critic, PromptedCritic)
        assert isinstance(chat.critic, PromptedCritic)  # chat endpoints carry no reflection


@pytest.mark.parametrize("chat", [True, False], ids=["chat_logprobs", "completion_parsed"])
def test_prompted_critic_over_a_served_llm(chat: bool, llama_server: Any) -> None:
    upstream = llama_server("none").url
    bodies: list[dict[str, Any]] = []

    def record(method: str, path: str, body: Any) -> Reply:
        if isinstance(body, dict):
            bodies.append(body)
        return forward(upstream, method, path, body)

    with StubServer(record) as proxy:
        llm = served_llm(proxy.url, is_chat_model=chat, max_tokens=8, temperature=0.0)
        if chat:
            llm = served_llm(
                proxy.url,
                is_chat_model=True,
                max_tokens=8,
                temperature=0.0,
                logprobs=True,
                top_logprobs=20,
            )
        with PromptedCritic.from_llm(llm, num_workers=2) as critic:
            judgements = critic.judge(QUESTION, [text for _, text, _ in _paragraphs()])
        # Answers and relevance of 3 paragraphs, then support and utility: 12 calls, 2 at once.
        assert len(proxy.requests) == 12 and proxy.max_in_flight <= 2
    assert all(j.error is None for j in judgements)
    methods = {j.details[name] for j in judgements for name in ("relevance", "support", "utility")}
    if chat:
        assert all(b.get("logprobs") is True and b.get("top_logprobs") == 20 for b in bodies)
        assert "logprobs" in methods  # label probabilities read from the returned log-probs
    else:
        # llama.cpp's /v1/completions log-probs are not in OpenAI's legacy shape, so LlamaIndex
        # returns none: the replies are parsed tolerantly instead.
        assert methods <= {"parsed", "fallback"}


def _paragraphs() -> list[tuple[str, str, str | None]]:
    from retrievers import PARAGRAPHS

    return PARAGRAPHS
