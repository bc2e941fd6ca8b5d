"""Tests for the RSE numeric core: a brute-force oracle, parity with dsRAG, edge cases, knobs."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import sys
from dataclasses import FrozenInstanceError, fields
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llama_index.packs.self_rag_rse import PRESETS, find_best_segments, get_preset
from llama_index.packs.self_rag_rse.rse import segments as segments_module
from llama_index.packs.self_rag_rse.rse.values import RSEPreset, adjust_for_length, chunk_value

Segments = tuple[list[tuple[int, int]], list[float]]


# ------------------------------------------------------------------------------------------------
# The oracle: every candidate segment enumerated, summed left to right, the best picked by key.
# Written differently from dsRAG on purpose (explicit candidate list and a max over a sort key).
# ------------------------------------------------------------------------------------------------


def _left_to_right_sum(values: list[float]) -> float:
    total = 0.0
    for value in values:
        total += value
    return total


def bruteforce(
    rows: list[list[float]],
    splits: list[int],
    max_length: int,
    overall_max_length: int,
    minimum_value: float,
) -> Segments:
    taken: list[tuple[int, int]] = []
    scores: list[float] = []
    total = 0
    active = list(range(len(rows)))
    position = 0
    while total < overall_max_length and active:
        position %= len(active)
        row = rows[active[position]]
        candidates = []
        for start in range(len(row)):
            for end in range(start + 1, len(row) + 1):
                fits = end - start <= min(max_length, overall_max_length - total)
                ends_ok = row[start] >= 0 and row[end - 1] >= 0
                crosses = any(start < split < end for split in splits)
                overlaps = any(start < b and a < end for a, b in taken)
                if fits and ends_ok and not crosses and not overlaps:
                    value = _left_to_right_sum(row[start:end])
                    candidates.append((value, -start, -end))
        if not candidates or max(candidates)[0] < minimum_value:
            active.pop(position)  # the next query slides into this position
            continue
        value, neg_start, neg_end = max(candidates)
        taken.append((-neg_start, -neg_end))
        scores.append(value)
        total += -neg_end + neg_start
        position += 1
    return taken, scores


def reference_numpy(
    values: np.ndarray,
    splits: list[int],
    max_length: int,
    overall_max_length: int,
    minimum_value: float,
) -> Segments:
    """A second oracle for inputs too big for the brute force: every (start, length) window of
    every turn summed left to right with numpy, the best picked by lexsort. No bounds, no
    incremental state.
    """
    n_queries, n = values.shape
    taken = np.zeros(n, dtype=bool)
    first_of_document = np.zeros(n, dtype=bool)
    first_of_document[[s for s in splits if s < n]] = True
    segments: list[tuple[int, int]] = []
    scores: list[float] = []
    active = list(range(n_queries))
    position = total = 0
    while total < overall_max_length and active:
        position %= len(active)
        row = values[active[position]]
        starts = np.arange(n)
        alive = (row >= 0) & ~taken
        acc = 0.0 + row
        found_value, found_start, found_end = [], [], []
        for k in range(min(max_length, overall_max_length - total, n)):
            if k:
                alive[: n - k] &= ~taken[k:] & ~first_of_document[k:]
                alive[n - k :] = False
                acc[: n - k] += row[k:]
            ends_ok = np.zeros(n, dtype=bool)
            ends_ok[: n - k] = row[k:] >= 0
            hit = alive & ends_ok
            found_value.append(acc[hit])
            found_start.append(starts[hit])
            found_end.append(starts[hit] + k + 1)
        value = np.concatenate(found_value) if found_value else np.zeros(0)
        if value.size == 0 or value.max() < minimum_value:
            active.pop(position)
            continue
        start_arr, end_arr = np.concatenate(found_start), np.concatenate(found_end)
        best = np.lexsort((end_arr, start_arr, -value))[0]
        start, end = int(start_arr[best]), int(end_arr[best])
        segments.append((start, end))
        scores.append(float(value[best]))
        taken[start:end] = True
        total += end - start
        position += 1
    return segments, scores


# ------------------------------------------------------------------------------------------------
# dsRAG's own implementation, loaded by path (its package __init__ pulls heavy dependencies).
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dsrag_rse() -> ModuleType:
    try:
        path = importlib.metadata.distribution("dsrag").locate_file("dsrag/rse.py")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(
            "dsRAG is the parity oracle for RSE: run `pip install --no-deps dsrag==0.5.6` "
            "(`make test` installs it)"
        )
    spec = importlib.util.spec_from_file_location("dsrag_rse_oracle", str(path))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dsrag_rows(values: np.ndarray) -> list[list[Any]]:
    """Rows as dsRAG's pipeline builds them (numpy float64 scalars).

    Before Python 3.12 plain floats give the same sums; from 3.12 the built-in ``sum`` of plain
    floats is compensated, so plain floats could differ from us in the last bit.
    """
    if sys.version_info < (3, 12):
        return [list(map(float, row)) for row in values]
    return [list(row) for row in values]


def random_case(rng: np.random.Generator, n: int, n_queries: int) -> dict[str, Any]:
    positive_share = rng.choice([0.02, 0.1, 0.4, 0.8])
    if rng.random() < 0.5:
        pool = np.array([0.0, 0.1, 0.2, 0.3, 0.45, 0.5, 0.7, 1.0])
        magnitude = rng.choice(pool, (n_queries, n))
    else:
        magnitude = rng.random((n_queries, n))
    sign = np.where(rng.random((n_queries, n)) < positive_share, 1.0, -1.0)
    values = sign * magnitude - (sign < 0) * 0.18
    n_splits = int(rng.integers(0, min(12, n) + 1))
    splits = sorted(int(s) for s in rng.choice(np.arange(1, n + 1), n_splits, replace=False))
    return {
        "values": values,
        "splits": splits,
        "max_length": int(rng.integers(1, 30)),
        "overall_max_length": int(rng.integers(1, 120)),
        "minimum_value": float(rng.choice([-1.0, 0.0, 0.4, 0.7, 1.5])),
    }


# ------------------------------------------------------------------------------------------------
# Property tests against the oracle.
# ------------------------------------------------------------------------------------------------

# A small discrete set forces ties; 0.1/0.2/0.3 make left-to-right float sums order-dependent.
TIE_VALUES = [-1.0, -0.5, -0.18, -0.0, 0.0, 0.1, 0.2, 0.3, 0.25, 0.5, 1.0]


@st.composite
def rse_inputs(draw: st.DrawFn, max_chunks: int = 30) -> dict[str, Any]:
    n = draw(st.integers(0, max_chunks))
    n_queries = draw(st.integers(1, 4))
    value = st.one_of(
        st.sampled_from(TIE_VALUES),
        st.floats(-1.0, 1.0, allow_nan=False, allow_infinity=False),
        st.sampled_from([-1e6, 1e-9, 3e5]),  # large magnitudes stress the summation bounds
    )
    rows = [draw(st.lists(value, min_size=n, max_size=n)) for _ in range(n_queries)]
    splits = sorted(draw(st.sets(st.integers(0, n), max_size=5)))
    return {
        "rows": rows,
        "splits": splits,
        "max_length": draw(st.integers(1, 12)),
        "overall_max_length": draw(st.integers(1, 40)),
        "minimum_value": draw(st.sampled_from([-1.0, 0.0, 0.3, 0.5, 1.0, 2.5])),
    }


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=rse_inputs())
def test_matches_bruteforce_oracle(case: dict[str, Any]) -> None:
    expected = bruteforce(
        case["rows"],
        case["splits"],
        case["max_length"],
        case["overall_max_length"],
        case["minimum_value"],
    )
    got = find_best_segments(
        case["rows"],
        case["splits"],
        case["max_length"],
        case["overall_max_length"],
        case["minimum_value"],
    )
    assert got == expected


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=rse_inputs(max_chunks=60))
def test_matches_dsrag_on_generated_inputs(dsrag_rse: ModuleType, case: dict[str, Any]) -> None:
    args = (case["splits"], case["max_length"], case["overall_max_length"], case["minimum_value"])
    matrix = np.array(case["rows"], dtype=np.float64).reshape(len(case["rows"]), -1)
    expected = dsrag_rse.get_best_segments(dsrag_rows(matrix), *args)
    assert find_best_segments(case["rows"], *args) == expected


@pytest.mark.parametrize(
    ("kind", "n", "max_length"),
    [
        ("uniform", 700, 3),
        ("discrete", 1_500, 40),
        ("constant", 40_000, 40),
        ("uniform", 40_000, 7),
    ],
)
def test_matches_numpy_reference_across_blocks_and_scan_paths(
    kind: str, n: int, max_length: int
) -> None:
    """Sizes that take the search through several blocks of starts, and (massive ties on
    40,000 chunks) through the contiguous exact scan, checked against the plain numpy oracle.
    """
    rng = np.random.default_rng(n + max_length)
    if kind == "uniform":
        values = rng.uniform(-0.3, 0.6, (3, n))
    elif kind == "discrete":
        values = rng.choice([-0.5, -0.18, 0.0, 0.1, 0.2, 0.3], (3, n))
    else:
        values = np.full((2, n), 0.25)
    splits = sorted(int(s) for s in rng.choice(np.arange(1, n), 9, replace=False))
    for overall, minimum in ((60, 0.0), (200, 0.4)):
        expected = reference_numpy(values, splits, max_length, overall, minimum)
        assert find_best_segments(values, splits, max_length, overall, minimum) == expected


def test_matches_numpy_reference_on_large_dense_inputs() -> None:
    rng = np.random.default_rng(99)
    kinds = ["uniform", "discrete", "constant", "sparse", "long-runs"]
    for trial in range(10):
        kind = kinds[trial % len(kinds)]
        n = int(rng.integers(5_000, 20_000))
        if kind == "uniform":
            values = rng.uniform(-1.0, 0.6, (3, n))
        elif kind == "discrete":
            values = rng.choice([-0.5, -0.18, 0.0, 0.1, 0.2, 0.3, 0.45], (3, n))
        elif kind == "constant":
            values = np.full((2, n), 0.25)
        elif kind == "sparse":
            values = np.where(rng.random((3, n)) < 0.03, rng.random((3, n)), -0.18)
        else:
            values = np.repeat(rng.choice([-0.4, 0.05, 0.3], (3, n // 25 + 1)), 25, axis=1)[:, :n]
        splits = sorted(int(s) for s in rng.choice(np.arange(1, n), 20, replace=False))
        max_length = int(rng.choice([1, 7, 40]))
        overall = int(rng.choice([30, 200, 333]))
        minimum = float(rng.choice([0.0, 0.4, 1.0]))
        expected = reference_numpy(values, splits, max_length, overall, minimum)
        got = find_best_segments(values, splits, max_length, overall, minimum)
        assert got == expected, (kind, n, max_length, overall, minimum)


def test_matches_dsrag_on_random_meta_documents(dsrag_rse: ModuleType) -> None:
    rng = np.random.default_rng(20240)
    for _ in range(150):
        case = random_case(rng, n=int(rng.integers(1, 400)), n_queries=int(rng.integers(1, 5)))
        args = (
            case["splits"],
            case["max_length"],
            case["overall_max_length"],
            case["minimum_value"],
        )
        expected = dsrag_rse.get_best_segments(dsrag_rows(case["values"]), *args)
        got = find_best_segments(case["values"], *args)
        assert got == expected, case


def test_matches_dsrag_on_a_100k_chunk_meta_document(dsrag_rse: ModuleType) -> None:
    # Cheap for dsRAG: few non-negative chunks, so its scan mostly skips.
    rng = np.random.default_rng(7)
    n = 100_000
    values = np.full((2, n), -0.18)
    for row in values:
        hits = rng.choice(n, 60, replace=False)
        row[hits] = chunk_value(np.arange(60), rng.uniform(0.3, 1.0, 60), 200)
        neighbours = hits[hits + 1 < n] + 1
        row[neighbours] = np.maximum(row[neighbours], 0.05)  # some just above zero
    splits = [10_000 * k for k in range(1, 11)]
    preset = get_preset("find_all")
    args = (splits, 10, 60, preset.minimum_value)
    expected = dsrag_rse.get_best_segments(dsrag_rows(values), *args)
    assert expected[0], "the case should produce segments"
    assert find_best_segments(values, *args) == expected


# ------------------------------------------------------------------------------------------------
# Tie-breaking and float sums.
# ------------------------------------------------------------------------------------------------


def test_left_to_right_sums_decide_near_ties(dsrag_rse: ModuleType) -> None:
    # 0.3 + 0.2 + 0.1 == 0.6 but 0.1 + 0.2 + 0.3 == 0.6000000000000001: dsRAG takes the later
    # window, and so must we (prefix-sum differences would round differently).
    rows = [[0.3, 0.2, 0.1, -5.0, 0.1, 0.2, 0.3]]
    expected = dsrag_rse.get_best_segments(dsrag_rows(np.array(rows)), [], 3, 3, 0.0)
    assert expected == ([(4, 7)], [0.1 + 0.2 + 0.3])
    assert find_best_segments(rows, [], 3, 3, 0.0) == expected


def test_exact_ties_go_to_smallest_start_then_shortest() -> None:
    segments, _ = find_best_segments([[0.5, -0.5, 0.5, 0.0, 0.5]], [], 5, 1, 0.0)
    assert segments == [(0, 1)]
    # Equal sums from the same start: [2, 3) and [2, 4) both give 0.5; the shorter wins.
    segments, _ = find_best_segments([[-1.0, -1.0, 0.5, 0.0, -1.0]], [], 5, 5, 0.1)
    assert segments == [(2, 3)]
    segments, _ = find_best_segments([[0.25] * 12], [], 4, 12, 0.0)
    assert segments == [(0, 4), (4, 8), (8, 12)]


def test_negative_zero_is_a_valid_end_and_scores_as_dsrag() -> None:
    segments, scores = find_best_segments([[-0.0]], [], 1, 1, 0.0)
    assert segments == [(0, 1)]
    assert math.copysign(1.0, scores[0]) == 1.0  # dsRAG's sum() starts from 0, giving +0.0


# ------------------------------------------------------------------------------------------------
# Round-robin, budget and splits.
# ------------------------------------------------------------------------------------------------


def test_round_robin_and_shared_budget() -> None:
    rows = [
        [1.0, 1.0, -1.0, -1.0, -1.0, -1.0, 0.6],
        [2.0, 2.0, -1.0, 2.0, 2.0, 0.9, -1.0],
    ]
    segments, scores = find_best_segments(rows, [], 5, 8, 0.5)
    # Query 0 first; query 1's best, [0, 5), overlaps it, so it takes [3, 6); query 0 then gets
    # [6, 7) from the 3 chunks left; nothing usable is left for query 1.
    assert segments == [(0, 2), (3, 6), (6, 7)]
    assert scores == [2.0, 2.0 + 2.0 + 0.9, 0.6]


def test_splits_cut_segments_and_budget_caps_length() -> None:
    row = [[0.5] * 10]
    segments, _ = find_best_segments(row, [4, 10], 10, 100, 0.0)
    assert segments == [(4, 10), (0, 4)]  # in the order picked: the longer document first
    segments, _ = find_best_segments(row, [], 10, 7, 0.0)
    assert segments == [(0, 7)]
    segments, _ = find_best_segments(row, [], 3, 7, 0.0)
    assert segments == [(0, 3), (3, 6), (6, 7)]


def test_minimum_value_drops_a_query_for_good() -> None:
    rows = [[0.2, -1.0, 0.2, -1.0, 1.0], [0.6, -1.0, -1.0, -1.0, -1.0]]
    segments, scores = find_best_segments(rows, [], 1, 10, 0.5)
    assert segments == [(4, 5), (0, 1)]
    assert scores == [1.0, 0.6]


# ------------------------------------------------------------------------------------------------
# Edge cases and return types.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rows",
    [[], [[]], [[], []], np.zeros((0, 0)), np.zeros((2, 0))],
    ids=["no-queries", "empty-row", "empty-rows", "empty-array", "zero-columns"],
)
def test_empty_input_gives_nothing(rows: Any) -> None:
    assert find_best_segments(rows, [], 5, 10, 0.0) == ([], [])


def test_single_chunk_and_all_negative() -> None:
    assert find_best_segments([[0.7]], [1], 5, 10, 0.5) == ([(0, 1)], [0.7])
    assert find_best_segments([[0.3]], [], 5, 10, 0.5) == ([], [])
    assert find_best_segments([[-0.1] * 50, [-2.0] * 50], [25], 5, 10, -100.0) == ([], [])


def test_max_length_one_picks_single_chunks() -> None:
    row = [0.1, 0.9, 0.5, -1.0, 0.8]
    assert find_best_segments([row], [], 1, 10, 0.0) == (
        [(1, 2), (4, 5), (2, 3), (0, 1)],
        [0.9, 0.8, 0.5, 0.1],
    )


def test_return_types_are_plain_python() -> None:
    segments, scores = find_best_segments(np.array([[0.5, 0.6, -1.0, 0.9]]), np.array([2]), 3, 5, 0)
    assert segments and all(type(a) is int and type(b) is int for a, b in segments)
    assert all(type(tup) is tuple for tup in segments)
    assert all(type(score) is float for score in scores)


def test_huge_max_length_does_not_allocate_by_it() -> None:
    assert find_best_segments([[0.5, 0.5]], [], 10**12, 10**12, 0.0) == ([(0, 2)], [1.0])


def test_a_million_chunks_are_searched_from_the_usable_starts_only(monkeypatch) -> None:
    """What keeps a million chunks fast: exact segment sums start only at chunks worth >= 0
    (the only chunks a segment may start on), each about once, never at every chunk.
    """
    scanned: list[int] = []
    scan = segments_module._QueryState._scan

    def counting(self: Any, starts: np.ndarray) -> Any:
        scanned.append(len(starts))
        return scan(self, starts)

    monkeypatch.setattr(segments_module._QueryState, "_scan", counting)
    rng = np.random.default_rng(3)
    n = 1_000_000
    values = np.full((3, n), -0.18)
    for row in values:
        hits = np.unique((rng.choice(n, 40)[:, None] + rng.integers(-8, 8, (40, 8))).ravel())
        hits = hits[(hits >= 0) & (hits < n)][:200]
        row[hits] = chunk_value(np.arange(hits.size), np.sort(rng.random(hits.size))[::-1], 200)
    splits = [100_000 * k for k in range(1, 11)]
    preset = get_preset("find_all")
    args = (splits, preset.max_length, preset.overall_max_length, preset.minimum_value)
    segments, _ = find_best_segments(values, *args)
    assert segments
    assert sum(scanned) <= 2 * int((values >= 0).sum())


# ------------------------------------------------------------------------------------------------
# Bad input.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_length": 0}, r"max_length must be >= 1"),
        ({"max_length": 2.5}, r"max_length must be an integer"),
        ({"overall_max_length": 0}, r"overall_max_length must be >= 1"),
        ({"minimum_value": float("nan")}, r"minimum_value is NaN"),
        ({"document_splits": [3, 2]}, r"strictly increasing.*sort them"),
        ({"document_splits": [2, 2]}, r"strictly increasing"),
        ({"document_splits": [7]}, r"outside the meta-document of 4 chunks"),
        ({"document_splits": [-1]}, r"outside the meta-document"),
        ({"document_splits": [1.5]}, r"integer chunk indices"),
        ({"all_relevance_values": [[0.1] * 4, [0.1] * 3]}, r"lengths \[4, 3\]"),
        ({"all_relevance_values": [0.1, 0.2]}, r"for a single query pass \[values\]"),
        ({"all_relevance_values": np.zeros(4)}, r"must be 2-D.*\[values\]"),
        ({"all_relevance_values": [[0.1, float("nan"), 0.2, 0.0]]}, r"query 0, chunk 1"),
        ({"all_relevance_values": [[0.1, 0.2, 0.0, float("inf")]]}, r"not finite"),
        ({"all_relevance_values": [[0.1, 0.2, -1e200, 0.0]]}, r"chunk 2 is too large.*rescale"),
    ],
)
def test_bad_input_raises_helpful_errors(kwargs: dict[str, Any], message: str) -> None:
    arguments: dict[str, Any] = {
        "all_relevance_values": [[0.1, 0.2, -0.3, 0.4]],
        "document_splits": [4],
        "max_length": 3,
        "overall_max_length": 5,
        "minimum_value": 0.0,
    }
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=message):
        find_best_segments(**arguments)


# ------------------------------------------------------------------------------------------------
# Chunk values, length adjustment, presets.
# ------------------------------------------------------------------------------------------------


def test_chunk_value_matches_dsrag(dsrag_rse: ModuleType) -> None:
    for rank, relevance in [(0, 0.9), (3, 0.5), (17, 1.0), (250, 0.7)]:
        info = {"rank": rank, "absolute_relevance_value": relevance}
        for decay, penalty in [(30, 0.18), (200, 0.2), (20, 0.05)]:
            assert chunk_value(rank, relevance, decay, penalty) == dsrag_rse.get_chunk_value(
                info, penalty, decay
            )
    # An unretrieved chunk: dsRAG's defaults (rank 1000, relevance 0) give -penalty exactly.
    assert dsrag_rse.get_chunk_value({}, 0.18, 30) == -0.18
    assert chunk_value(1000, 0.0) == -0.18
    assert chunk_value(np.inf, 0.8) == -0.18


def test_chunk_value_is_vectorised() -> None:
    ranks = np.arange(6).reshape(2, 3)
    values = chunk_value(ranks, 0.5, decay_rate=10, irrelevant_chunk_penalty=0.1)
    assert isinstance(values, np.ndarray) and values.shape == (2, 3)
    assert values[0, 0] == pytest.approx(0.4)
    assert np.all(np.diff(values.ravel()) < 0)  # lower rank, lower value
    assert isinstance(chunk_value(2, 0.5), float)
    with pytest.raises(ValueError, match="decay_rate must be > 0"):
        chunk_value(1, 0.5, decay_rate=0)


def test_adjust_for_length_matches_dsrag(dsrag_rse: ModuleType) -> None:
    values = [0.5, -0.18, 0.3, -0.2, 0.0]
    lengths = [1400, 1400, 300, 0, 2100]
    expected = dsrag_rse.adjust_relevance_values_for_chunk_length(values, lengths)
    got = adjust_for_length(values, lengths)
    assert got.tolist() == expected
    assert got.tolist() == [1.0, -0.36, 0.3, -0.2, 0.0]  # negatives scale too
    assert adjust_for_length(0.5, 350, reference_length=175) == 1.0
    with pytest.raises(ValueError, match="same shape"):
        adjust_for_length([0.1, 0.2], [700])
    with pytest.raises(ValueError, match="reference_length must be > 0"):
        adjust_for_length([0.1], [700], reference_length=0)


def test_presets_match_dsrag(dsrag_rse: ModuleType) -> None:
    assert (
        set(PRESETS) == set(dsrag_rse.RSE_PARAMS_PRESETS) == {"balanced", "precision", "find_all"}
    )
    for name, preset in PRESETS.items():
        theirs = dsrag_rse.RSE_PARAMS_PRESETS[name]
        for field in fields(RSEPreset):
            assert getattr(preset, field.name) == theirs[field.name], (name, field.name)
        assert get_preset(name) is preset
    assert PRESETS["find_all"] == RSEPreset(40, 200, 0.4, 0.18, 0, 200, 200)


def test_preset_budget_and_errors() -> None:
    balanced = get_preset("balanced")
    assert balanced.budget(1) == 30
    assert balanced.budget(3) == 40  # + 5 per extra query, as dsRAG
    assert get_preset("find_all").budget(4) == 200
    with pytest.raises(FrozenInstanceError):
        balanced.max_length = 3  # type: ignore[misc]
    with pytest.raises(ValueError, match=r"'balanced', 'precision', 'find_all'"):
        get_preset("precise")
