"""Self-RAG reflection formulas on hand-made log-probs (no model needed)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from llama_index.packs.self_rag_rse.critic.reflection import (
    FULLY_SUPPORTED,
    GROUNDING_TOKENS,
    IRRELEVANT,
    MISSING_LOGPROB,
    NO_RETRIEVAL,
    NO_SUPPORT,
    PARTIALLY_SUPPORTED,
    REFLECTION_TOKENS,
    RELEVANT,
    RETRIEVAL,
    SELF_RAG_SPECIAL_TOKENS,
    UTILITY_TOKENS,
    logprobs_from_top_dicts,
    relevance_score,
    retrieval_probability,
    score_generation,
    sequence_score,
    support_score,
    utility_score,
)

ln = math.log


def test_vocabulary_is_the_papers() -> None:
    assert len(REFLECTION_TOKENS) == 13
    assert len(set(SELF_RAG_SPECIAL_TOKENS)) == 15  # + <paragraph>, </paragraph>
    assert tuple(f"[Utility:{i}]" for i in range(1, 6)) == UTILITY_TOKENS
    assert "[No support / Contradictory]" in GROUNDING_TOKENS


def test_missing_tokens_get_minus_100() -> None:
    rows = logprobs_from_top_dicts([{RELEVANT: ln(0.6), "Paris": ln(0.3)}, None, {}])
    assert rows.shape == (3, 13)
    assert rows[0, REFLECTION_TOKENS.index(RELEVANT)] == pytest.approx(ln(0.6))
    assert rows[0, REFLECTION_TOKENS.index(IRRELEVANT)] == MISSING_LOGPROB
    assert np.all(rows[1:] == MISSING_LOGPROB)


def test_retrieval_probability_uses_probabilities_not_logprobs() -> None:
    rows = logprobs_from_top_dicts([{RETRIEVAL: ln(0.3), NO_RETRIEVAL: ln(0.1)}])
    # 0.3 / (0.3 + 0.1); dividing log-probs (the reference short-form bug) would give 0.343.
    assert retrieval_probability(rows) == pytest.approx(0.75)
    assert retrieval_probability(rows[0]) == pytest.approx(0.75)  # a single row works too


def test_retrieval_probability_with_one_token_missing() -> None:
    rows = logprobs_from_top_dicts([{RETRIEVAL: ln(0.2)}])
    expected = 0.2 / (0.2 + math.exp(-100))
    assert retrieval_probability(rows) == pytest.approx(expected)
    both_missing = logprobs_from_top_dicts([{}])
    assert retrieval_probability(both_missing) == pytest.approx(0.5)


def test_relevance_reads_the_first_position_only() -> None:
    rows = logprobs_from_top_dicts(
        [{RELEVANT: ln(0.2), IRRELEVANT: ln(0.6)}, {RELEVANT: ln(0.9), IRRELEVANT: ln(0.01)}]
    )
    assert relevance_score(rows) == pytest.approx(0.25)


def test_support_at_first_generated_grounding_token() -> None:
    top = [
        {RELEVANT: ln(0.9)},
        {"Paris": ln(0.8)},
        # first grounding token generated here
        {FULLY_SUPPORTED: ln(0.5), PARTIALLY_SUPPORTED: ln(0.2), NO_SUPPORT: ln(0.1)},
        {FULLY_SUPPORTED: ln(0.01), NO_SUPPORT: ln(0.9)},
    ]
    generated = [RELEVANT, "Paris", PARTIALLY_SUPPORTED, NO_SUPPORT]
    rows = logprobs_from_top_dicts(top)
    assert support_score(rows, generated) == pytest.approx((0.5 + 0.5 * 0.2) / 0.8)


def test_no_grounding_or_utility_token_generated_scores_zero() -> None:
    rows = logprobs_from_top_dicts([{FULLY_SUPPORTED: ln(0.9), UTILITY_TOKENS[4]: ln(0.9)}])
    assert support_score(rows, ["Paris"]) == 0.0
    assert utility_score(rows, ["Paris"]) == 0.0


def test_utility_weights_at_first_utility_token() -> None:
    probs = [0.1, 0.1, 0.2, 0.2, 0.4]
    top = [
        {"Paris": 0.0},
        {u: ln(p) for u, p in zip(UTILITY_TOKENS, probs, strict=True)},
        {UTILITY_TOKENS[0]: 0.0},  # a later utility token is ignored (the old pack used the last)
    ]
    generated = ["Paris", UTILITY_TOKENS[4], UTILITY_TOKENS[0]]
    expected = (-1 * 0.1 - 0.5 * 0.1 + 0 + 0.5 * 0.2 + 1 * 0.4) / 1.0
    assert utility_score(logprobs_from_top_dicts(top), generated) == pytest.approx(expected)


def test_group_ratios_are_stable_far_below_underflow() -> None:
    row = np.full(13, -5000.0)
    row[REFLECTION_TOKENS.index(RELEVANT)] = -4000.0
    row[REFLECTION_TOKENS.index(IRRELEVANT)] = -4000.0 + math.log(3)
    assert relevance_score(row) == pytest.approx(0.25)
    row[REFLECTION_TOKENS.index(RELEVANT)] = -np.inf
    row[REFLECTION_TOKENS.index(IRRELEVANT)] = -np.inf
    assert relevance_score(row) == 0.0  # no mass at all: no evidence of relevance


def test_token_ids_identify_generated_positions() -> None:
    ids = list(range(1000, 1013))
    rows = np.full((3, 13), -50.0)
    full = REFLECTION_TOKENS.index(FULLY_SUPPORTED)
    rows[1, full] = -0.1
    generated = [7, ids[full], 2]
    assert support_score(rows, generated, ids) == pytest.approx(
        math.exp(-0.1) / (math.exp(-0.1) + 2 * math.exp(-50.0))
    )
    with pytest.raises(ValueError, match="column_ids"):
        support_score(rows, generated, ids[:3])


def test_sequence_score_is_geometric_mean_probability() -> None:
    assert sequence_score([ln(0.5), ln(0.125)]) == pytest.approx(0.25)
    assert sequence_score([]) == 0.0


def test_score_generation_combines_everything() -> None:
    top = [
        {RELEVANT: ln(0.8), IRRELEVANT: ln(0.2)},
        {FULLY_SUPPORTED: ln(0.3), PARTIALLY_SUPPORTED: ln(0.3), NO_SUPPORT: ln(0.4)},
        {UTILITY_TOKENS[3]: ln(0.5), UTILITY_TOKENS[4]: ln(0.5)},
    ]
    generated = [RELEVANT, NO_SUPPORT, UTILITY_TOKENS[4]]
    scores = score_generation(logprobs_from_top_dicts(top), generated, [ln(0.8), ln(0.4), ln(0.5)])
    assert scores.relevance == pytest.approx(0.8)
    assert scores.support == pytest.approx(0.3 + 0.15)
    # the three other utility tokens are missing (-100): negligible
    assert scores.utility == pytest.approx(0.75)
    assert scores.seq_score == pytest.approx((0.8 * 0.4 * 0.5) ** (1 / 3))


def test_empty_generation_scores_zero() -> None:
    empty = np.empty((0, 13))
    assert retrieval_probability(empty) == 0.0
    assert score_generation(empty, [], []).relevance == 0.0


def test_wrong_shape_is_explained() -> None:
    with pytest.raises(ValueError, match="REFLECTION_TOKENS"):
        relevance_score(np.zeros((2, 3)))
