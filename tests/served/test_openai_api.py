"""The OpenAI-style API against canned ``/v1/completions`` bodies (vLLM-like servers).

No vLLM here (it needs a GPU): a stub on loopback answers in the legacy format, which is what
vLLM, OpenAI and llama-cpp-python's server send. What matters: tokens are identified by text (or
vLLM's ``token_id:<id>``), a token outside the top N is fetched exactly where the server allows
it and otherwise bounded and flagged, tokens that decode to "" are reported as unidentifiable
instead of scored wrongly, and each kind of server gets the fields that make it decode greedily.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from served.stub import Reply, StubServer

from llama_index.packs.self_rag_rse import ServedReflectionCritic
from llama_index.packs.self_rag_rse.critic.reflection import (
    FULLY_SUPPORTED,
    IRRELEVANT,
    NO_SUPPORT,
    PARTIALLY_SUPPORTED,
    RELEVANT,
    SELF_RAG_SPECIAL_TOKENS,
    UTILITY_TOKENS,
    MissingReflectionTokens,
)
from llama_index.packs.self_rag_rse.served import ReflectionTokensUnidentifiable


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
        with critic(stub.url) as c:
            (judgement,) = c.judge("What is the capital of France?", ["Paris is in France."])
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
    with openai_stub(["token_id:1", *key.values()], answer) as stub, critic(stub.url) as c:
        (judgement,) = c.judge("q", ["p"])
    assert "bounded" not in judgement.details
    assert judgement.relevance == pytest.approx(1 / (1 + math.exp(-2.0 - -0.1)))
    assert judgement.answer == "Paris"


def test_tokens_that_decode_to_nothing_are_reported_not_scored() -> None:
    with (
        openai_stub(["", *([""] * len(SELF_RAG_SPECIAL_TOKENS))]) as stub,
        critic(stub.url) as c,
        pytest.raises(ReflectionTokensUnidentifiable, match=stub.url),
    ):
        c.connect()


def test_a_model_without_the_tokens_is_refused() -> None:
    pieces = ["[", "Ret", "rieval", "]"] * 4
    with (
        openai_stub(pieces) as stub,
        critic(stub.url) as c,
        pytest.raises(MissingReflectionTokens, match="critic='prompted'"),
    ):
        c.connect()


def test_without_echo_the_tokens_are_assumed_and_empty_tokens_still_caught() -> None:
    empty = legacy(["", " Paris"], [{"": -0.1}, {" Paris": -0.1}])
    with openai_stub(None, empty) as stub, critic(stub.url) as c:
        assert not c.connect().verified
        with pytest.raises(ReflectionTokensUnidentifiable, match="empty strings"):
            c.judge("q", ["p"])


def test_exact_follow_ups_need_a_server_that_returns_more() -> None:
    # A generic server, without max_logprobs: nothing more to ask for than a completion did.
    with (
        openai_stub(["<s>", *SELF_RAG_SPECIAL_TOKENS]) as stub,
        critic(stub.url, missing_logprobs="refetch") as c,
        pytest.raises(ValueError, match="missing_logprobs='bound'"),
    ):
        c.connect()


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="http"):
        ServedReflectionCritic("localhost:8080")
    with pytest.raises(ValueError, match="api must be"):
        ServedReflectionCritic("http://127.0.0.1:1", api="vllm")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="missing_logprobs"):
        ServedReflectionCritic("http://127.0.0.1:1", missing_logprobs="zero")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="api_base"):
        ServedReflectionCritic.from_llm(object())
    with pytest.raises(ValueError, match="max_logprobs"):
        ServedReflectionCritic("http://127.0.0.1:1", top_logprobs=20, max_logprobs=5)


@pytest.mark.parametrize("bad", [math.nan, math.inf, 3.0])
def test_a_paragraph_with_a_bad_logprob_fails_instead_of_winning(bad: float) -> None:
    # The server's answer to the second paragraph has a [Relevant] log-prob that no probability
    # has: before, its relevance came out NaN (or above 1) and the engine ranked it first.
    spoiled = [dict(top) for top in TOPS]
    spoiled[0][RELEVANT] = bad
    answers = iter([legacy(ANSWER, TOPS), legacy(ANSWER, spoiled)])
    with openai_stub(["<s>", *SELF_RAG_SPECIAL_TOKENS]) as stub:
        stub.handler = _answers_in_turn(stub.handler, answers)
        with critic(stub.url, num_workers=1) as c:
            good, bad_one = c.judge("What is the capital of France?", ["Paris.", "Lyon."])
    assert good.error is None and 0.0 < good.relevance < 1.0
    assert bad_one.error is not None
    assert "MalformedResponse" in bad_one.error and f"{stub.url}/v1/completions" in bad_one.error
    assert "position 0" in bad_one.error and "not a log-prob" in bad_one.error
    assert (bad_one.relevance, bad_one.support, bad_one.utility) == (0.0, 0.0, 0.0)


def _answers_in_turn(handler: Any, answers: Any) -> Any:
    """``handler``, except that paragraph requests get the next of ``answers``."""

    def handle(method: str, path: str, body: Any) -> Reply:
        if path == "/v1/completions" and not body.get("echo"):
            return Reply.json(next(answers))
        return handler(method, path, body)

    return handle


def test_server_numbers_that_make_no_sense_are_not_used() -> None:
    from llama_index.packs.self_rag_rse.served.wire import positive_count

    assert positive_count(4096) == 4096
    for value in (0, -5, True, 2.5, "4096", None, math.nan):
        assert positive_count(value) is None


# --- vLLM: its greedy fields, token-id follow-ups, text follow-ups checked -----------------------

#: Token ids of the stub's vocabulary (vLLM with return_tokens_as_token_ids keys every token so).
IDS = {t: 32000 + i for i, t in enumerate(SELF_RAG_SPECIAL_TOKENS)}
IDS.update(
    {t: 500 + i for i, t in enumerate([" Paris", " Lyon", " the", " The", " A", " x", " y"])}
)
PROMPT_IDS = [1, 7, 8, 9]  # what the stub's /tokenize answers for any prompt
#: The completion's support position shows one grounding token only.
SUPPORT_SHOWN = {FULLY_SUPPORTED: -0.3, " x": -1.0, " y": -2.0}


def vllm_stub(followups: list[dict], *, consistent: bool = True) -> StubServer:
    """A vLLM-like server: ``owned_by: vllm``, token-id keys with ``return_tokens_as_token_ids``,
    a root ``/tokenize``; follow-up bodies go to ``followups``. A follow-up reports, at its
    position, what the completion showed plus the missing group members (lifted by the request's
    logit bias); with ``consistent=False`` a regenerated answer reports another distribution.
    """

    def handle(method: str, path: str, body: Any) -> Reply:
        if path == "/v1/models":
            return Reply.json({"data": [{"id": "selfrag", "owned_by": "vllm"}]})
        if path == "/tokenize":
            return Reply.json({"tokens": PROMPT_IDS, "count": len(PROMPT_IDS)})
        if path != "/v1/completions":
            return Reply(404, b"{}")
        ids = bool(body.get("return_tokens_as_token_ids"))

        def key(token: str) -> str:
            return f"token_id:{IDS[token]}" if ids else token

        if body.get("echo"):
            echoed = [key(t) for t in SELF_RAG_SPECIAL_TOKENS]
            return Reply.json(legacy(echoed, [{} for _ in echoed], text=body["prompt"] + " x"))
        for name, value in (("repetition_penalty", 1.0), ("top_k", -1), ("temperature", 0.0)):
            assert body[name] == value, name
        tops = [dict(TOPS[0]), dict(TOPS[1]), dict(SUPPORT_SHOWN), dict(TOPS[3])]
        if body["max_tokens"] == 50:  # the completion
            keyed = [{key(t): v for t, v in top.items()} for top in tops]
            return Reply.json(legacy([key(t) for t in ANSWER], keyed, text=" Paris"))
        followups.append(body)
        if isinstance(body["prompt"], list):  # token ids, one position
            at, shown = len(body["prompt"]) - len(PROMPT_IDS), 1
        else:  # the answer regenerated up to the position
            at, shown = body["max_tokens"] - 1, body["max_tokens"]
        tops[at].update({IRRELEVANT: -2.0} if at == 0 else TOPS[2])
        bias = body.get("logit_bias") or {}
        keyed = [{key(t): v + bias.get(str(IDS[t]), 0.0) for t, v in top.items()} for top in tops]
        peak = max(keyed[at].values())  # log-probs after the bias are normalised again
        if peak > 0:
            keyed[at] = {k: v - peak for k, v in keyed[at].items()}
        if not consistent:
            keyed[at] = {k: v - 0.5 for k, v in keyed[at].items()}
        tokens = [key(t) for t in ANSWER[at - shown + 1 : at + 1]]
        return Reply.json(legacy(tokens, keyed[at - shown + 1 : at + 1]))

    return StubServer(handle)


def usage(prompt_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": 1, "total_tokens": 0}


RELEVANCE = 1 / (1 + math.exp(-2.0 - -0.1))
GROUNDING = [math.exp(TOPS[2][t]) for t in (FULLY_SUPPORTED, PARTIALLY_SUPPORTED, NO_SUPPORT)]
SUPPORT = (GROUNDING[0] + 0.5 * GROUNDING[1]) / sum(GROUNDING)


def test_vllm_gets_its_greedy_fields_and_exact_follow_ups_by_token_ids() -> None:
    followups: list[dict] = []
    with (
        vllm_stub(followups) as stub,
        critic(stub.url, request_options={"return_tokens_as_token_ids": True}) as c,
    ):
        (judgement,) = c.judge("What is the capital of France?", ["Paris is in France."])
    assert c.info is not None and c.info.server == "vllm"
    assert judgement.details["refetched"] == ["relevance", "support"]
    assert "bounded" not in judgement.details
    # Position 0 continues the prompt by nothing; position 2 by [Relevant] and " Paris", as ids
    # after the prompt's own (from /tokenize: one more request); each group lifted by one bias.
    first, second = sorted(followups, key=lambda b: isinstance(b["prompt"], list))
    assert isinstance(first["prompt"], str) and first["max_tokens"] == 1
    assert second["prompt"] == [*PROMPT_IDS, IDS[RELEVANT], IDS[" Paris"]]
    lifted = {str(IDS[t]) for t in (FULLY_SUPPORTED, PARTIALLY_SUPPORTED, NO_SUPPORT)}
    assert set(second["logit_bias"]) == lifted and set(second["logit_bias"].values()) == {100.0}
    assert judgement.details["followup_requests"] == 3  # two completions and one /tokenize
    assert judgement.relevance == pytest.approx(RELEVANCE)
    assert judgement.support == pytest.approx(SUPPORT)


@pytest.mark.parametrize("consistent", [True, False])
def test_text_keyed_follow_ups_regenerate_and_must_reproduce_the_completion(
    consistent: bool,
) -> None:
    followups: list[dict] = []
    # Text keys: the server regenerates the answer up to each position, max_logprobs each.
    with (
        vllm_stub(followups, consistent=consistent) as stub,
        critic(stub.url, max_logprobs=50) as c,
    ):
        (judgement,) = c.judge("What is the capital of France?", ["Paris is in France."])
    assert sorted(b["max_tokens"] for b in followups) == [1, 3]
    assert all(b["logprobs"] == 50 and "logit_bias" not in b for b in followups)
    assert all(b["prompt"].endswith("Paris is in France.</paragraph>") for b in followups)
    if consistent:
        assert judgement.details["refetched"] == ["relevance", "support"]
        assert judgement.relevance == pytest.approx(RELEVANCE)
        assert judgement.support == pytest.approx(SUPPORT)
    else:
        assert judgement.details["bounded"] == ["relevance", "support"]
        assert "refetched" not in judgement.details


def test_without_max_logprobs_a_text_keyed_vllm_is_bounded_without_follow_ups() -> None:
    followups: list[dict] = []
    with vllm_stub(followups) as stub, critic(stub.url) as c:
        (judgement,) = c.judge("What is the capital of France?", ["Paris is in France."])
    assert followups == [] and judgement.details["bounded"] == ["relevance", "support"]


@pytest.mark.parametrize("status", [401, 429])
def test_a_query_whose_every_paragraph_failed_raises_instead_of_answering(status: int) -> None:
    # A wrong key or a rate limit fails every paragraph's request. The query used to answer
    # from no evidence, with the paragraphs it never judged attached as its sources.
    from retrievers import FixedRetriever

    from llama_index.packs.self_rag_rse import SelfRAGQueryEngine
    from llama_index.packs.self_rag_rse.served import ServerHTTPError

    refusal = {"error": {"message": "Rate limit reached", "code": status}}

    def handle(method: str, path: str, body: Any) -> Reply:
        if path == "/v1/completions" and not body.get("echo") and "<paragraph>" in body["prompt"]:
            return Reply.json(refusal, status=status)
        return handler(method, path, body)

    with openai_stub(["<s>", *SELF_RAG_SPECIAL_TOKENS]) as stub:
        handler, stub.handler = stub.handler, handle
        with critic(stub.url) as c:
            engine = SelfRAGQueryEngine(
                retriever=FixedRetriever(), critic=c, mode="always_retrieve"
            )
            with pytest.raises(ServerHTTPError, match=f"HTTP {status}.*Rate limit") as caught:
                engine.query("What is the capital of France?")
            assert caught.value.status == status


#: llama-cpp-python's server names each token by its own bytes decoded with errors="ignore":
#: the two byte tokens of "é" come back as "" and "" (its text and offsets keep the character).
CAFE = ["[Relevant]", " caf", "", "", " au", " lait", "[Fully supported]", "[Utility:5]"]
CAFE_TEXT = ["[Relevant]", " caf", "", "é", " au", " lait", "[Fully supported]", "[Utility:5]"]


def _llama_cpp_python_stub() -> StubServer:
    tops = [{t: -0.05, "x": -4.0} for t in CAFE]
    tops[0][IRRELEVANT] = -3.0

    def handle(method: str, path: str, body: Any) -> Reply:
        if path == "/v1/models":
            return Reply.json({"data": [{"id": "m", "object": "model", "owned_by": "me"}]})
        if path != "/v1/completions":
            return Reply(404, b"{}")
        if body.get("echo"):
            echo = ["<s>", *SELF_RAG_SPECIAL_TOKENS]
            return Reply.json(legacy(echo, [{} for _ in echo], text=body["prompt"] + " x"))
        offsets = [len(body["prompt"]) + len("".join(CAFE_TEXT[:i])) for i in range(len(CAFE))]
        if not body.get("stream"):
            logprobs = {"tokens": CAFE, "token_logprobs": [-0.05] * len(CAFE)}
            logprobs |= {"top_logprobs": tops, "text_offset": offsets}
            choice = {"text": "".join(CAFE_TEXT), "finish_reason": "stop", "logprobs": logprobs}
            return Reply.json({"choices": [choice]})
        events = b""
        for i, token in enumerate(CAFE):  # streamed: each token's own text, "" for both bytes
            logprobs = {"tokens": [token], "token_logprobs": [-0.05], "top_logprobs": [tops[i]]}
            logprobs["text_offset"] = [offsets[i]]
            finish = "stop" if i == len(CAFE) - 1 else None
            choice = {"text": token, "finish_reason": finish, "logprobs": logprobs}
            events += b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"
        return Reply(
            200, events + b"data: [DONE]\n\n", headers={"Content-Type": "text/event-stream"}
        )

    return StubServer(handle)


def test_a_character_split_across_tokens_keeps_its_text() -> None:
    # The answer used to join the tokens' names: "caf au lait", the "é" lost, judged and
    # streamed. Now the text is cut from the server's at its offsets; a stream that lost text
    # holds back from there and takes the rest from the non-streamed answer.
    with _llama_cpp_python_stub() as stub, ServedReflectionCritic(stub.url, timeout=10) as c:
        (judgement,) = c.judge("What drink?", ["Café au lait is coffee with milk."])
        assert c.info is not None and c.info.server == "llama-cpp-python"
        assert judgement.answer == "café au lait"
        assert c.generate("What drink?") == "café au lait"
        pieces = list(c.stream_generate("What drink?"))
        assert "".join(pieces) == "café au lait" and pieces[0] == "caf"


@pytest.mark.parametrize("tops", [None, "empty"])
def test_a_server_that_returns_no_top_logprobs_fails_instead_of_scoring(tops: Any) -> None:
    # top_logprobs null (or {} at every position) used to score every paragraph 0.5 on every
    # aspect, flagged "bounded" as if a bound existed, after up to 50 follow-up requests each.
    from llama_index.packs.self_rag_rse.served import MalformedResponse

    answer = legacy(ANSWER, TOPS)
    answer["choices"][0]["logprobs"]["top_logprobs"] = None if tops is None else [{}] * 4
    with openai_stub(["<s>", *SELF_RAG_SPECIAL_TOKENS], answer) as stub:
        with (
            critic(stub.url, max_logprobs=20) as c,
            pytest.raises(MalformedResponse, match=r"/v1/completions returned no top log"),
        ):
            c.judge("What is the capital of France?", ["Paris.", "Lyon."])
        assert stub.count("/v1/completions") == 3  # the echo probe and the two paragraphs
