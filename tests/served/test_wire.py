"""Reading completion bodies: llama.cpp's native format, OpenAI's legacy one, llama.cpp's /v1."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from llama_index.packs.self_rag_rse.served.wire import (
    MalformedBody,
    id_key,
    key_id,
    parse_echo_tokens,
    parse_native,
    parse_native_post_sampling,
    parse_openai,
    split_tokens,
)


def entry(token: int, logprob: float, top: list[tuple[int, float, bytes]]) -> dict:
    return {
        "id": token,
        "logprob": logprob,
        "top_logprobs": [{"id": i, "logprob": lp, "bytes": list(b)} for i, lp, b in top],
    }


def test_native_positions_follow_the_generated_ids_and_mark_gaps() -> None:
    # Token 7 ends inside a UTF-8 character: llama.cpp reports no entry for it.
    body = {
        "content": "é!",
        "tokens": [5, 7, 9],
        "stop_type": "eos",
        "completion_probabilities": [
            entry(5, -0.1, [(5, -0.1, b"a"), (6, -2.5, b"b")]),
            entry(9, -0.3, [(9, -0.3, b"!"), (7, -1.5, b"\xc3")]),
        ],
    }
    completion = parse_native(body)
    assert completion.keys == [id_key(5), id_key(7), id_key(9)]
    first, gap, last = completion.positions
    assert first.reported and first.top == {id_key(5): -0.1, id_key(6): -2.5}
    assert first.piece == b"a"
    assert not gap.reported and gap.top is None
    assert last.logprob == -0.3 and last.pieces[id_key(7)] == b"\xc3"
    assert completion.stopped


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"tokens": [1, 2, 3, 4], "completion_probabilities": []},
        {"tokens": [1], "completion_probabilities": [entry(2, -1.0, [(2, -1.0, b"x")])]},
        {"tokens": ["a"], "completion_probabilities": []},
        {
            "tokens": [1],
            "completion_probabilities": [{"id": 1, "logprob": "x", "top_logprobs": []}],
        },
        {  # a candidate id that is no id
            "tokens": [1],
            "completion_probabilities": [
                {"id": 1, "logprob": -0.1, "top_logprobs": [{"id": "x", "logprob": -0.1}]}
            ],
        },
        {  # a byte that is no byte
            "tokens": [1],
            "completion_probabilities": [
                {
                    "id": 1,
                    "logprob": -0.1,
                    "top_logprobs": [{"id": 1, "logprob": -0.1, "bytes": [300]}],
                }
            ],
        },
    ],
)
def test_native_rejects_malformed_bodies(body: dict) -> None:
    with pytest.raises(MalformedBody):
        parse_native(body)


def test_openai_legacy_format_is_keyed_by_text() -> None:
    body = {
        "choices": [
            {
                "text": "[Relevant] Paris",
                "finish_reason": "length",
                "logprobs": {
                    "tokens": ["[Relevant]", " Paris"],
                    "token_logprobs": [-0.2, -0.5],
                    "top_logprobs": [{"[Relevant]": -0.2, "[Irrelevant]": -1.8}, {" Paris": -0.5}],
                },
            }
        ]
    }
    completion = parse_openai(body)
    assert completion.keys == ["[Relevant]", " Paris"]
    assert completion.positions[0].top == {"[Relevant]": -0.2, "[Irrelevant]": -1.8}
    assert not completion.stopped and completion.text == "[Relevant] Paris"


def test_openai_llama_cpp_content_format_is_keyed_by_text_too() -> None:
    body = {
        "choices": [
            {
                "text": "",
                "finish_reason": "stop",
                "logprobs": {
                    "content": [
                        {
                            "id": 3,
                            "token": "",
                            "logprob": -0.1,
                            "top_logprobs": [
                                {"id": 3, "token": "", "logprob": -0.1},
                                {"id": 4, "token": "", "logprob": -2.0},
                            ],
                        },
                    ]
                },
            }
        ]
    }
    completion = parse_openai(body)
    # Two CONTROL tokens both decode to "": one key, the second is lost (the upstream bug).
    assert completion.positions[0].top == {"": -0.1}
    assert completion.stopped


@pytest.mark.parametrize(
    "body",
    [
        {"choices": []},
        {"choices": [{"text": "x"}]},
        {"choices": [{"text": "x", "logprobs": {"tokens": ["a"], "token_logprobs": []}}]},
        {"choices": [{"text": 1, "logprobs": {}}]},
    ],
)
def test_openai_rejects_malformed_bodies(body: dict) -> None:
    with pytest.raises(MalformedBody):
        parse_openai(body)


def test_keys_echo_and_split() -> None:
    assert key_id(id_key(32005)) == 32005 and key_id("[Relevant]") is None
    assert key_id("token_id:12") == 12  # vLLM's return_tokens_as_token_ids
    echo = {"choices": [{"logprobs": {"tokens": ["<s>", "[Retrieval]"]}}]}
    assert parse_echo_tokens(echo) == ["<s>", "[Retrieval]"]
    assert split_tokens([1, 5, -1, 6, 7, -1], -1) == [[1, 5], [6, 7], []]
    assert split_tokens([{"id": 1, "piece": "a"}], -1) == [[1]]


# -- numbers from the server: log-probs are finite and <= 0, probabilities lie in [0, 1] ----------

BAD_LOGPROBS = [math.nan, math.inf, -math.inf, 0.5]


def _native(token_lp: float, candidate_lp: float) -> dict:
    return {
        "tokens": [5, 9],
        "completion_probabilities": [
            entry(5, -0.1, [(5, -0.1, b"a")]),
            entry(9, token_lp, [(9, candidate_lp, b"!"), (7, -2.0, b"?")]),
        ],
    }


def _legacy(token_lp: float, candidate_lp: float) -> dict:
    logprobs = {
        "tokens": ["[Relevant]", " Paris"],
        "token_logprobs": [-0.2, token_lp],
        "top_logprobs": [{"[Relevant]": -0.2}, {" Paris": candidate_lp, " Lyon": -2.0}],
    }
    return {"choices": [{"text": "[Relevant] Paris", "logprobs": logprobs}]}


def _content(token_lp: float, candidate_lp: float) -> dict:
    def item(token: str, lp: float, top: list[tuple[str, float]]) -> dict:
        tops = [{"token": t, "logprob": v} for t, v in top]
        return {"token": token, "logprob": lp, "top_logprobs": tops}

    content = [
        item("[Relevant]", -0.2, [("[Relevant]", -0.2)]),
        item(" Paris", token_lp, [(" Paris", candidate_lp), (" Lyon", -2.0)]),
    ]
    return {"choices": [{"text": "[Relevant] Paris", "logprobs": {"content": content}}]}


@pytest.mark.parametrize("bad", BAD_LOGPROBS)
@pytest.mark.parametrize(
    ("parse", "make"),
    [(parse_native, _native), (parse_openai, _legacy), (parse_openai, _content)],
    ids=["native", "legacy", "content"],
)
@pytest.mark.parametrize("where", ["token", "candidate"])
def test_a_logprob_that_is_no_logprob_is_refused_with_its_position(
    parse: Any, make: Any, where: str, bad: float
) -> None:
    body = make(bad, -0.3) if where == "token" else make(-0.3, bad)
    # As a server sends it: Python's json writes NaN and Infinity, and httpx reads them back.
    body = json.loads(json.dumps(body))
    with pytest.raises(MalformedBody, match=r"position 1\b.*not a log-prob"):
        parse(body)


@pytest.mark.parametrize(
    ("parse", "make"),
    [(parse_native, _native), (parse_openai, _legacy), (parse_openai, _content)],
    ids=["native", "legacy", "content"],
)
def test_a_logprob_rounded_just_above_zero_reads_as_zero(parse: Any, make: Any) -> None:
    completion = parse(make(1e-7, 2e-6))
    last = completion.positions[1]
    assert last.logprob == 0.0 and max(last.top.values()) == 0.0


def _post_sampling(prob: Any) -> dict:
    top = [{"id": 5, "prob": prob}, {"id": 6, "prob": 0.25}]
    return {"completion_probabilities": [{"id": 5, "top_probs": top}]}


@pytest.mark.parametrize("bad", [math.nan, math.inf, -0.1, 1.5, "0.5", True])
def test_a_probability_outside_zero_one_is_refused(bad: Any) -> None:
    with pytest.raises(MalformedBody, match=r"position 0\b.*probability"):
        parse_native_post_sampling(json.loads(json.dumps(_post_sampling(bad))))


def test_probabilities_in_range_become_logprobs() -> None:
    assert parse_native_post_sampling(_post_sampling(0.75)) == {
        id_key(5): pytest.approx(math.log(0.75)),
        id_key(6): pytest.approx(math.log(0.25)),
    }
    assert parse_native_post_sampling(_post_sampling(1.0 + 1e-7))[id_key(5)] == 0.0
    assert id_key(5) not in parse_native_post_sampling(_post_sampling(0.0))
