"""Segment search speed: our find_best_segments against dsRAG 0.5.6's get_best_segments.

Both get the same input (Python lists of floats, as dsRAG takes them) for a meta-document of
five documents and three queries, find_all preset, in two value regimes:

- ``retrieved``: as dsRAG's pipeline builds them. Each query retrieved 200 chunks (dsRAG's search
  depth) clustered around a few relevant passages; values are ``chunk_value`` of their ranks and
  calibrated relevances, length-adjusted as dsRAG's presets do; every other chunk is worth
  ``-irrelevant_chunk_penalty``. Few chunks are non-negative, which is where dsRAG is fast.
- ``dense``: every chunk gets ``chunk_value`` of a random rank in [0, 200) and a uniform random
  relevance, so many chunks are non-negative and dsRAG's brute force does its full work.

The script checks that the two return identical segments and scores, prints the best-of-N time
of each and the speed-up measured in the same run, then times ours alone on a million chunks.
Last, the budgeted search (``find_budgeted_segments`` + ``fill_budget``, what
``max_context_chars`` runs) on the same values with chunk lengths of 300-1,400 characters and
60 characters of overlap, against dsRAG's unbudgeted time on that meta-document: a different
problem (a knapsack over characters, not a chunk count), timed in the same run, with the
search's peak memory (tracemalloc) and the bound ``budget.py`` states for it.

Run: python benchmarks/bench_segments.py [--repeats 5]
Needs dsRAG's rse.py: pip install --no-deps dsrag==0.5.6
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import sys
import time
import tracemalloc
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from llama_index.packs.self_rag_rse.rse.budget import fill_budget, find_budgeted_segments
from llama_index.packs.self_rag_rse.rse.segments import find_best_segments
from llama_index.packs.self_rag_rse.rse.values import (
    RSEPreset,
    adjust_for_length,
    chunk_value,
    get_preset,
)


def load_dsrag_rse() -> ModuleType:
    """dsRAG's rse.py by path: its package __init__ pulls dependencies rse.py does not need."""
    try:
        path = importlib.metadata.distribution("dsrag").locate_file("dsrag/rse.py")
    except importlib.metadata.PackageNotFoundError:
        sys.exit("dsRAG is not installed: run `pip install --no-deps dsrag==0.5.6`")
    spec = importlib.util.spec_from_file_location("dsrag_rse", str(path))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def meta_document(
    regime: str, n_chunks: int, preset: RSEPreset, rng: np.random.Generator, n_queries: int = 3
) -> tuple[np.ndarray, list[int]]:
    """Chunk values (one row per query) and document splits for a synthetic meta-document."""
    n_docs = 5 if n_chunks < 100_000 else 10
    cuts = np.sort(rng.choice(np.arange(1, n_chunks), n_docs - 1, replace=False))
    splits = [*map(int, cuts), n_chunks]
    decay, penalty = preset.decay_rate, preset.irrelevant_chunk_penalty
    rows = []
    for _ in range(n_queries):
        if regime == "dense":
            rank = rng.integers(0, 200, n_chunks)
            rows.append(chunk_value(rank, rng.random(n_chunks), decay, penalty))
            continue
        # Hits cluster around a few relevant passages, as neighbouring chunks share a topic.
        centres = rng.choice(n_chunks, 12, replace=False)
        hits = np.unique((centres[:, None] + rng.integers(-12, 12, (12, 30))).ravel())
        hits = rng.permutation(hits[(hits >= 0) & (hits < n_chunks)])[:200]
        relevance = np.sort(rng.beta(2.0, 2.5, hits.size))[::-1]  # reranked: best first
        rank = np.full(n_chunks, np.inf)
        absolute = np.zeros(n_chunks)
        lengths = np.zeros(n_chunks)
        rank[hits] = np.arange(hits.size)
        absolute[hits] = relevance
        lengths[hits] = rng.integers(300, 1400, hits.size)
        values = chunk_value(rank, absolute, decay, penalty)
        rows.append(adjust_for_length(values, lengths))
    return np.array(rows), splits


def dsrag_rows(values: np.ndarray) -> list[list[Any]]:
    """The values as dsRAG takes them. Plain floats are its fastest input, but from Python 3.12
    the built-in sum() of plain floats is compensated while ours (and dsRAG's on numpy floats,
    which its own pipeline produces) is left to right; there, give both numpy floats.
    """
    return values.tolist() if sys.version_info < (3, 12) else [list(r) for r in values]


def best_ms(function: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """Best-of-``repeats`` wall time in ms (the least disturbed run) and the result."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = function()
        times.append((time.perf_counter() - start) * 1000)
    return min(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per entry (best of)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    dsrag = load_dsrag_rse()
    rng = np.random.default_rng(args.seed)
    preset = get_preset("find_all")
    knobs = (preset.max_length, preset.budget(3), preset.minimum_value)

    print(
        f"find_all preset (max_length {knobs[0]}, overall_max_length {knobs[1]}, "
        f"minimum_value {knobs[2]}), 3 queries, best of {args.repeats} runs\n"
    )
    header = (
        f"{'regime':>9}  {'chunks':>9}  {'non-neg':>7}  {'segments':>8}  "
        f"{'dsRAG ms':>9}  {'ours ms':>8}  {'speed-up':>8}  {'ours, array in':>14}"
    )
    print(header)
    print("-" * len(header))
    for regime in ("retrieved", "dense"):
        for n_chunks in (5_000, 20_000, 1_000_000):
            values, splits = meta_document(regime, n_chunks, preset, rng)
            non_negative = int((values >= 0).sum() / len(values))
            # Ours on the float64 array: the search alone, no Python lists to convert.
            array_ms, ours = best_ms(
                lambda values=values, splits=splits: find_best_segments(values, splits, *knobs),
                args.repeats * (4 if n_chunks < 100_000 else 1),
            )
            row = f"{regime:>9}  {n_chunks:>9,}  {non_negative:>7}  {len(ours[0]):>8}  "
            if n_chunks >= 100_000:  # dsRAG's brute force would take hours
                print(row + f"{'-':>9}  {'-':>8}  {'-':>8}  {array_ms:>11.2f} ms")
                continue
            rows = dsrag_rows(values)
            theirs_ms, theirs = best_ms(
                lambda rows=rows, splits=splits: dsrag.get_best_segments(rows, splits, *knobs),
                max(1, args.repeats // 2),
            )
            # Ours on the very lists dsRAG got, conversion included: the speed-up is from these.
            ours_ms, ours_from_lists = best_ms(
                lambda rows=rows, splits=splits: find_best_segments(rows, splits, *knobs),
                args.repeats * 4,
            )
            if not ours == ours_from_lists == theirs:
                sys.exit(f"MISMATCH ({regime}, {n_chunks} chunks):\n dsRAG {theirs}\n ours  {ours}")
            print(
                row + f"{theirs_ms:>9.1f}  {ours_ms:>8.2f}  {theirs_ms / ours_ms:>7.0f}x  "
                f"{array_ms:>11.2f} ms"
            )
    budgeted(dsrag, rng, preset, knobs, args.repeats)
    print(
        "\nnon-neg: non-negative chunks per query. 'ours ms' and the speed-up take the same Python"
        "\nlists as dsRAG; 'ours, array in' takes the float64 array. Outputs were identical to"
        "\ndsRAG's on every compared row."
    )


def budgeted(
    dsrag: ModuleType,
    rng: np.random.Generator,
    preset: RSEPreset,
    knobs: tuple[int, int, float],
    repeats: int,
) -> None:
    """The budgeted search, timed against dsRAG's unbudgeted search on the same values."""
    print("\nbudgeted search (max_context_chars), same presets and values:")
    header = (
        f"{'regime':>9}  {'chunks':>7}  {'budget':>6}  {'dsRAG ms':>9}  {'budgeted ms':>11}  "
        f"{'ratio':>6}  {'segments':>8}  {'peak MB':>8}  {'bound MB':>8}"
    )
    print(header)
    print("-" * len(header))
    for regime in ("retrieved", "dense"):
        for n_chunks in (5_000, 20_000):
            values, splits = meta_document(regime, n_chunks, preset, rng)
            lengths = rng.integers(300, 1400, n_chunks)
            first, step = lengths, lengths - 60
            rows = dsrag_rows(values)
            theirs_ms, _ = best_ms(
                lambda rows=rows, splits=splits: dsrag.get_best_segments(rows, splits, *knobs),
                max(1, repeats // 2),
            )
            best = values.max(axis=0)
            retrieved = best > -preset.irrelevant_chunk_penalty
            hits = [int(p) for p in np.argsort(-best, kind="stable") if retrieved[p]]
            for budget in (1_500, 6_000):

                def search(
                    values=values,
                    splits=splits,
                    first=first,
                    step=step,
                    budget=budget,
                    best=best,
                    hits=hits,
                ):
                    spans, _ = find_budgeted_segments(
                        values, splits, first, step, budget, knobs[0], knobs[2]
                    )
                    return fill_budget(spans, best, splits, first, step, budget, hits, knobs[0])

                ours_ms, runs = best_ms(search, repeats)
                tracemalloc.start()
                search()
                peak = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
                # budget.py's bound: (C + 1) cells * (8 bytes * (max_length + 6) + 1 byte per
                # end position of value >= 0), C <= budget, + about 100 bytes per position.
                ends = int((best >= 0).sum())
                bound = (budget + 1) * (8 * (knobs[0] + 6) + ends) + 100 * n_chunks
                print(
                    f"{regime:>9}  {n_chunks:>7,}  {budget:>6,}  {theirs_ms:>9.1f}  "
                    f"{ours_ms:>11.2f}  {theirs_ms / ours_ms:>5.1f}x  {len(runs):>8}  "
                    f"{peak / 1e6:>8.1f}  {bound / 1e6:>8.1f}"
                )


if __name__ == "__main__":
    main()
