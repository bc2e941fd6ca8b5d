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


def samples(name: str, value: object) -> bool:
    """Whether a sampling knob set to ``value`` can change which token is chosen, by the knob's
    arithmetic (not by any server's table): multiplicative penalties and nucleus/typical cuts
    are off at 1, additive penalties and min-p at 0, top-k at 1 or below (1 keeps the argmax;
    0 and -1 keep every token).
    """
    if name in ("repeat_penalty", "repetition_penalty", "top_p", "typical_p"):
        return value != 1.0
    if name in ("temperature", "presence_penalty", "frequency_penalty", "min_p"):
        return value != 0.0
    if name in ("dry_multiplier", "xtc_probability", "mirostat", "mirostat_mode"):
        return value != 0
    if name == "top_k":
        return isinstance(value, int) and value > 1
    return False


@pytest.mark.parametrize("kind", [LLAMA_CPP, LLAMA_CPP_PYTHON, VLLM, OPENAI])
def test_each_kind_sends_only_values_that_do_not_sample(kind: str) -> None:
    sent = GREEDY[kind]
    assert sent["temperature"] == 0.0
    assert not [name for name, value in sent.items() if samples(name, value)]


def test_llama_cpp_pythons_own_sampling_defaults_are_all_turned_off() -> None:
    # Read from llama-cpp-python's server itself: temperature 0.8, top_k 40, repeat_penalty 1.1...
    from llama_cpp.server.types import CreateCompletionRequest

    defaults = {name: f.default for name, f in CreateCompletionRequest.model_fields.items()}
    sampling = {name for name, value in defaults.items() if samples(name, value)}
    assert "repeat_penalty" in sampling  # the default that changes greedy answers
    assert sampling <= set(GREEDY[LLAMA_CPP_PYTHON])


def test_request_options_win_over_the_greedy_fields() -> None:
    merged = greedy_options(VLLM, {"repetition_penalty": 1.2, "skip_special_tokens": False})
    assert merged["repetition_penalty"] == 1.2 and merged["skip_special_tokens"] is False
    assert merged["temperature"] == 0.0


def test_request_options_cannot_change_what_the_critic_reads_back() -> None:
    # They used to go on top of every field: {"n_predict": 2} cut every answer at two tokens,
    # {"n_probs": 3} or {"logprobs": 1} left the reflection tokens out of the log-probs, and
    # {"post_sampling_probs": True} had llama-server report the sampler's probabilities instead
    # of the raw logits' softmax the scores are defined on, all without a word.
    from llama_index.packs.self_rag_rse.served.apis import ServerInfo
    from llama_index.packs.self_rag_rse.served.http import JSONClient
    from llama_index.packs.self_rag_rse.served.llamacpp_api import LlamaCppAPI
    from llama_index.packs.self_rag_rse.served.openai_api import OpenAIAPI

    options = {"n_predict": 2, "max_tokens": 2, "n_probs": 3, "logprobs": 1, "prompt": "x"}
    options |= {"post_sampling_probs": True, "return_tokens": False, "stream": True}
    options |= {"cache_prompt": False, "repeat_penalty": 1.1}  # these two are the user's
    client = JSONClient("http://127.0.0.1:1")
    native = LlamaCppAPI(client, options)._body([1, 2], 40, 20)
    assert native["prompt"] == [1, 2] and native["n_predict"] == 40 and native["n_probs"] == 20
    assert native["post_sampling_probs"] is False and native["return_tokens"] is True
    assert native["stream"] is False
    assert native["cache_prompt"] is False and native["repeat_penalty"] == 1.1
    info = ServerInfo("openai", {}, True, sampling=greedy_options(OPENAI, options))
    body = OpenAIAPI(client, None, options)._body(info, "q", 40, 5)
    assert body["prompt"] == "q" and body["max_tokens"] == 40 and body["logprobs"] == 5
    assert body["repeat_penalty"] == 1.1
    client.close()


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
