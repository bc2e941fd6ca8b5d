"""Relevant Segment Extraction (RSE): chunk values in, best segments out.

RSE (from dsRAG) turns per-chunk relevance into a few contiguous *segments* of a document, so the
LLM reads whole passages instead of isolated top-k chunks. The recipe:

1. Lay the candidate documents end to end (a "meta-document"); ``document_splits`` mark where one
   document ends and the next begins, and no segment may cross one.
2. Give every chunk a value with :func:`~.values.chunk_value`: positive when it was retrieved high
   enough, ``-irrelevant_chunk_penalty`` when it was not retrieved at all. Optionally scale by
   chunk length with :func:`~.values.adjust_for_length`.
3. :func:`find_best_segments` picks the segments with the largest value sums, round-robin over the
   queries, within a per-segment and an overall length budget.

:func:`find_best_segments` returns exactly what dsRAG 0.5.6 ``rse.get_best_segments`` returns for
the same input. Instead of dsRAG's brute force (every start, every end, every turn) it keeps each
query's best segment per start, recomputes only what a taken segment made stale, and uses
prefix-sum upper bounds to skip starts that cannot win, so a million chunks take tens of
milliseconds rather than hours. Nothing here imports LlamaIndex; the only dependency is numpy.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]

# Number of per-start best values summarised by one block maximum: the argmax each turn reads
# n/_BLOCK block maxima plus one block instead of all n values.
_BLOCK = 256
# Most (start, length) cells one exact scan holds in memory at once (8 bytes each, a few arrays).
_SCAN_CELLS = 1 << 18
# Largest chunk value accepted: far beyond any real value, far below float64 overflow.
_LARGEST_VALUE = 1e100


def find_best_segments(
    all_relevance_values: Sequence[Sequence[float]] | NDArray[Any],
    document_splits: Sequence[int] | NDArray[np.integer[Any]],
    max_length: int,
    overall_max_length: int,
    minimum_value: float,
) -> tuple[list[tuple[int, int]], list[float]]:
    """Pick the best segments of a meta-document, exactly as dsRAG's ``get_best_segments``.

    - ``all_relevance_values``: one row of chunk values per query (see
      :func:`~.values.chunk_value`), all rows as long as the meta-document. A 2-D array works too.
    - ``document_splits``: strictly increasing chunk indices where a document ends (the last one
      may equal the meta-document length). A segment never contains both chunk ``split - 1`` and
      chunk ``split``.
    - ``max_length``: longest segment, in chunks.
    - ``overall_max_length``: total chunks over all segments (dsRAG adds
      ``overall_max_length_extension`` per extra query; see :meth:`RSEPreset.budget`).
    - ``minimum_value``: a query drops out for good when its best remaining segment sums to less.

    The queries take turns (0, 1, 2, ..., 0, 1, ...). On its turn a query takes its best segment:
    the largest sum of chunk values among segments whose first and last chunks are >= 0, no longer
    than ``max_length``, not overlapping a segment already taken (by any query), not crossing a
    document split, and short enough to fit in what is left of ``overall_max_length``. It stops
    when the budget is spent or every query has dropped out.

    Ties go to the smallest start, then the smallest end, as in dsRAG. Segment sums are the
    left-to-right float64 sums dsRAG's ``sum()`` computes, not prefix-sum differences, so ties
    that rounding would blur break the same way. (On Python >= 3.12 the built-in ``sum`` of plain
    Python floats is compensated, so dsRAG fed plain-float lists there may differ from us in the
    last bit, which can flip an exact tie; with numpy float values, as dsRAG's own pipeline
    produces, or on older Pythons, results are identical.)

    Returns ``(segments, scores)`` in the order they were picked (not sorted): ``segments`` are
    ``(start, end)`` with ``end`` exclusive, ``scores`` their sums. Segments may touch: a relevant
    run longer than ``max_length`` comes back as adjacent pieces, which a caller may merge for
    display. Empty input gives ``([], [])``.
    Raises ``ValueError`` for bad lengths, splits, ragged rows, non-finite values or values
    above 1e100 in size (dsRAG would accept ``inf``; no real chunk value comes near either).
    """
    max_length = positive_int(max_length, "max_length", "the longest segment in chunks")
    overall_max_length = positive_int(
        overall_max_length, "overall_max_length", "the total chunks over all segments"
    )
    if minimum_value != minimum_value:  # NaN compares unequal to itself
        raise ValueError("minimum_value is NaN: pass a number, e.g. 0.5 (dsRAG's balanced preset)")
    values = as_value_matrix(all_relevance_values)
    n_queries, n_chunks = values.shape
    splits = checked_splits(document_splits, n_chunks)
    if n_queries == 0 or n_chunks == 0:
        return [], []

    # A "wall" is a chunk that no segment may reach from the left: the first chunk of each
    # document and of each segment already taken. Chunks inside taken segments are not free.
    # No segment is longer than the meta-document; clamping keeps buffers sized by the input.
    max_length = min(max_length, n_chunks)
    walls = np.zeros(n_chunks, dtype=bool)
    walls[[split for split in splits if split < n_chunks]] = True
    free = np.ones(n_chunks, dtype=bool)
    # The same walls as sorted positions (with n as a sentinel), to find the next wall quickly.
    wall_list = sorted({*splits, n_chunks})
    wall_positions = np.asarray(wall_list, dtype=np.int64)
    states: list[_QueryState | None] = [None] * n_queries
    dropped = [False] * n_queries
    segments: list[tuple[int, int]] = []
    scores: list[float] = []
    total = 0
    turn = 0
    # The same loop as dsRAG's, so turn order and stopping agree; only the search differs.
    while total < overall_max_length:
        if turn >= n_queries:
            turn = 0
        if all(dropped):
            break
        if dropped[turn]:
            turn += 1
            continue
        width = min(max_length, overall_max_length - total)
        state = states[turn]
        if state is None:
            # Built on first use, from the constraints as they stand now.
            state = states[turn] = _QueryState(values[turn], walls, free, width, max_length)
        best = state.best(width, minimum_value, wall_positions)
        if best is None:
            dropped[turn] = True
            turn += 1
            continue
        value, start, end = best
        segments.append((start, end))
        scores.append(value)
        total += end - start
        turn += 1
        walls[start] = True
        free[start:end] = False
        bisect.insort(wall_list, start)
        wall_positions = np.asarray(wall_list, dtype=np.int64)
        for other, other_state in enumerate(states):
            if other_state is not None and not dropped[other]:
                other_state.take(start, end)
    return segments, scores


class _QueryState:
    """One query's best segment per start position, checked lazily against taken segments.

    Only free chunks with value >= 0 can start a segment; the state is indexed by those positions
    (``starts``) and knows, for each, either

    - ``exact``/``exact_len``: its best segment under the constraints of when it was computed, or
    - ``bound``: an upper bound on that best value (dense inputs; -inf once ``exact`` is known).

    Constraints only ever tighten (segments get taken, the budget shrinks), so a stale ``exact``
    is still an upper bound, and it is still right if that very segment is still legal. Taking a
    segment therefore only marks a wall and drops the starts inside it; :meth:`best` checks the
    winner and recomputes stale winners, with the other stale starts of their block. Bounds
    (prefix sums plus a rounding tolerance) let dense inputs compute exact values only for starts
    that could win; massive exact ties (e.g. constant values) still need them all. Per-block
    maxima (blocks of ``_BLOCK`` starts) keep each turn's search sublinear.

    Exact window sums are accumulated left to right, as dsRAG's ``sum()`` does. Reaching a wall
    adds -inf (``walled``), so a window that crosses a split or runs into a taken segment never
    wins, with no per-window bounds to track.
    """

    def __init__(
        self,
        values: FloatArray,
        walls: NDArray[np.bool_],
        free: NDArray[np.bool_],
        width: int,
        max_length: int,
    ) -> None:
        n = values.shape[0]
        usable = values >= 0
        self.values = values
        # Shared with the caller, who marks taken segments in them.
        self.walls = walls
        self.free = free
        self.width = width
        # Padded by max_length so windows running off the end read -inf and an unusable end.
        self.walled = np.full(n + max_length, -np.inf)
        self.walled[:n] = np.where(walls, -np.inf, values)
        self.usable = np.zeros(n + max_length, dtype=bool)
        self.usable[:n] = usable
        starts = np.flatnonzero(usable & free)
        count = starts.shape[0]
        padded = -(-count // _BLOCK) * _BLOCK
        # Per-start arrays are padded to whole blocks; padding starts sit at n, never free.
        self.starts: IntArray = np.full(padded, n, dtype=np.int64)
        self.starts[:count] = starts
        self.exact = np.full(padded, -np.inf)
        self.exact_len = np.zeros(padded, dtype=np.int64)
        self.bound = np.full(padded, -np.inf)
        self.bounded = count * 16 > n
        if self.bounded:
            self.bound[:count] = _upper_bounds(values, usable, width)[starts]
        else:
            # Few starts: computing them all is cheaper than bounding.
            self.exact[:count], self.exact_len[:count] = self._scan(self.starts[:count])
        # Block views of the per-start arrays (they share memory).
        self.exact_2d = self.exact.reshape(-1, _BLOCK)
        self.bound_2d = self.bound.reshape(-1, _BLOCK)
        self.exact_max = self.exact_2d.max(axis=1, initial=-np.inf)
        self.bound_max = self.bound_2d.max(axis=1, initial=-np.inf)

    def take(self, start: int, end: int) -> None:
        """Note that ``[start, end)`` was taken: its starts are gone, no window may reach it."""
        self.walled[start] = -np.inf
        # Starts inside it would surface as stale winners soon (queries often share relevant
        # chunks), so drop them now; starts whose segments merely ran into it are left stale.
        lo = int(self.starts.searchsorted(start))
        hi = int(self.starts.searchsorted(end))
        if hi > lo:
            self.exact[lo:hi] = -np.inf
            self.exact_len[lo:hi] = 0
            self.bound[lo:hi] = -np.inf
            first, last = lo // _BLOCK, (hi - 1) // _BLOCK + 1  # the blocks holding them
            self.exact_max[first:last] = self.exact_2d[first:last].max(axis=1)
            if self.bounded:
                self.bound_max[first:last] = self.bound_2d[first:last].max(axis=1)

    def best(
        self, width: int, minimum_value: float, wall_positions: IntArray
    ) -> tuple[float, int, int] | None:
        """The best free segment of at most ``width`` chunks as ``(value, start, end)``, or
        ``None`` if there is none or it is worth less than ``minimum_value``.

        ``wall_positions`` lists the walls in order, ending with the meta-document's length.
        """
        if self.exact_max.shape[0] == 0:
            return None
        self.width = width
        seeding_rounds = 0
        while True:
            top = self.exact_max.max()
            if self.bounded:
                # Blocks holding a bounded start that might match or beat the best exact value
                # (ties count: a tied smaller start wins) and reach minimum_value.
                bar = max(top, minimum_value)
                open_blocks = np.flatnonzero((self.bound_max >= bar) & (self.bound_max > -np.inf))
                if open_blocks.shape[0]:
                    if (top == -np.inf or open_blocks.shape[0] > 8) and seeding_rounds < 3:
                        # Settle the most promising start of the most promising blocks first:
                        # that raises the bar and usually closes almost every block.
                        if open_blocks.shape[0] > 32:
                            order = np.argpartition(-self.bound_max[open_blocks], 32)[:32]
                            open_blocks = open_blocks[order]
                        picks = open_blocks * _BLOCK + np.argmax(self.bound_2d[open_blocks], axis=1)
                        seeding_rounds += 1
                    else:
                        rows, cols = np.nonzero(self.bound_2d[open_blocks] >= bar)
                        picks = open_blocks[rows] * _BLOCK + cols
                    self._settle(picks)
                    continue
            # Stale values only overestimate, so below the minimum means truly below it.
            if top == -np.inf or top < minimum_value:
                return None
            block = int(np.argmax(self.exact_max))  # first block holding the maximum
            j = block * _BLOCK + int(np.argmax(self.exact_2d[block]))  # smallest start among ties
            start = int(self.starts[j])
            end = start + int(self.exact_len[j])
            if end - start <= width and self.free[start] and not self.walls[start + 1 : end].any():
                return float(self.exact[j]), start, end
            # The winner went stale; recompute every stale start of its block at once (in the
            # worst case, a shrunken budget, all of them are).
            self._settle(self._stale_in_block(block, wall_positions))

    def _stale_in_block(self, block: int, wall_positions: IntArray) -> IntArray:
        """Starts of ``block`` whose exact best is no longer legal."""
        picks = np.arange(block * _BLOCK, (block + 1) * _BLOCK)
        n = self.free.shape[0]
        starts = np.minimum(self.starts[picks], n - 1)  # padding starts sit at n
        ends = starts + self.exact_len[picks]
        next_wall = wall_positions[np.searchsorted(wall_positions, starts, side="right")]
        stale = (self.exact_len[picks] > self.width) | (next_wall < ends) | ~self.free[starts]
        return picks[stale & (self.exact[picks] > -np.inf)]

    def _settle(self, picks: IntArray) -> None:
        """Compute the exact best of the starts ``picks`` under the current constraints."""
        starts = self.starts[picks]
        live = self.free[np.minimum(starts, self.free.shape[0] - 1)] & (starts < self.free.shape[0])
        self.exact[picks] = -np.inf
        self.exact_len[picks] = 0
        self.bound[picks] = -np.inf
        kept = picks[live]
        if kept.shape[0]:
            self.exact[kept], self.exact_len[kept] = self._scan(starts[live])
        blocks = np.unique(picks // _BLOCK)
        self.exact_max[blocks] = self.exact_2d[blocks].max(axis=1)
        self.bound_max[blocks] = self.bound_2d[blocks].max(axis=1)

    def _scan(self, starts: IntArray) -> tuple[FloatArray, IntArray]:
        """Exact best segment of each of ``starts`` (all free) under the current constraints.

        One row per start, one column per length: the running sums along a row are exactly
        dsRAG's left-to-right ``sum()`` of each prefix (``ufunc.accumulate`` is defined as that
        sequence of additions), and ``argmax`` takes the first, i.e. shortest, of equal sums.
        """
        count = starts.shape[0]
        n = self.free.shape[0]
        if count * 4 >= n and n > _SCAN_CELLS // 8:
            return self._scan_dense(starts)
        width = self.width
        best = np.empty(count)
        best_len = np.empty(count, dtype=np.int64)
        offsets = np.arange(width)
        rows_per_batch = max(1, _SCAN_CELLS // width)  # bounds the temporary (rows, width) arrays
        for lo in range(0, count, rows_per_batch):
            batch = starts[lo : lo + rows_per_batch]
            cells = batch[:, None] + offsets
            window = self.walled[cells]
            # A start may itself be a wall (a document's first chunk), and dsRAG's sum() starts
            # from the integer 0, which turns a -0.0 first value into +0.0.
            window[:, 0] = 0.0 + self.values[batch]
            sums = np.add.accumulate(window, axis=1)
            sums[~self.usable[cells]] = -np.inf
            length = np.argmax(sums, axis=1)
            best[lo : lo + rows_per_batch] = sums[np.arange(batch.shape[0]), length]
            best_len[lo : lo + rows_per_batch] = length + 1
        return best, best_len

    def _scan_dense(self, starts: IntArray) -> tuple[FloatArray, IntArray]:
        """:meth:`_scan` for many starts of a long meta-document: every position advances one
        chunk per step through contiguous slices, which beats gathering (start, length) cells.
        """
        n = self.free.shape[0]
        acc = np.full(n, -np.inf)
        acc[starts] = 0.0 + self.values[starts]  # +0.0 as dsRAG's sum(); starts may be walls
        best = acc.copy()
        best_len = np.ones(n, dtype=np.int64)
        hit = np.empty(n, dtype=bool)
        for k in range(1, min(self.width, n)):
            window = acc[: n - k]
            window += self.walled[k:n]
            better = hit[: n - k]
            np.greater(window, best[: n - k], out=better)
            better &= self.usable[k:n]
            # Strict '>' with growing length keeps the shortest of equal sums, as dsRAG does.
            np.copyto(best[: n - k], window, where=better)
            np.copyto(best_len[: n - k], k + 1, where=better)
        return best[starts], best_len[starts]


def _upper_bounds(values: FloatArray, usable: NDArray[np.bool_], width: int) -> FloatArray:
    """For every start, an upper bound on the left-to-right sum of any segment of at most
    ``width`` chunks starting there and ending on a usable chunk (finite: |values| <= 1e100).

    It is a prefix-sum difference maximised with a sliding-window maximum (O(n log width)), plus
    a tolerance covering both its own rounding and that of the exact sum. Walls are ignored,
    which only loosens the bound.
    """
    n = values.shape[0]
    prefix = np.empty(n + 1)
    prefix[0] = 0.0
    # ufunc.accumulate is defined as the sequential running sum, which the tolerance relies on.
    np.add.accumulate(values, out=prefix[1:])
    # ahead[i]: the prefix sum at the end of a segment whose last chunk is i, if i may end one.
    ahead = np.where(usable, prefix[1:], -np.inf)
    width = min(width, n)
    span = 1
    while span * 2 <= width:
        np.maximum(ahead[: n - span], ahead[span:], out=ahead[: n - span])
        span *= 2
    if width > span:
        shift = width - span
        np.maximum(ahead[: n - shift], ahead[shift:], out=ahead[: n - shift])
    # Rounding of prefix[e] - prefix[s] is at most u * (sum of |prefix| over the window + the
    # difference), and of a left-to-right sum of width terms at most u * width^2 * max|value|,
    # with u = 2**-53. Doubled for safety; a bound only needs to be safe, not tight.
    unit = 2.0**-53
    largest_prefix = float(np.abs(prefix).max())
    largest_value = float(np.abs(values).max()) if n else 0.0
    tolerance = 2 * unit * ((width + 2) * largest_prefix + width * width * largest_value)
    return ahead - prefix[:-1] + tolerance


def positive_int(value: int, name: str, meaning: str) -> int:
    """``value`` as an int >= 1, else a ``ValueError`` naming ``name`` and what to pass."""
    try:
        as_int = operator.index(value)
    except TypeError:
        raise ValueError(
            f"{name} must be an integer number of chunks, got {value!r}: pass {meaning}"
        ) from None
    if as_int < 1:
        raise ValueError(f"{name} must be >= 1, got {as_int}: pass {meaning}")
    return as_int


def as_value_matrix(all_relevance_values: Sequence[Sequence[float]] | NDArray[Any]) -> FloatArray:
    """Chunk values as a float64 (queries, chunks) matrix; ``ValueError`` for ragged rows,
    non-finite values or values too large to sum exactly (shared with the budgeted search).
    """
    if isinstance(all_relevance_values, np.ndarray):
        if all_relevance_values.ndim != 2:
            raise ValueError(
                "all_relevance_values must be 2-D (one row per query), got an array of shape "
                f"{all_relevance_values.shape}: for a single query pass [values]"
            )
        matrix = np.asarray(all_relevance_values, dtype=np.float64)
    else:
        rows = list(all_relevance_values)
        try:
            lengths = [len(row) for row in rows]
        except TypeError:
            raise ValueError(
                "all_relevance_values must be a list with one list of chunk values per query: "
                "for a single query pass [values]"
            ) from None
        if len(set(lengths)) > 1:
            raise ValueError(
                f"every query needs one value per chunk of the meta-document, got rows of lengths "
                f"{lengths}: give unretrieved chunks the value -irrelevant_chunk_penalty"
            )
        if not rows:
            return np.zeros((0, 0))
        matrix = np.asarray(rows, dtype=np.float64).reshape(len(rows), lengths[0])
    finite = np.isfinite(matrix)
    if not finite.all():
        query, chunk = (int(i) for i in np.argwhere(~finite)[0])
        raise ValueError(
            f"chunk value {matrix[query, chunk]} at query {query}, chunk {chunk} is not finite: "
            "give unretrieved chunks the value -irrelevant_chunk_penalty"
        )
    # Sums of such values could overflow to inf, where left-to-right order stops being exact.
    huge = np.abs(matrix) > _LARGEST_VALUE
    if huge.any():
        query, chunk = (int(i) for i in np.argwhere(huge)[0])
        raise ValueError(
            f"chunk value {matrix[query, chunk]} at query {query}, chunk {chunk} is too large "
            f"(above {_LARGEST_VALUE:g} in size): chunk values are relevance minus a penalty, of "
            "order 1; rescale them"
        )
    return matrix


def checked_splits(
    document_splits: Sequence[int] | NDArray[np.integer[Any]], n_chunks: int
) -> list[int]:
    """The splits as ints, strictly increasing, inside ``[0, n_chunks]``; else a ``ValueError``."""
    splits: list[int] = []
    for split in document_splits:
        try:
            splits.append(operator.index(split))
        except TypeError:
            raise ValueError(
                f"document_splits must hold integer chunk indices, got {split!r}: pass the "
                "index where each document ends"
            ) from None
    for previous, split in itertools.pairwise(splits):
        if split <= previous:
            raise ValueError(
                f"document_splits must be strictly increasing, got {previous} then {split}: "
                "sort them and drop duplicates"
            )
    if splits and (splits[0] < 0 or splits[-1] > n_chunks):
        bad = splits[0] if splits[0] < 0 else splits[-1]
        raise ValueError(
            f"document split {bad} lies outside the meta-document of {n_chunks} chunks: splits "
            f"must lie in [0, {n_chunks}]"
        )
    return splits
