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
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from llama_index.packs.self_rag_rse.rse.segments import (
    FloatArray,
    IntArray,
    as_value_matrix,
    checked_splits,
    positive_int,
)
from llama_index.packs.self_rag_rse.rse.values import MAX_BUDGET


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
    search = _checked(
        values=values,
        document_splits=document_splits,
        first_costs=first_costs,
        step_costs=step_costs,
        budget=budget,
        max_length=max_length,
        minimum_value=minimum_value,
    )
    n = search.values.shape[0]
    if n == 0:
        return [], []
    candidates = _candidates(search)
    candidates = candidates.subset(candidates.worth >= minimum_value)
    if candidates.starts.shape[0] == 0:
        return [], []
    # No choice costs more than the chunks the candidates cover, each at its dearer cost: a
    # budget beyond that changes nothing, so the search's arrays never grow past it.
    # How many candidates hold each position: those opened up to it less those closed.
    covering = np.cumsum(
        np.bincount(candidates.starts, minlength=n + 1)
        - np.bincount(candidates.ends, minlength=n + 1)
    )
    covered_cost = np.maximum(search.first, search.step)[covering[:n] > 0].sum()
    reachable = min(search.budget, int(covered_cost))
    chosen = _knapsack(
        candidates,
        budget=reachable,
        document_starts=set(search.splits) | {0},
    )
    picked = sorted(chosen, key=lambda c: int(candidates.starts[c]))
    return (
        [(int(candidates.starts[c]), int(candidates.ends[c])) for c in picked],
        [float(candidates.worth[c]) for c in picked],
    )


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
    search = _checked(
        values=values,
        document_splits=document_splits,
        first_costs=first_costs,
        step_costs=step_costs,
        budget=budget,
        max_length=max_length,
        minimum_value=0.0,
    )
    row = search.values
    first = search.first
    step = search.step
    n = row.shape[0]
    walls = np.zeros(n + 1, dtype=bool)  # walls[p]: p begins a document (or is the end)
    walls[[0, n, *[s for s in search.splits if s <= n]]] = True
    taken = np.zeros(n, dtype=bool)
    for start, end in segments:
        taken[start:end] = True
    spent = sum(int(first[s]) + int(step[s + 1 : e].sum()) for s, e in _runs(taken, walls))
    if spent > search.budget:
        raise ValueError(
            f"the segments given cost {spent}, more than the budget {search.budget}: pass "
            "segments that fit it (those find_budgeted_segments returned for this budget)"
        )
    if not isinstance(least_piece, int) or isinstance(least_piece, bool) or least_piece < 0:
        raise ValueError(
            f"least_piece must be an integer >= 0 (0: no pieces), got {least_piece!r}: pass the "
            "shortest piece worth filling with, e.g. 100"
        )
    positions = [int(p) for p in candidates]
    if any(not 0 <= p < n for p in positions):
        raise ValueError(
            f"candidate positions {positions} must lie inside the {n} chunks: pass positions "
            "0 to n - 1 of the values given"
        )
    order = sorted(range(len(positions)), key=lambda i: (-row[positions[i]], i))
    # The least a candidate can add (joining both neighbours turns one first cost into a step).
    bridge = np.minimum(0, np.concatenate([step[1:] - first[1:], [0]]))
    cheapest = int((np.minimum(first, step) + bridge)[positions].min()) if positions else 0
    skipped: set[int] = set()
    for i in order:
        if search.budget - spent < cheapest:
            break
        retry = [positions[i]]
        while retry:
            p = retry.pop()
            if taken[p]:
                continue
            extra = _extra_cost(p, taken=taken, walls=walls, first=first, step=step)
            if spent + extra > search.budget or _joined_length(p, taken, walls) > search.max_length:
                skipped.add(p)
                continue
            taken[p] = True
            spent += extra
            skipped.discard(p)
            # A neighbour skipped for its cost may fit now that it would be a step.
            retry.extend(q for q in (p - 1, p + 1) if q in skipped)
    _room_for_piece(
        search,
        taken=taken,
        walls=walls,
        candidates=positions,
        left=search.budget - spent,
        least=least_piece,
    )
    return _runs(taken, walls)


# -- internals -------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Search:
    """The inputs of a budgeted search, checked: one value per chunk (a 2-D array's best row),
    the document ends, the costs as int64, the budget and the longest segment.
    """

    values: FloatArray
    splits: list[int]
    first: IntArray
    step: IntArray
    budget: int
    max_length: int


@dataclass(frozen=True)
class _Candidates:
    """Segments ``[starts[i], ends[i])`` worth ``worth[i]`` and costing ``costs[i]``."""

    starts: IntArray
    ends: IntArray
    worth: FloatArray
    costs: IntArray

    def subset(self, which: NDArray[Any]) -> _Candidates:
        """The candidates ``which`` selects (a mask, or indices in the order wanted)."""
        return _Candidates(
            starts=self.starts[which],
            ends=self.ends[which],
            worth=self.worth[which],
            costs=self.costs[which],
        )


def _checked(
    *,
    values: Any,
    document_splits: Any,
    first_costs: Any,
    step_costs: Any,
    budget: int,
    max_length: int,
    minimum_value: float,
) -> _Search:
    array = np.asarray(values, dtype=np.float64)
    # The search's own checks: finite values of sane size, splits inside and increasing.
    matrix = as_value_matrix(array[None, :] if array.ndim == 1 else array)
    row = matrix.max(axis=0) if matrix.shape[0] else np.zeros(matrix.shape[1])
    if minimum_value != minimum_value:
        raise ValueError("minimum_value is NaN: pass a number, e.g. 0.5")
    n = row.shape[0]
    first = _cost_array(first_costs, n, "first_costs")
    step = _cost_array(step_costs, n, "step_costs")
    length = positive_int(max_length, "max_length", "the longest segment in chunks")
    try:
        whole_budget = operator.index(budget)
    except TypeError:
        raise ValueError(
            f"budget must be an integer, got {budget!r}: pass the characters (or tokens) the "
            "segments may cost, e.g. 3000"
        ) from None
    if not 0 <= whole_budget <= MAX_BUDGET:
        raise ValueError(
            f"budget must lie in [0, {MAX_BUDGET:,}], got {whole_budget}: split a larger "
            "context into several calls"
        )
    return _Search(
        values=row,
        splits=checked_splits(document_splits, n),
        first=first,
        step=step,
        budget=whole_budget,
        max_length=length,
    )


def _cost_array(costs: Sequence[int] | NDArray[np.integer[Any]], n: int, name: str) -> IntArray:
    array = np.asarray(costs)
    if array.shape != (n,):
        raise ValueError(
            f"{name} needs one cost per chunk ({n}), got shape {array.shape}: pass a flat "
            "sequence as long as the values"
        )
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(
            f"{name} must be integers (characters or tokens), got {array.dtype}: round them "
            "up, e.g. np.ceil(costs).astype(int)"
        )
    if array.size and int(array.min()) < 0:
        raise ValueError(
            f"{name} must be >= 0, got {int(array.min())}: a chunk's cost is the text it adds"
        )
    return array.astype(np.int64)


def _candidates(search: _Search) -> _Candidates:
    """Every segment that could be in a best choice: inside one document, both ends >= 0,
    within the budget, and worth more than every shorter segment from the same start (a longer
    one worth no more covers more chunks for no less cost, so it is never needed).
    """
    row = search.values
    n = row.shape[0]
    length = min(search.max_length, n)
    wall = np.zeros(n + length, dtype=bool)  # a segment may not reach a wall after its start
    wall[[s for s in search.splits if s < n]] = True
    wall[n:] = True
    padded_values = np.concatenate([row, np.full(length, -1.0)])
    padded_steps = np.concatenate([search.step, np.zeros(length, dtype=np.int64)])
    alive = (row >= 0) & (search.first <= search.budget)
    worth = np.where(alive, row, -np.inf)
    cost = search.first.copy()
    best = np.full(n, -np.inf)
    empty = np.zeros(0, dtype=np.int64)
    found = [_Candidates(starts=empty, ends=empty, worth=np.zeros(0), costs=empty)]
    for k in range(length):
        if k:
            alive &= ~wall[k : n + k]
            worth = worth + padded_values[k : n + k]
            cost = cost + padded_steps[k : n + k]
            alive &= cost <= search.budget
            if not alive.any():
                break
        hit = alive & (padded_values[k : n + k] >= 0) & (worth > best)  # both ends usable
        where = np.flatnonzero(hit)
        if where.shape[0]:
            found.append(
                _Candidates(starts=where, ends=where + k + 1, worth=worth[where], costs=cost[where])
            )
            best[where] = worth[where]
    return _Candidates(
        starts=np.concatenate([f.starts for f in found]),
        ends=np.concatenate([f.ends for f in found]),
        worth=np.concatenate([f.worth for f in found]),
        costs=np.concatenate([f.costs for f in found]),
    )


def _knapsack(candidates: _Candidates, *, budget: int, document_starts: set[int]) -> list[int]:
    """Indices of the candidates in a best non-touching choice within ``budget``.

    ``state`` after an end position ``p`` holds, per budget ``b``, the best value of segments
    ending at or before ``p`` costing at most ``b``. A segment ``[s, e)`` extends the state
    after ``s - 1`` (after ``s`` when ``s`` begins a document), so chosen segments never touch.
    States are kept only while a later candidate can still read them; for the way back, each
    end position keeps which candidate won each budget.
    """
    cells = budget + 1
    order = np.lexsort((candidates.starts, candidates.ends))
    ordered = candidates.subset(order)
    starts = ordered.starts
    ends = ordered.ends
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
            start = int(starts[c])
            cost = int(ordered.costs[c])
            before = start if start in document_starts else start - 1
            j = bisect.bisect_right(state_ends, before) - 1
            base = states[state_ends[j]] if j >= 0 else zeros
            offer = base[: cells - cost] + ordered.worth[c]
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
        b -= int(ordered.costs[c])
        start = int(starts[c])
        limit = start if start in document_starts else start - 1
    return chosen


def _room_for_piece(
    search: _Search,
    *,
    taken: NDArray[np.bool_],
    walls: NDArray[np.bool_],
    candidates: list[int],
    left: int,
    least: int,
) -> None:
    """With ``left`` of the budget unspent: a one-chunk segment of a later candidate gives its room
    to the first one left out if the piece (at least ``least`` long) made is worth more than it and
    the piece ``left`` makes (a piece: its share of the chunk's value), or its whole if it fits.
    """
    row = search.values
    best = next((p for p in candidates if not taken[p] and row[p] > 0), None)
    if best is None or not least:
        return
    later = set(candidates[candidates.index(best) + 1 :])
    size = max(1, int(search.first[best]))
    before = float(row[best]) * min(1.0, left / size) if left >= least else 0.0
    offers = []
    for s, e in _runs(taken, walls):
        room = left + int(search.first[s])
        if e - s == 1 and s in later and room >= least:
            piece = float(row[best]) * min(1.0, room / size)
            offers.append((piece - max(0.0, float(row[s])), s))
    gain, drop = max(offers, default=(0.0, -1))
    if drop >= 0 and gain > before:
        taken[drop] = False
        extra = _extra_cost(best, taken=taken, walls=walls, first=search.first, step=search.step)
        whole = extra <= left + int(search.first[drop])
        taken[best] = whole and _joined_length(best, taken, walls) <= search.max_length


def _extra_cost(
    p: int,
    *,
    taken: NDArray[np.bool_],
    walls: NDArray[np.bool_],
    first: IntArray,
    step: IntArray,
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
    left = p
    right = p + 1
    while left > 0 and not walls[left] and taken[left - 1]:
        left -= 1
    while right < taken.shape[0] and not walls[right] and taken[right]:
        right += 1
    return right - left


def _runs(taken: NDArray[np.bool_], walls: NDArray[np.bool_]) -> list[tuple[int, int]]:
    """The runs of ``taken`` chunks as ``(start, end)``, broken where a document starts."""
    starts = taken & (walls[:-1] | ~np.concatenate([[False], taken[:-1]]))
    ends = taken & (walls[1:] | ~np.concatenate([taken[1:], [False]]))
    begins = np.flatnonzero(starts).tolist()
    stops = (np.flatnonzero(ends) + 1).tolist()
    return list(zip(begins, stops, strict=True))
