"""Reply reading for the prompted critic: label scales, label log-probs, tolerant parsing."""

from __future__ import annotations

import math

import pytest

from llama_index.packs.self_rag_rse.critic.labels import (
    RELEVANCE_SCALE,
    RETRIEVAL_SCALE,
    SUPPORT_SCALE,
    UTILITY_SCALE,
    InvalidLogprob,
    LabelScale,
    checked_logprob,
    label_logprobs_from_top,
    normalised_probabilities,
    parse_reply,
)


@pytest.mark.parametrize(
    ("scale", "reply", "expected"),
    [
        (RELEVANCE_SCALE, "Yes", 1.0),
        (RELEVANCE_SCALE, "no.", 0.0),
        (RELEVANCE_SCALE, "**YES**", 1.0),
        (RELEVANCE_SCALE, "The paragraph is not relevant.", 0.0),
        (RELEVANCE_SCALE, "Irrelevant", 0.0),
        (RELEVANCE_SCALE, "It is relevant to the question.", 1.0),
        (RELEVANCE_SCALE, "No, it is relevant only to bananas.", 0.0),  # earliest word wins
        (RELEVANCE_SCALE, '{"relevant": "no"}', 0.0),
        (RELEVANCE_SCALE, '{"relevant": true}', 1.0),
        (RELEVANCE_SCALE, '```json\n{"score": 1}\n```', 1.0),
        (RELEVANCE_SCALE, 'Sure! ```\n{"answer": "Yes"}\n``` Hope that helps.', 1.0),
        (RELEVANCE_SCALE, '{"relevant": no', 0.0),  # malformed: bare word, no closing brace
        (RELEVANCE_SCALE, "{'answer': 'yes',}", 1.0),  # single quotes, trailing comma
        (RELEVANCE_SCALE, "{relevant: false}", 0.0),  # unquoted key
        (RELEVANCE_SCALE, "true", 1.0),
        (RELEVANCE_SCALE, "0.8", 0.8),
        (SUPPORT_SCALE, "Partly", 0.5),
        (SUPPORT_SCALE, "partially supported", 0.5),
        (SUPPORT_SCALE, "Fully supported.", 1.0),
        (SUPPORT_SCALE, "Not fully: the date is missing.", 0.5),
        (SUPPORT_SCALE, "not supported", 0.0),
        (SUPPORT_SCALE, "No support", 0.0),
        (SUPPORT_SCALE, '{"support": "PARTIAL"}', 0.5),
        (SUPPORT_SCALE, "Yes", 1.0),
        (UTILITY_SCALE, "4", 0.5),
        (UTILITY_SCALE, "Four.", 0.5),
        (UTILITY_SCALE, "Rating: 5/5", 1.0),
        (UTILITY_SCALE, "I'd rate it 2.", -0.5),
        (UTILITY_SCALE, "4.5", 0.75),
        (UTILITY_SCALE, "8/10", 0.6),  # rescaled onto 1..5: 4.2
        (UTILITY_SCALE, '{"score": "3"}', 0.0),
        (UTILITY_SCALE, '```\n{"rating": 1, "reason": "wrong"}\n```', -1.0),
        (RETRIEVAL_SCALE, "Yes.", 1.0),
        (RETRIEVAL_SCALE, "No, not needed.", 0.0),
    ],
)
def test_parse_reply_reads_labels(scale: LabelScale, reply: str, expected: float) -> None:
    reading = parse_reply(reply, scale)
    assert reading.method == "parsed", reading
    assert reading.score == pytest.approx(expected)


@pytest.mark.parametrize(
    ("scale", "reply", "note"),
    [
        (RELEVANCE_SCALE, "", "empty reply"),
        (RELEVANCE_SCALE, "   \n", "empty reply"),
        (RELEVANCE_SCALE, "I'm sorry, but I can't help with that.", "refusal"),
        (RELEVANCE_SCALE, "As an AI, I cannot determine that.", "refusal"),
        (RELEVANCE_SCALE, "Yes or No", "lists the options"),
        (SUPPORT_SCALE, "Yes, Partly or No", "lists the options"),
        (RELEVANCE_SCALE, "maybe", "no label"),
        (RELEVANCE_SCALE, '{"relevant": "maybe"}', "no label in JSON"),
        (UTILITY_SCALE, "7", "outside"),
        (UTILITY_SCALE, "0", "outside"),
        (UTILITY_SCALE, '{"score": 9}', "outside"),
        (UTILITY_SCALE, "10", "outside"),
        (UTILITY_SCALE, "very useful", "no label"),
        (UTILITY_SCALE, '{"useful": true}', "no label in JSON"),
    ],
)
def test_parse_reply_falls_back_with_a_reason(scale: LabelScale, reply: str, note: str) -> None:
    reading = parse_reply(reply, scale)
    assert reading.score is None
    assert reading.method == "fallback"
    assert reading.note is not None and note in reading.note


def test_label_logprobs_from_top_reads_the_first_position_naming_a_label() -> None:
    positions = [
        [("**", -0.1), ("The", -2.5)],
        [(" Yes", math.log(0.6)), ("yes", math.log(0.1)), ("No", math.log(0.1)), ("!", -3.0)],
        [("No", -0.01)],
    ]
    lps = label_logprobs_from_top(positions, RELEVANCE_SCALE)
    assert lps is not None
    assert normalised_probabilities(lps) == pytest.approx([0.875, 0.125])
    assert RELEVANCE_SCALE.expected_value(lps) == pytest.approx(0.875)
    # A label missing from the top list is practically impossible (-100), not an error.
    lps = label_logprobs_from_top([[("Part", -0.5), ("Yes", -1.0)]], SUPPORT_SCALE)
    assert lps is not None and lps[2] == -100.0
    assert label_logprobs_from_top([[("Hmm", -0.1)]], RELEVANCE_SCALE) is None


def test_expected_values_use_the_reflection_scales() -> None:
    assert SUPPORT_SCALE.expected_value([math.log(0.2), math.log(0.6), math.log(0.2)]) == (
        pytest.approx(0.2 + 0.5 * 0.6)
    )
    uniform = [0.0] * 5
    assert UTILITY_SCALE.expected_value(uniform) == pytest.approx(0.0)
    assert UTILITY_SCALE.expected_value([-100, -100, -100, -100, 0.0]) == pytest.approx(1.0)
    assert normalised_probabilities([-math.inf, -math.inf]) == [0.5, 0.5]
    # Log-probs far below float range still normalise (no underflow to 0/0).
    assert RELEVANCE_SCALE.expected_value([-2000.0, -2001.0]) == pytest.approx(
        1 / (1 + math.exp(-1))
    )


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 0.7])
def test_a_logprob_that_is_no_logprob_is_named_not_scored(bad: float) -> None:
    positions = [[("\n", -0.01)], [("No", math.log(0.3)), ("Yes", bad)]]
    with pytest.raises(InvalidLogprob, match=r"position 1, token 'Yes'.*not a log-prob"):
        label_logprobs_from_top(positions, RELEVANCE_SCALE)


def test_a_logprob_rounded_just_above_zero_reads_as_zero() -> None:
    lps = label_logprobs_from_top([[("Yes", 1e-7), ("No", -30.0)]], RELEVANCE_SCALE)
    assert lps is not None and lps[0] == 0.0
    assert checked_logprob(-2.5) == -2.5 and checked_logprob(3e-6) == 0.0
    for bad in (math.nan, math.inf, -math.inf, 0.01, "0", True, None):
        with pytest.raises(InvalidLogprob):
            checked_logprob(bad)


@pytest.mark.parametrize("values", [[math.nan, -1.0], [-1.0, math.nan], [math.inf, -1.0]])
def test_expected_values_never_come_out_nan(values: list[float]) -> None:
    # max() with a NaN depends on the order; either way there is no score to give.
    with pytest.raises(InvalidLogprob):
        RELEVANCE_SCALE.expected_value(values)
