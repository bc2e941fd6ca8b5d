"""Greedy decoding per server kind: what is sent, how the kind is read, the top-1 check."""

from __future__ import annotations

import pytest

from llama_index.packs.self_rag_rse.served.greedy import (
    GREEDY,
    LLAMA_CPP,
    LLAMA_CPP_PYTHON,
    OPENAI,
    VLLM,
    ServerNotGreedy,
    check_greedy,
    greedy_options,
    server_kind,
)
from llama_index.packs.self_rag_rse.served.wire import Completion, Position

URL = "http://127.0.0.1:1/v1/completions"


def models(owner: object) -> dict:
    return {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": owner}]}


@pytest.mark.parametrize(
    ("answer", "kind"),
    [
        (models("llamacpp"), LLAMA_CPP),
        (models("me"), LLAMA_CPP_PYTHON),
        (models("vllm"), VLLM),
        (models("openai"), OPENAI),
        (models(None), OPENAI),
        ({"data": []}, OPENAI),
        ("<html>", OPENAI),
    ],
)
def test_the_server_kind_comes_from_the_model_owner(answer: object, kind: str) -> None:
    assert server_kind(answer) == kind


def test_each_kind_turns_its_own_defaults_off_and_request_options_win() -> None:
    assert GREEDY[LLAMA_CPP_PYTHON]["repeat_penalty"] == 1.0  # its server's default is 1.1
    assert GREEDY[VLLM]["repetition_penalty"] == 1.0 and GREEDY[VLLM]["top_k"] == -1
    assert GREEDY[LLAMA_CPP]["samplers"] == ["top_k"] and GREEDY[LLAMA_CPP]["top_k"] == 1
    assert set(GREEDY[OPENAI]) == {"temperature", "top_p", "presence_penalty", "frequency_penalty"}
    assert all(options["temperature"] == 0.0 for options in GREEDY.values())
    merged = greedy_options(VLLM, {"repetition_penalty": 1.2, "skip_special_tokens": False})
    assert merged["repetition_penalty"] == 1.2 and merged["skip_special_tokens"] is False


def completion(*positions: tuple[str, float, dict[str, float] | None]) -> Completion:
    return Completion([Position(k, lp, top) for k, lp, top in positions], "", True)


def test_greedy_completions_and_ties_pass() -> None:
    check_greedy(
        completion(
            ("a", -0.1, {"a": -0.1, "b": -2.0}),
            ("b", -0.69315, {"a": -0.69314, "b": -0.69315}),  # a tie, within rounding
            ("c", None, None),  # unreported: nothing to check
        ),
        server=LLAMA_CPP_PYTHON,
        url=URL,
        sent=GREEDY[LLAMA_CPP_PYTHON],
    )


def test_a_token_that_is_not_the_top_one_names_the_server_position_and_option() -> None:
    done = completion(("a", -0.1, {"a": -0.1}), ("b", -1.5, {"c": -0.3, "b": -1.5}))
    with pytest.raises(ServerNotGreedy) as caught:
        check_greedy(done, server=LLAMA_CPP, url=URL, sent=GREEDY[LLAMA_CPP])
    message = str(caught.value)
    assert caught.value.position == 1 and caught.value.url == URL
    assert URL in message and "(llama.cpp)" in message and "position 1" in message
    assert "'b'" in message and "'c'" in message and "--grammar" in message

    sent = greedy_options(LLAMA_CPP_PYTHON, {"repeat_penalty": 1.1})
    with pytest.raises(ServerNotGreedy, match=r"request_options sets repeat_penalty=1\.1"):
        check_greedy(done, server=LLAMA_CPP_PYTHON, url=URL, sent=sent)
    with pytest.raises(ServerNotGreedy, match=r"repetition_penalty"):
        check_greedy(done, server=OPENAI, url=URL, sent=GREEDY[OPENAI])
