"""Reading completion bodies: llama.cpp's native format, OpenAI's legacy one, llama.cpp's /v1."""

from __future__ import annotations

import pytest

from llama_index.packs.self_rag_rse.served.wire import (
    MalformedBody,
    id_key,
    key_id,
    parse_echo_tokens,
    parse_native,
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
