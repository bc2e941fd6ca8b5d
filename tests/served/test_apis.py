"""The OpenAI-style API against canned ``/v1/completions`` bodies (vLLM-like servers).

No vLLM here: a stub on loopback answers in the legacy format, which is what vLLM, OpenAI and
llama-cpp-python's server send. What matters: tokens are identified by text (or vLLM's
``token_id:<id>``), a token outside the top N is bounded and flagged, and tokens that decode to
"" are reported as unidentifiable instead of scored wrongly.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from served.stub import Reply, StubServer

from llama_index.packs.self_rag_rse.self_rag.reflection import (
    FULLY_SUPPORTED,
    IRRELEVANT,
    NO_SUPPORT,
    PARTIALLY_SUPPORTED,
    RELEVANT,
    SELF_RAG_SPECIAL_TOKENS,
    UTILITY_TOKENS,
)
from llama_index.packs.self_rag_rse.self_rag.reflection_critic import MissingReflectionTokens
from llama_index.packs.self_rag_rse.served import (
    ReflectionTokensUnidentifiable,
    ServedReflectionCritic,
)


def legacy(tokens: list[str], tops: list[dict[str, float]], text: str | None = None) -> dict:
    chosen = [top.get(t, -5.0) for t, top in zip(tokens, tops, strict=True)]
    return {
        "choices": [
            {
                "text": text if text is not None else "".join(tokens),
                "finish_reason": "stop",
                "logprobs": {
                    "tokens": tokens,
                    "token_logprobs": chosen,
                    "top_logprobs": tops,
                },
            }
        ]
    }


#: An answer: [Relevant] Paris [Fully supported] [Utility:5]; [Irrelevant] is outside the top 3.
ANSWER = ["[Relevant]", " Paris", "[Fully supported]", "[Utility:5]"]
TOPS = [
    {RELEVANT: -0.1, " The": -3.0, " A": -3.5},
    {" Paris": -0.2, " Lyon": -2.0, " the": -3.0},
    {FULLY_SUPPORTED: -0.3, PARTIALLY_SUPPORTED: -1.5, NO_SUPPORT: -3.0},
    {u: -0.5 - i * 0.1 for i, u in enumerate(reversed(UTILITY_TOKENS))},
]


def openai_stub(echo: list[str] | None, answer: dict | None = None) -> StubServer:
    def handle(method: str, path: str, body: Any) -> Reply:
        if path == "/props":
            return Reply(404, b'{"error": "not found"}')
        if path == "/v1/completions" and body.get("echo"):
            if echo is None:
                return Reply.json({"error": {"message": "echo is not supported"}}, status=400)
            return Reply.json(legacy(echo, [{} for _ in echo], text=body["prompt"] + " x"))
        if path == "/v1/completions":
            assert body["temperature"] == 0.0 and body["logprobs"] == 3
            assert body["model"] == "selfrag"
            return Reply.json(answer or legacy(ANSWER, TOPS))
        return Reply(404, b"{}")

    return StubServer(handle)


def critic(url: str, **kwargs: Any) -> ServedReflectionCritic:
    return ServedReflectionCritic(
        url + "/v1", model="selfrag", top_logprobs=3, timeout=10, **kwargs
    )


def test_text_keys_score_and_a_missing_token_is_bounded_and_flagged() -> None:
    with openai_stub(["<s>", *SELF_RAG_SPECIAL_TOKENS]) as stub:
        c = critic(stub.url)
        try:
            (judgement,) = c.judge("What is the capital of France?", ["Paris is in France."])
        finally:
            c.close()
        assert c.info is not None and c.info.api == "openai" and c.info.verified
        assert judgement.answer == "Paris"
        # [Irrelevant] is bounded by the third-best log-prob at position 0 (-3.5).
        expected = 1 / (1 + math.exp(-3.5 - -0.1))
        assert judgement.relevance == pytest.approx(expected)
        assert judgement.details["bounded"] == ["relevance"]
        p = [math.exp(TOPS[2][t]) for t in (FULLY_SUPPORTED, PARTIALLY_SUPPORTED, NO_SUPPORT)]
        assert judgement.support == pytest.approx((p[0] + 0.5 * p[1]) / sum(p))
        assert judgement.utility > 0.0
        assert stub.count("/v1/completions") == 2  # the echo probe and the paragraph


def test_vllm_token_id_keys_identify_the_tokens() -> None:
    ids = {t: 32000 + i for i, t in enumerate(SELF_RAG_SPECIAL_TOKENS)}
    key = {t: f"token_id:{i}" for t, i in ids.items()}
    tops = [{key.get(t, t): v for t, v in top.items()} for top in TOPS]
    tops[0][key[IRRELEVANT]] = -2.0
    answer = legacy([key.get(t, t) for t in ANSWER], tops, text=" Paris")
    with openai_stub(["token_id:1", *key.values()], answer) as stub:
        c = critic(stub.url)
        try:
            (judgement,) = c.judge("q", ["p"])
        finally:
            c.close()
    assert "bounded" not in judgement.details
    assert judgement.relevance == pytest.approx(1 / (1 + math.exp(-2.0 - -0.1)))
    assert judgement.answer == "Paris"


def test_tokens_that_decode_to_nothing_are_reported_not_scored() -> None:
    with openai_stub(["", *([""] * len(SELF_RAG_SPECIAL_TOKENS))]) as stub:
        c = critic(stub.url)
        try:
            with pytest.raises(ReflectionTokensUnidentifiable, match=stub.url):
                c.connect()
        finally:
            c.close()


def test_a_model_without_the_tokens_is_refused() -> None:
    pieces = ["[", "Ret", "rieval", "]"] * 4
    with openai_stub(pieces) as stub:
        c = critic(stub.url)
        try:
            with pytest.raises(MissingReflectionTokens, match="critic='prompted'"):
                c.connect()
        finally:
            c.close()


def test_without_echo_the_tokens_are_assumed_and_empty_tokens_still_caught() -> None:
    empty = legacy(["", " Paris"], [{"": -0.1}, {" Paris": -0.1}])
    with openai_stub(None, empty) as stub:
        c = critic(stub.url)
        try:
            assert not c.connect().verified
            with pytest.raises(ReflectionTokensUnidentifiable, match="empty strings"):
                c.judge("q", ["p"])
        finally:
            c.close()


def test_exact_follow_ups_need_llama_cpp() -> None:
    with openai_stub(["<s>", *SELF_RAG_SPECIAL_TOKENS]) as stub:
        c = critic(stub.url, missing_logprobs="refetch")
        try:
            with pytest.raises(ValueError, match="missing_logprobs='bound'"):
                c.connect()
        finally:
            c.close()


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="http"):
        ServedReflectionCritic("localhost:8080")
    with pytest.raises(ValueError, match="api must be"):
        ServedReflectionCritic("http://127.0.0.1:1", api="vllm")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="missing_logprobs"):
        ServedReflectionCritic("http://127.0.0.1:1", missing_logprobs="zero")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="api_base"):
        ServedReflectionCritic.from_llm(object())
