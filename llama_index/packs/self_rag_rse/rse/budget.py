"""Segment search under a context budget: the segments worth most that fit, then a fill.

dsRAG stops at a chunk count, which only approximates what a prompt holds. Here chunk ``i``
costs ``first_costs[i]`` (characters or tokens, header included) when it begins a segment and
``step_costs[i]`` when it follows ``i - 1`` (overlap cut). Numpy only, no LlamaIndex.

1. :func:`find_budgeted_segments`: the non-touching segments (each worth ``minimum_value`` at
   least, at most ``max_length`` chunks) of largest total value that fit, exactly: a knapsack
   solved by dynamic programming over positions and budget.
2. :func:`fill_budget` spends what is left on the best remaining chunks, one at a time.

Memory: per budget cell a float64 state for each of the last ``max_length + 1`` end positions
and a byte per end position closing a candidate: about ``(C + 1) * (8 * (max_length + 6) + E)``
bytes, ``E`` the positions of value >= 0 (in RSE: the hits), ``C`` the budget or, when smaller,
the cost of every chunk a candidate covers, plus ~100 bytes per position.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from llama_index.packs.self_rag_rse.rse.segments import (
    as_value_matrix,
    checked_splits,
    positive_int,
)

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]

# Largest budget the search accepts in one piece: its arrays hold budget + 1 cells per state.
MAX_BUDGET = 10_000_000


def find_budgeted_segments(
    values: Sequence[float] | NDArray[Any],
    document_splits: Sequence[int] | NDArray[np.integer[Any]],
    first_costs: Sequence[int] | NDArray[np.integer[Any]],
    step_costs: Sequence[int] | NDArray[np.integer[Any]],
    budget: int,
    max_length: int,
    minimum_value: float,
) -> tuple[list[tuple[int, int]], list[float]]:
    """The segments of greatest total value whose costs fit ``budget``.

    ``values``: chunk values (:func:`~.values.chunk_value`; a 2-D array counts each chunk at its
    best row); ``document_splits``: increasing chunk indices where a document ends; costs: ints
    >= 0 per chunk (``[s, e)`` costs ``first_costs[s] + sum(step_costs[s+1:e])``). A segment lies
    inside one document, starts and ends on a chunk of value >= 0 (as dsRAG's), is worth its
    values' sum, and touches no other inside a document (no overlap text twice). The choice is
    the best of all that fit (float sums; ties prefer the cheaper). Returns ``(segments,
    scores)``: ``(start, end)`` pairs in document order, and their values.
    """
    row, splits, first, step, budget, max_length = _checked(
        values, document_splits, first_costs, step_costs, budget, max_length, minimum_value
    )
    n = row.shape[0]
    if n == 0:
        return [], []
    starts, ends, worth, costs = _candidates(row, splits, first, step, budget, max_length)
    keep = worth >= minimum_value
    starts, ends, worth, costs = starts[keep], ends[keep], worth[keep], costs[keep]
    if starts.shape[0] == 0:
        return [], []
    # No choice costs more than the chunks the candidates cover, each at its dearer cost: a
    # budget beyond that changes nothing, so the search's arrays never grow past it.
    covered = np.cumsum(np.bincount(starts, minlength=n + 1) - np.bincount(ends, minlength=n + 1))
    budget = min(budget, int(np.maximum(first, step)[covered[:n] > 0].sum()))
    chosen = _knapsack(starts, ends, worth, costs, budget, set(splits) | {0})
    picked = sorted(chosen, key=lambda c: int(starts[c]))
    return [(int(starts[c]), int(ends[c])) for c in picked], [float(worth[c]) for c in picked]


def fill_budget(
    segments: Sequence[tuple[int, int]],
    values: Sequence[float] | NDArray[Any],
    document_splits: Sequence[int] | NDArray[np.integer[Any]],
    first_costs: Sequence[int] | NDArray[np.integer[Any]],
    step_costs: Sequence[int] | NDArray[np.integer[Any]],
    budget: int,
    candidates: Sequence[int],
    max_length: int,
    least_piece: int = 0,
) -> list[tuple[int, int]]:
    """Spend the budget ``segments`` leave on the ``candidates`` (chunk positions), best value
    first (ties: the order given). A candidate next to a segment joins it (at its step cost),
    any other starts a one-chunk segment; one that does not fit (or makes a segment longer than
    ``max_length``) is skipped, and tried again when a neighbour joins. ``least_piece`` > 0: a
    piece of a chunk at least that long fills the rest (:func:`_room_for_piece`). Returns every
    segment, merged, in document order; their cost never exceeds ``budget``.
    """
    row, splits, first, step, budget, max_length = _checked(
        values, document_splits, first_costs, step_costs, budget, max_length, 0.0
    )
    n = row.shape[0]
    walls = np.zeros(n + 1, dtype=bool)  # walls[p]: p begins a document (or is the end)
    walls[[0, n, *[s for s in splits if s <= n]]] = True
    taken = np.zeros(n, dtype=bool)
    for start, end in segments:
        taken[start:end] = True
    spent = sum(int(first[s]) + int(step[s + 1 : e].sum()) for s, e in _runs(taken, walls))
    if spent > budget:
        raise ValueError(f"the segments given cost {spent}, more than the budget {budget}")
    if not isinstance(least_piece, int) or isinstance(least_piece, bool) or least_piece < 0:
        raise ValueError(f"least_piece must be an integer >= 0 (0: no pieces), got {least_piece!r}")
    positions = [int(p) for p in candidates]
    if any(not 0 <= p < n for p in positions):
        raise ValueError(f"candidate positions {positions} must lie inside the {n} chunks")
    order = sorted(range(len(positions)), key=lambda i: (-row[positions[i]], i))
    wanted = np.zeros(n, dtype=bool)
    wanted[positions] = True
    # The least a candidate can add (joining both neighbours turns one first cost into a step).
    bridge = np.minimum(0, np.concatenate([step[1:] - first[1:], [0]]))
    cheapest = int((np.minimum(first, step) + bridge)[wanted].min()) if positions else 0
    skipped: set[int] = set()
    for i in order:
        if budget - spent < cheapest:
            break
        retry = [positions[i]]
        while retry:
            p = retry.pop()
            if taken[p]:
                continue
            extra = _extra_cost(p, taken, walls, first, step)
            if spent + extra > budget or _joined_length(p, taken, walls) > max_length:
                skipped.add(p)
                continue
            taken[p] = True
            spent += extra
            skipped.discard(p)
            # A neighbour skipped for its cost may fit now that it would be a step.
            retry.extend(q for q in (p - 1, p + 1) if q in skipped)
    left = budget - spent
    _room_for_piece(taken, walls, row, first, step, positions, left, least_piece, max_length)
    return _runs(taken, walls)


# -- internals -------------------------------------------------------------------------------
def _checked(
    values: Any, splits: Any, first: Any, step: Any, budget: int, length: int, minimum: float
) -> tuple[FloatArray, list[int], IntArray, IntArray, int, int]:
    array = np.asarray(values, dtype=np.float64)
    # The search's own checks: finite values of sane size, splits inside and increasing.
    matrix = as_value_matrix(array[None, :] if array.ndim == 1 else array)
    row = matrix.max(axis=0) if matrix.shape[0] else np.zeros(matrix.shape[1])
    if minimum != minimum:
        raise ValueError("minimum_value is NaN: pass a number, e.g. 0.5")
    n = row.shape[0]
    first, step = _cost_array(first, n, "first_costs"), _cost_array(step, n, "step_costs")
    length = positive_int(length, "max_length", "the longest segment in chunks")
    try:
        budget = operator.index(budget)
    except TypeError:
        raise ValueError(f"budget must be an integer, got {budget!r}") from None
    if not 0 <= budget <= MAX_BUDGET:
        raise ValueError(f"budget must lie in [0, {MAX_BUDGET:,}], got {budget}")
    return row, checked_splits(splits, n), first, step, budget, length


def _cost_array(costs: Sequence[int] | NDArray[np.integer[Any]], n: int, name: str) -> IntArray:
    array = np.asarray(costs)
    if array.shape != (n,):
        raise ValueError(f"{name} needs one cost per chunk ({n}), got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{name} must be integers (characters or tokens), got {array.dtype}")
    if array.size and int(array.min()) < 0:
        raise ValueError(f"{name} must be >= 0, got {int(array.min())}")
    return array.astype(np.int64)


def _candidates(
    row: FloatArray, splits: list[int], first: IntArray, step: IntArray, budget: int,
    max_length: int,
) -> tuple[IntArray, IntArray, FloatArray, IntArray]:  # fmt: skip
    """Every segment that could be in a best choice: inside one document, both ends >= 0,
    within the budget, and worth more than every shorter segment from the same start (a longer
    one worth no more covers more chunks for no less cost, so it is never needed).
    """
    n = row.shape[0]
    length = min(max_length, n)
    wall = np.zeros(n + length, dtype=bool)  # a segment may not reach a wall after its start
    wall[[s for s in splits if s < n]] = True
    wall[n:] = True
    padded_values = np.concatenate([row, np.full(length, -1.0)])
    padded_steps = np.concatenate([step, np.zeros(length, dtype=np.int64)])
    alive = (row >= 0) & (first <= budget)
    worth = np.where(alive, row, -np.inf)
    cost = first.copy()
    best = np.full(n, -np.inf)
    empty = np.zeros(0, dtype=np.int64)
    found_starts, found_ends, found_worth, found_cost = [empty], [empty], [np.zeros(0)], [empty]
    for k in range(length):
        if k:
            alive &= ~wall[k : n + k]
            worth = worth + padded_values[k : n + k]
            cost = cost + padded_steps[k : n + k]
            alive &= cost <= budget
            if not alive.any():
                break
        hit = alive & (padded_values[k : n + k] >= 0) & (worth > best)  # both ends usable
        where = np.flatnonzero(hit)
        if where.shape[0]:
            found_starts.append(where)
            found_ends.append(where + k + 1)
            found_worth.append(worth[where])
            found_cost.append(cost[where])
            best[where] = worth[where]
    cat = np.concatenate
    return cat(found_starts), cat(found_ends), cat(found_worth), cat(found_cost)


def _knapsack(
    starts: IntArray, ends: IntArray, worth: FloatArray, costs: IntArray, budget: int,
    document_starts: set[int],
) -> list[int]:  # fmt: skip
    """Indices of the candidates in a best non-touching choice within ``budget``.

    ``state`` after an end position ``p`` holds, per budget ``b``, the best value of segments
    ending at or before ``p`` costing at most ``b``. A segment ``[s, e)`` extends the state
    after ``s - 1`` (after ``s`` when ``s`` begins a document), so chosen segments never touch.
    States are kept only while a later candidate can still read them; for the way back, each
    end position keeps which candidate won each budget.
    """
    cells = budget + 1
    order = np.lexsort((starts, ends))
    starts, ends, worth, costs = starts[order], ends[order], worth[order], costs[order]
    reach = int((ends - starts).max()) + 1
    state_ends: list[int] = []  # end positions with a state, increasing
    states: dict[int, FloatArray] = {}
    # Per end: the first candidate of its group and, per budget, 1 + the winner's place in the
    # group (0: none). A group holds one candidate per start, so a byte usually suffices.
    owners: dict[int, tuple[int, NDArray[np.unsignedinteger[Any]]]] = {}
    zeros = np.zeros(cells)
    current = zeros
    bounds = np.flatnonzero(np.diff(ends)) + 1
    for lo, hi in zip([0, *bounds], [*bounds, ends.shape[0]], strict=True):
        end = int(ends[lo])
        best = current.copy()
        owner = np.zeros(cells, dtype=np.min_scalar_type(hi - lo))
        for c in range(lo, hi):
            start, cost = int(starts[c]), int(costs[c])
            before = start if start in document_starts else start - 1
            j = bisect.bisect_right(state_ends, before) - 1
            base = states[state_ends[j]] if j >= 0 else zeros
            offer = base[: cells - cost] + worth[c]
            better = offer > best[cost:]
            if better.any():
                np.copyto(best[cost:], offer, where=better)
                owner[cost:][better] = c - lo + 1
        if owner.any():
            owners[end] = (lo, owner)
        current = best
        states[end] = best
        state_ends.append(end)
        # A later candidate reads a state at least `reach` positions before its end; keep the
        # newest state older than that too (it stands for every position after it).
        while len(state_ends) > 1 and state_ends[1] < end - reach:
            del states[state_ends.pop(0)]
    # The way back: the cheapest budget reaching the best value, then each end's winner.
    top = float(current.max())
    if top <= 0:
        return []
    b = int(np.flatnonzero(current >= top)[0])
    chosen: list[int] = []
    owner_ends = sorted(owners)
    k = len(owner_ends) - 1
    limit = owner_ends[-1] if owner_ends else -1
    while k >= 0 and b >= 0:
        end = owner_ends[k]
        k -= 1
        first, owner = owners[end]
        if end > limit or not owner[b]:
            continue
        c = first + int(owner[b]) - 1
        chosen.append(int(order[c]))
        b -= int(costs[c])
        start = int(starts[c])
        limit = start if start in document_starts else start - 1
    return chosen


def _room_for_piece(
    taken: NDArray[np.bool_], walls: NDArray[np.bool_], row: FloatArray, first: IntArray,
    step: IntArray, candidates: list[int], left: int, least: int, max_length: int,
) -> None:  # fmt: skip
    """With ``left`` of the budget unspent: a one-chunk segment of a later candidate gives its room
    to the first one left out if the piece (at least ``least`` long) made is worth more than it and
    the piece ``left`` makes (a piece: its share of the chunk's value), or its whole if it fits.
    """
    best = next((p for p in candidates if not taken[p] and row[p] > 0), None)
    if best is None or not least:
        return
    later, size = set(candidates[candidates.index(best) + 1 :]), max(1, int(first[best]))
    before = float(row[best]) * min(1.0, left / size) if left >= least else 0.0
    offers = [
        (float(row[best]) * min(1.0, (left + int(first[s])) / size) - max(0.0, float(row[s])), s)
        for s, e in _runs(taken, walls)
        if e - s == 1 and s in later and left + int(first[s]) >= least
    ]
    gain, drop = max(offers, default=(0.0, -1))
    if drop >= 0 and gain > before:
        taken[drop] = False
        whole = _extra_cost(best, taken, walls, first, step) <= left + int(first[drop])
        taken[best] = whole and _joined_length(best, taken, walls) <= max_length


def _extra_cost(
    p: int, taken: NDArray[np.bool_], walls: NDArray[np.bool_], first: IntArray, step: IntArray
) -> int:
    """What taking chunk ``p`` adds to the cost of the runs of ``taken``."""
    n = taken.shape[0]
    joins_left = p > 0 and bool(taken[p - 1]) and not walls[p]
    joins_right = p + 1 < n and bool(taken[p + 1]) and not walls[p + 1]
    extra = int(step[p]) if joins_left else int(first[p])
    if joins_right:  # the right segment's first chunk becomes a step
        extra += int(step[p + 1]) - int(first[p + 1])
    return extra


def _joined_length(p: int, taken: NDArray[np.bool_], walls: NDArray[np.bool_]) -> int:
    """Chunks in the segment that taking chunk ``p`` makes (it and the runs it joins)."""
    left, right = p, p + 1
    while left > 0 and not walls[left] and taken[left - 1]:
        left -= 1
    while right < taken.shape[0] and not walls[right] and taken[right]:
        right += 1
    return right - left


def _runs(taken: NDArray[np.bool_], walls: NDArray[np.bool_]) -> list[tuple[int, int]]:
    """The runs of ``taken`` chunks as ``(start, end)``, broken where a document starts."""
    starts = taken & (walls[:-1] | ~np.concatenate([[False], taken[:-1]]))
    ends = taken & (walls[1:] | ~np.concatenate([taken[1:], [False]]))
    begin, end = np.flatnonzero(starts).tolist(), (np.flatnonzero(ends) + 1).tolist()
    return list(zip(begin, end, strict=True))
