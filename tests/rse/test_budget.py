"""The budgeted segment search against a brute force, and the fill's promises."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from llama_index.packs.self_rag_rse.rse.budget import fill_budget, find_budgeted_segments
from llama_index.packs.self_rag_rse.rse.values import MAX_BUDGET


def segment_cost(start, end, first, step):
    """What segment ``[start, end)`` costs: its first chunk's first cost plus the steps."""
    return int(first[start]) + int(sum(int(c) for c in step[start + 1 : end]))


def runs_of(taken, splits):
    """The runs of taken chunks, broken at document starts."""
    runs, start = [], None
    for p in range(len(taken) + 1):
        inside = p < len(taken) and taken[p]
        if start is not None and (not inside or p in splits):
            runs.append((start, p))
            start = None
        if inside and start is None:
            start = p
    return runs


def brute_force(values, splits, first, step, budget, max_length, minimum_value):
    """Best total value over every set of non-touching legal segments, by enumeration."""
    n = len(values)
    starts_of_documents = {0, *splits}
    legal = []
    for s in range(n):
        for e in range(s + 1, min(n, s + max_length) + 1):
            if any(p in starts_of_documents for p in range(s + 1, e)):
                break
            if values[s] < 0 or values[e - 1] < 0:
                continue
            worth = sum(values[s:e])
            if worth >= minimum_value:
                legal.append((s, e, worth, segment_cost(s, e, first, step)))
    best = 0.0
    for size in range(1, 5):
        for combo in itertools.combinations(legal, size):
            spans = sorted(combo)
            if any(b[0] <= a[1] - 1 for a, b in itertools.pairwise(spans)):
                continue  # overlapping
            if any(
                b[0] == a[1] and b[0] not in starts_of_documents
                for a, b in itertools.pairwise(spans)
            ):
                continue  # touching inside a document
            if sum(c[3] for c in spans) <= budget:
                best = max(best, sum(c[2] for c in spans))
    return best


def random_case(rng):
    n = int(rng.integers(1, 9))
    values = np.round(rng.normal(0.1, 0.5, n), 2)
    first = rng.integers(1, 30, n)
    step = np.maximum(0, first - rng.integers(0, 8, n))
    cuts = sorted(set(int(x) for x in rng.integers(1, n + 1, int(rng.integers(0, 3)))))
    splits = [*[c for c in cuts if c < n], n]
    budget = int(rng.integers(0, 80))
    return (
        values,
        splits,
        first,
        step,
        budget,
        int(rng.integers(1, 5)),
        float(rng.choice([0.0, 0.3, 0.6])),
    )


@pytest.mark.parametrize("seed", range(300))
def test_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    values, splits, first, step, budget, max_length, minimum = random_case(rng)
    segments, scores = find_budgeted_segments(
        values, splits, first, step, budget, max_length, minimum
    )
    expected = brute_force(values, splits, first, step, budget, max_length, minimum)
    assert sum(scores) == pytest.approx(expected, abs=1e-9)
    # What came back is itself legal: fits, non-touching, each segment worth its score.
    assert sum(segment_cost(s, e, first, step) for s, e in segments) <= budget
    for (s, e), score in zip(segments, scores, strict=True):
        assert score == pytest.approx(float(np.sum(values[s:e])))
        assert score >= minimum and e - s <= max_length
        assert values[s] >= 0 and values[e - 1] >= 0
        assert not any(p in splits for p in range(s + 1, e))
    for (_, e1), (s2, _) in itertools.pairwise(segments):
        assert s2 > e1 or s2 in splits


@pytest.mark.parametrize("seed", range(200))
def test_fill_never_exceeds_and_never_duplicates(seed):
    """Property: random lengths and overlaps; the filled runs never cost more than the budget,
    never overlap, and every candidate that fits on its own is in.
    """
    rng = np.random.default_rng(1000 + seed)
    n = int(rng.integers(1, 30))
    values = rng.normal(0.0, 0.5, n)
    lengths = rng.integers(20, 400, n)
    overlaps = np.minimum(lengths, rng.integers(0, 60, n))
    header = int(rng.integers(0, 50))
    first = lengths + header
    step = lengths - overlaps
    splits = sorted({*map(int, rng.integers(1, n + 1, 2)), n})
    budget = int(rng.integers(0, 3000))
    segments, _ = find_budgeted_segments(values, splits, first, step, budget, 5, 0.4)
    candidates = [int(p) for p in rng.permutation(n)[: int(rng.integers(0, n + 1))]]
    runs = fill_budget(segments, values, splits, first, step, budget, candidates, max_length=5)
    covered = [p for s, e in runs for p in range(s, e)]
    assert len(covered) == len(set(covered))  # no chunk (and so no overlap text) twice
    assert sum(segment_cost(s, e, first, step) for s, e in runs) <= budget
    for s, e in segments:  # the phase-1 segments are kept
        assert any(rs <= s and e <= re for rs, re in runs)
    taken = [p in covered for p in range(n)]
    assert all(e - s <= 5 for s, e in runs)
    for p in candidates:  # a candidate left out does not fit, or would make a run too long
        if not taken[p]:
            with_p = [t or q == p for q, t in enumerate(taken)]
            runs_with_p = runs_of(with_p, splits)
            cost = sum(segment_cost(s, e, first, step) for s, e in runs_with_p)
            assert cost > budget or any(e - s > 5 for s, e in runs_with_p)


def test_fill_joins_neighbours_and_bridges():
    values = np.array([0.9, -0.2, 0.8, 0.1, -0.2])
    first = np.array([110, 110, 110, 110, 110])
    step = np.array([100, 100, 100, 100, 100])
    # Segment [0, 1) chosen; chunk 2 and 3 are candidates; 1 bridges 0 and 2.
    runs = fill_budget([(0, 1)], values, [5], first, step, 310, [1, 2, 3], max_length=5)
    # 2 first (best value): a new segment, 110; then 3 joins it (100): 320 > 310, so it is
    # skipped; 1 bridges: 100 + (100 - 110) = 90 -> total 110 + 110 + 90 = 310.
    assert runs == [(0, 3)]


def test_fill_keeps_every_run_within_max_length():
    values = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
    cost = [10] * 6
    runs = fill_budget([], values, [6], cost, cost, 1000, list(range(6)), max_length=2)
    assert runs == [(0, 2), (3, 5)]  # chunks 2 and 5 would make runs of three
    runs = fill_budget([(0, 2)], values, [6], cost, cost, 1000, [2, 3], max_length=2)
    assert runs == [(0, 2), (3, 4)]


def test_a_strong_isolated_hit_is_a_one_chunk_segment():
    values = np.array([0.3, -0.18, -0.18, 0.9])
    segments, scores = find_budgeted_segments(values, [4], [100] * 4, [90] * 4, 150, 15, 0.5)
    assert segments == [(3, 4)] and scores == [pytest.approx(0.9)]


def test_ties_prefer_the_cheaper_choice():
    values = np.array([0.6, -1.0, 0.6])
    segments, _ = find_budgeted_segments(values, [3], [300, 1, 100], [0, 0, 0], 1000, 1, 0.5)
    # Both alone and together fit; together is worth more.
    assert segments == [(0, 1), (2, 3)]
    segments, _ = find_budgeted_segments(values, [3], [300, 1, 100], [0, 0, 0], 299, 1, 0.5)
    assert segments == [(2, 3)]


def test_nothing_fits():
    assert find_budgeted_segments([1.0, 1.0], [2], [50, 50], [40, 40], 10, 3, 0.1) == ([], [])
    assert find_budgeted_segments([], [], [], [], 10, 3, 0.1) == ([], [])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"first_costs": [1.5, 2.0]}, "integers"),
        ({"step_costs": [1, -1]}, ">= 0"),
        ({"first_costs": [1]}, "one cost per chunk"),
        ({"budget": -1}, "budget must lie"),
        ({"max_length": 0}, "max_length"),
        ({"values": [0.1, float("nan")]}, "finite"),
        ({"document_splits": [2, 1]}, "strictly increasing"),
    ],
)
def test_bad_input_is_named(kwargs, message):
    arguments = {
        "values": [0.5, 0.5],
        "document_splits": [2],
        "first_costs": [10, 10],
        "step_costs": [8, 8],
        "budget": 100,
        "max_length": 3,
        "minimum_value": 0.1,
    }
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=message):
        find_budgeted_segments(**arguments)


@pytest.mark.parametrize("least", [-1, 1.5, True, "100"])
def test_a_bad_least_piece_is_named(least):
    with pytest.raises(ValueError, match="least_piece must be an integer >= 0"):
        fill_budget([], [0.5, 0.5], [2], [10, 10], [8, 8], 100, [0, 1], 3, least)


@pytest.mark.parametrize("seed", range(20))
def test_a_budget_beyond_every_choice_changes_nothing_and_costs_no_memory(seed):
    """The search's arrays grow with the budget only up to what the candidates can cost: the
    largest budget returns what the exact cost of everything returns, in little memory.
    """
    import tracemalloc

    rng = np.random.default_rng(seed)
    n = 40
    values = np.round(rng.uniform(-0.3, 1.0, n), 3)
    first = rng.integers(50, 400, n)
    step = first - rng.integers(0, 40, n)
    splits = [15, 28, n]
    enough = int(first.sum())
    expected = find_budgeted_segments(values, splits, first, step, enough, 6, 0.2)
    tracemalloc.start()
    found = find_budgeted_segments(values, splits, first, step, MAX_BUDGET, 6, 0.2)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert found == expected
    # (sum of costs + 1) cells * (8 bytes * (max_length + 6) + 1 byte per end): < 2 MB;
    # a search sized to MAX_BUDGET would hold 80 MB per state.
    assert peak < 2_000_000


def test_a_weak_one_chunk_segment_gives_its_room_to_a_piece_of_a_better_hit():
    values = np.array([0.9, -0.2, 0.8, -0.2, 0.2])
    first = np.array([400, 100, 500, 100, 250])
    segments, _ = find_budgeted_segments(values, [5], first, first, 850, 5, 0.1)
    assert segments == [(0, 1), (4, 5)]  # whole chunks: 2 does not fit beside 0
    args = (values, [5], first, first, 850, [0, 2, 4])
    assert fill_budget(segments, *args, max_length=5) == [(0, 1), (4, 5)]
    # With pieces: 2's piece in 450 characters (0.8 * 450 / 500 = 0.72) beats 4 (0.2) and the
    # piece the 200 characters left would make (0.32).
    assert fill_budget(segments, *args, max_length=5, least_piece=100) == [(0, 1)]
    # A piece shorter than least_piece is worth nothing: no swap for 50 characters of room.
    few = np.array([400, 100, 500, 100, 50])
    assert fill_budget([(0, 1), (4, 5)], values, [5], few, few, 460, [0, 2, 4], 5, 100) == [
        (0, 1),
        (4, 5),
    ]
    # When the better hit then fits whole, it goes in whole.
    fits = np.array([400, 100, 440, 100, 250])
    assert fill_budget([(0, 1), (4, 5)], values, [5], fits, fits, 850, [0, 2, 4], 5, 100) == [
        (0, 1),
        (2, 3),
    ]


@pytest.mark.parametrize("seed", range(100))
def test_a_fill_with_pieces_never_exceeds_and_keeps_the_searched_segments(seed):
    """Property: with ``least_piece``, only a one-chunk segment of a candidate ranked below the
    piece's is ever given up; the cost stays within the budget and no chunk is taken twice.
    """
    rng = np.random.default_rng(5000 + seed)
    n = int(rng.integers(1, 30))
    values = rng.normal(0.0, 0.5, n)
    lengths = rng.integers(20, 400, n)
    first, step = lengths + 30, lengths - np.minimum(lengths, rng.integers(0, 60, n))
    splits = sorted({*map(int, rng.integers(1, n + 1, 2)), n})
    budget = int(rng.integers(0, 3000))
    segments, _ = find_budgeted_segments(values, splits, first, step, budget, 5, 0.4)
    candidates = [int(p) for p in rng.permutation(n)]
    plain = fill_budget(segments, values, splits, first, step, budget, candidates, 5)
    runs = fill_budget(segments, values, splits, first, step, budget, candidates, 5, 100)
    covered = [p for s, e in runs for p in range(s, e)]
    assert len(covered) == len(set(covered))
    assert sum(segment_cost(s, e, first, step) for s, e in runs) <= budget
    assert all(e - s <= 5 for s, e in runs)
    lost = [(s, e) for s, e in plain if not any(rs <= s and e <= re for rs, re in runs)]
    assert len(lost) <= 1 and all(e - s == 1 for s, e in lost)
    if lost:
        piece = next(
            p
            for p in candidates
            if p not in {q for s, e in plain for q in range(s, e)} and values[p] > 0
        )
        assert candidates.index(lost[0][0]) > candidates.index(piece)
