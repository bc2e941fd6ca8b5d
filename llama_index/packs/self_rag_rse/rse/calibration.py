"""Turn raw relevance scores into absolute relevance in [0, 1] for RSE.

RSE's chunk value (:func:`~llama_index.packs.self_rag_rse.rse.values.chunk_value`) multiplies
a rank decay by the chunk's *absolute* relevance and subtracts a fixed penalty, so the scores
must mean the same thing from query to query and spread over [0, 1]. Raw scores rarely do:

- Cohere rerankers push most scores to the extremes: :data:`COHERE_RERANK_BETA` (the CDF of
  Beta(0.4, 0.4)) spreads them out, as dsRAG does.
- Voyage rerankers give mostly low scores: :data:`VOYAGE_RERANK_BETA` (Beta(0.5, 1.8)).
- Embedding cosine similarity lives in a narrow, model-specific band: rescale it linearly with
  :func:`calibrate_minmax` from the similarity of an unrelated pair (``low``) to that of a clearly
  relevant one (``high``), measured on your own data. A fixed ``high`` saturates when a query's
  good hits all score above it (they all become relevance 1 and RSE sees only their ranks):
  :func:`calibrate_cosine_adaptive`, the default without a context budget, raises ``high`` to
  the query's best score.
- :func:`calibrate_spread`, the default under a context budget, needs no range at all: one
  query's best hit is 1 and its median hit 0, whatever the embedder's scale.
  :func:`calibrate_zscore` measures each hit in standard deviations above the query's mean;
  :func:`calibrate_rank` drops the scores altogether (every hit 0.8: rank decay alone, dsRAG's
  ``ignore_absolute_relevance``).

Other rerankers: look at a histogram of their scores on your data and pick a Beta whose CDF maps
it close to uniform. :data:`CALIBRATIONS` names each calibration once; :func:`calibrate` applies a
name or a callable. Numpy only (no scipy).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple, overload

import numpy as np
from numpy.typing import ArrayLike, NDArray

FloatArray = NDArray[np.float64]

# Continued-fraction settings: stop once a step changes the result by less than _EPS relative;
# _TINY stands in for zero in Lentz's method. Convergence takes O(sqrt(max(a, b))) steps.
_EPS = 1e-15
_TINY = 1e-300
_MAX_STEPS = 100_000


class BetaParams(NamedTuple):
    """Shape parameters of a Beta distribution used as a score calibration.

    Unpack it into :func:`calibrate_beta`: ``calibrate_beta(scores, *COHERE_RERANK_BETA)``.
    """

    a: float
    b: float


COHERE_RERANK_BETA = BetaParams(a=0.4, b=0.4)
"""dsRAG's calibration for Cohere rerank scores (``CohereReranker.transform``)."""

VOYAGE_RERANK_BETA = BetaParams(a=0.5, b=1.8)
"""dsRAG's calibration for Voyage rerank scores (``VoyageReranker.transform``)."""


@overload
def beta_cdf(x: float, a: float, b: float) -> float: ...
@overload
def beta_cdf(x: ArrayLike, a: ArrayLike, b: ArrayLike) -> FloatArray: ...
def beta_cdf(x: ArrayLike, a: ArrayLike, b: ArrayLike) -> float | FloatArray:
    """CDF of the Beta(a, b) distribution at ``x``: the regularized incomplete beta I_x(a, b).

    The same values as ``scipy.stats.beta.cdf`` (to about 1e-15 for moderate ``a`` and ``b``):
    0 for ``x <= 0``, 1 for ``x >= 1``, NaN for NaN. ``a`` and ``b`` must be positive; with
    both below 1 the CDF is S-shaped and stretches the middle of [0, 1] (scores bunched at the
    ends spread out), a small ``a`` with a larger ``b`` lifts low scores. Vectorised: ``x``,
    ``a`` and ``b`` broadcast; scalars give a float.
    """
    x_arr, a_arr, b_arr = np.broadcast_arrays(
        np.asarray(x, dtype=np.float64),
        np.asarray(a, dtype=np.float64),
        np.asarray(b, dtype=np.float64),
    )
    if not np.all((a_arr > 0) & (b_arr > 0) & np.isfinite(a_arr) & np.isfinite(b_arr)):
        raise ValueError(
            "beta_cdf needs shape parameters a > 0 and b > 0 (finite), got "
            f"a={a!r}, b={b!r}: dsRAG uses a=b=0.4 for Cohere and a=0.5, b=1.8 for Voyage"
        )
    result = np.where(x_arr >= 1.0, 1.0, 0.0)
    result[np.isnan(x_arr)] = np.nan
    inside = (x_arr > 0.0) & (x_arr < 1.0)
    if inside.any():
        result[inside] = _regularized_beta(x_arr[inside], a_arr[inside], b_arr[inside])
    return float(result) if result.ndim == 0 else result


def _regularized_beta(x: FloatArray, a: FloatArray, b: FloatArray) -> FloatArray:
    """I_x(a, b) for 0 < x < 1, by Lentz's continued fraction on the side where it converges."""
    lgamma = np.frompyfunc(math.lgamma, 1, 1)
    log_beta = np.asarray(lgamma(a) + lgamma(b) - lgamma(a + b), dtype=np.float64)
    # x^a (1-x)^b / B(a, b), in logs to survive large a and b.
    front = np.exp(a * np.log(x) + b * np.log1p(-x) - log_beta)
    # The fraction for I_x(a, b) converges fast for x < (a+1)/(a+b+2); beyond, use the mirror
    # identity I_x(a, b) = 1 - I_{1-x}(b, a).
    direct = x < (a + 1.0) / (a + b + 2.0)
    # The fraction's arguments, mirrored where the identity is used.
    xs, aa, bb = np.where(direct, x, 1.0 - x), np.where(direct, a, b), np.where(direct, b, a)
    fraction = _beta_continued_fraction(xs, aa, bb)
    return np.where(direct, front * fraction / a, 1.0 - front * fraction / b)


def _beta_continued_fraction(x: FloatArray, a: FloatArray, b: FloatArray) -> FloatArray:
    """The continued fraction of I_x(a, b) (Numerical Recipes ``betacf``), elementwise."""
    c = np.ones_like(x)
    d = 1.0 / _not_zero(1.0 - (a + b) * x / (a + 1.0))
    h = d.copy()
    active = np.ones(x.shape, dtype=bool)
    for m in range(1, _MAX_STEPS + 1):
        live = np.flatnonzero(active)  # only unconverged elements keep iterating
        if not live.size:
            break
        # The live elements' parameters, and their state of Lentz's method (c, d, h).
        xa, aa, bb = x[live], a[live], b[live]
        ca, da, ha = c[live], d[live], h[live]
        m2 = 2.0 * m
        even = m * (bb - m) * xa / ((aa - 1.0 + m2) * (aa + m2))
        odd = -(aa + m) * (aa + bb + m) * xa / ((aa + m2) * (aa + 1.0 + m2))
        da = 1.0 / _not_zero(1.0 + even * da)
        ca = _not_zero(1.0 + even / ca)
        ha = ha * da * ca
        da = 1.0 / _not_zero(1.0 + odd * da)
        ca = _not_zero(1.0 + odd / ca)
        step = da * ca
        ha = ha * step
        c[live], d[live], h[live] = ca, da, ha
        active[live[np.abs(step - 1.0) <= _EPS]] = False
    return h


def _not_zero(values: FloatArray) -> FloatArray:
    """``values`` with near-zeros replaced by :data:`_TINY` (Lentz's method divides by them)."""
    return np.where(np.abs(values) < _TINY, _TINY, values)


@overload
def calibrate_beta(scores: float, a: float, b: float) -> float: ...
@overload
def calibrate_beta(scores: ArrayLike, a: float, b: float) -> FloatArray: ...
def calibrate_beta(scores: ArrayLike, a: float, b: float) -> float | FloatArray:
    """Map reranker scores to absolute relevance with the Beta(a, b) CDF, as dsRAG does.

    Scores are clipped to [0, 1] first, so a reranker that strays slightly outside still maps
    to 0 or 1. Use ``*COHERE_RERANK_BETA`` for Cohere and ``*VOYAGE_RERANK_BETA`` for Voyage
    rerankers; for cosine similarity use :func:`calibrate_minmax` instead. The map is monotone,
    so it never changes the ranking, only how far apart relevant and irrelevant chunks sit.
    """
    return beta_cdf(np.clip(np.asarray(scores, dtype=np.float64), 0.0, 1.0), a, b)


@overload
def calibrate_minmax(scores: float, low: float, high: float) -> float: ...
@overload
def calibrate_minmax(scores: ArrayLike, low: float, high: float) -> FloatArray: ...
def calibrate_minmax(scores: ArrayLike, low: float, high: float) -> float | FloatArray:
    """Rescale scores linearly so ``low`` maps to 0 and ``high`` to 1, clipping outside.

    Meant for embedding cosine similarity, whose useful range is narrow and model-specific: set
    ``low`` to the similarity of a typical unrelated chunk and ``high`` to that of a clearly
    relevant one (look at a few queries on your own data). Too low a ``low`` makes every chunk
    look somewhat relevant and segments grow; too high a ``high`` makes nothing look relevant.
    """
    if not high > low:
        raise ValueError(
            f"calibrate_minmax needs high > low, got low={low!r}, high={high!r}: low is the "
            "score of an unrelated chunk, high that of a clearly relevant one"
        )
    # A score near the float limit overflows to inf here, which clips to 1 like any high score.
    with np.errstate(over="ignore"):
        clipped = np.clip((np.asarray(scores, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    return float(clipped) if clipped.ndim == 0 else clipped


def calibrate_cosine_adaptive(scores: ArrayLike, low: float, high: float) -> FloatArray:
    """:func:`calibrate_minmax` over ``(low, max(high, best score))``: one query's scores.

    ``scores`` are the similarities of one query's hits. When the best of them is above ``high``,
    the range stretches up to it: the best hit maps to 1 and the others keep their spacing below it,
    where a fixed range would map every hit above ``high`` to 1 (with all-MiniLM-L6-v2 and the
    default range, a question's top hits score 0.55-0.75 and would all count as equally relevant).
    When no hit reaches ``high`` the result is :func:`calibrate_minmax`'s, so a query with only weak
    hits still gets low relevance. Infinite scores map to 0 or 1 and do not stretch the range.
    """
    values = np.asarray(scores, dtype=np.float64)
    finite = values[np.isfinite(values)]
    top = float(finite.max()) if finite.size else high
    return np.asarray(calibrate_minmax(values, low, max(high, top)), dtype=np.float64)


def calibrate_spread(scores: ArrayLike) -> FloatArray:
    """Relevance of one query's hits from their own score distribution: the best hit 1, the
    median hit 0, linear between, clipped to [0, 1].

    Nothing here depends on the embedder's scale or offset (cosines of 0.3-0.6 and of 0.75-0.9
    map alike), so it needs no range tuned per model; rank decay does the rest. The hits below
    the median count 0: they are worth what a chunk never retrieved is worth, and only a
    budget's fill takes them. Equal scores all count 1. Infinite scores map to 0 or 1 and do
    not move the best or the median.
    """
    values = np.asarray(scores, dtype=np.float64)
    finite = values[np.isfinite(values)]
    if not finite.size:
        return np.where(values > 0, 1.0, 0.0)
    top = float(finite.max())
    middle = float(np.median(finite))
    if top <= middle:
        return np.where(values >= top, 1.0, 0.0)
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = (values - middle) / (top - middle)
    return np.clip(np.nan_to_num(scaled, posinf=1.0, neginf=0.0), 0.0, 1.0)


def calibrate_zscore(scores: ArrayLike, spread: float = 2.0) -> FloatArray:
    """Relevance of one query's hits in standard deviations above their mean: the mean hit 0,
    a hit ``spread`` deviations above it 1, linear between, clipped to [0, 1].

    Like :func:`calibrate_spread` it ignores the embedder's scale and offset; unlike it, one
    outstanding hit does not push the others down (the best hit need not reach 1, and a query
    whose hits all score alike gets low relevance everywhere). Equal scores all count 1, as in
    :func:`calibrate_spread`. Infinite scores map to 0 or 1 and do not move the mean.
    """
    values = np.asarray(scores, dtype=np.float64)
    finite = values[np.isfinite(values)]
    if not finite.size:
        return np.where(values > 0, 1.0, 0.0)
    mean = float(finite.mean())
    deviation = float(finite.std())
    if deviation == 0.0:
        return np.where(values >= mean, 1.0, 0.0)
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = (values - mean) / (spread * deviation)
    return np.clip(np.nan_to_num(scaled, posinf=1.0, neginf=0.0), 0.0, 1.0)


#: The relevance every hit gets under :func:`calibrate_rank` (dsRAG's
#: ``ignore_absolute_relevance``).
RANK_ONLY_RELEVANCE = 0.8


def calibrate_rank(scores: ArrayLike) -> FloatArray:
    """Every hit :data:`RANK_ONLY_RELEVANCE` (0.8), whatever its score: the value then comes
    from the rank decay alone, as dsRAG's ``ignore_absolute_relevance`` does.
    """
    return np.full(np.shape(scores), RANK_ONLY_RELEVANCE, dtype=np.float64)


#: Cosine similarities of all-MiniLM/BGE-class embedders mapped linearly onto [0, 1]: unrelated
#: passages score about 0.1 with these models, clearly relevant ones 0.5 and above (docs/rse.md).
DEFAULT_COSINE_RANGE = (0.1, 0.5)

#: A calibration by name: maps an array of scores (and the cosine range, which only ``cosine``
#: reads) to relevance in [0, 1].
Calibrator = Callable[[FloatArray, tuple[float, float]], FloatArray]


CALIBRATIONS: dict[str, Calibrator] = {
    "cosine_adaptive": lambda scores, cosine_range: calibrate_cosine_adaptive(
        scores, *cosine_range
    ),
    "cosine": lambda scores, cosine_range: np.asarray(calibrate_minmax(scores, *cosine_range)),
    "spread": lambda scores, _: calibrate_spread(scores),
    "zscore": lambda scores, _: calibrate_zscore(scores),
    "rank": lambda scores, _: calibrate_rank(scores),
    "raw": lambda scores, _: np.asarray(scores, dtype=np.float64),
    "cohere": lambda scores, _: np.asarray(calibrate_beta(scores, *COHERE_RERANK_BETA)),
    "voyage": lambda scores, _: np.asarray(calibrate_beta(scores, *VOYAGE_RERANK_BETA)),
}
"""Every calibration by name: ``cosine_adaptive`` (linear over the cosine range, its top raised
to the query's best hit; the default, for embedding similarity), ``cosine`` (linear over the
fixed cosine range), ``spread`` (per query: best hit 1, median hit 0; no range to tune per
embedder), ``zscore`` (per query: the mean hit 0, two standard deviations above it 1),
``rank`` (every hit 0.8: rank decay alone), ``raw`` (scores used as they are), ``cohere`` /
``voyage`` (dsRAG's Beta CDFs)."""


def check_calibration(method: Any) -> None:
    """Raise ``ValueError`` unless ``method`` names a calibration or is a callable."""
    if callable(method) or (isinstance(method, str) and method in CALIBRATIONS):
        return
    raise ValueError(
        f"unknown calibration {method!r}: use one of {sorted(CALIBRATIONS)} or a callable "
        "mapping a numpy array of scores to relevance in [0, 1]"
    )


def calibrate(
    method: str | Callable[[FloatArray], ArrayLike],
    scores: ArrayLike,
    cosine_range: tuple[float, float] = DEFAULT_COSINE_RANGE,
) -> FloatArray:
    """Turn ``scores`` into relevance with the calibration named ``method`` (or a callable).

    A callable gets the scores as a float64 array and must return one relevance per score
    (anything else is a ``ValueError`` naming the callable).
    ``cosine_range`` is ``(low, high)`` for ``"cosine"``: similarities at or below ``low`` count
    0, at or above ``high`` 1; ``"cosine_adaptive"`` raises ``high`` to the best of ``scores``
    (pass one query's scores together).
    """
    check_calibration(method)
    values = np.asarray(scores, dtype=np.float64)
    if callable(method):
        name = getattr(method, "__name__", type(method).__name__)
        returned = method(values)
        try:
            relevance = np.asarray(returned, dtype=np.float64)
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"calibration {name} returned {returned!r}, not numbers: make it return one "
                "relevance in [0, 1] per score"
            ) from error
        if relevance.shape != values.shape:
            raise ValueError(
                f"calibration {name} returned shape {relevance.shape} for scores of shape "
                f"{values.shape}: make it return one relevance per score"
            )
        return relevance
    return CALIBRATIONS[method](values, cosine_range)


def reject_nan(scores: list[float | None]) -> None:
    """Raise ``ValueError`` if a score is NaN (it would otherwise hide among missing scores),
    or not a number at all.
    """
    for score in scores:
        if score is None:
            continue
        try:
            number = float(score) if np.ndim(score) == 0 else None
        except (TypeError, ValueError):
            number = None
        if number is None:
            raise ValueError(
                f"node score {score!r} is not a number: give each NodeWithScore a float score "
                "(or None)"
            )
        if math.isnan(number):
            raise ValueError("node scores contain NaN: fix the retriever or reranker upstream")


def node_relevance(
    method: str | Callable[[FloatArray], ArrayLike],
    scores: list[float | None],
    cosine_range: tuple[float, float] = DEFAULT_COSINE_RANGE,
) -> FloatArray:
    """Relevance of each node from its score; a node without a score counts 1.

    Only real scores are calibrated (a per-query calibration must not see stand-ins). Raises
    ``ValueError`` on a NaN score, or when the calibration returns NaN or an infinity.
    """
    reject_nan(scores)
    known = np.array([np.nan if s is None else float(s) for s in scores], dtype=np.float64)
    scored = ~np.isnan(known)
    relevance = np.ones(len(known))
    if scored.any():
        relevance[scored] = calibrate(method, known[scored], cosine_range)
    if np.isnan(relevance).any():
        raise ValueError(
            "the calibration turned node scores into NaN: make it return a number in [0, 1] "
            "for every score"
        )
    if np.isinf(relevance).any():
        name = repr(method) if isinstance(method, str) else getattr(method, "__name__", "callable")
        raise ValueError(
            f"calibration {name} left an infinite relevance (a node scored +-inf): RSE needs "
            "finite values; use a calibration that clips, such as 'cosine_adaptive' or "
            "'spread' (the defaults) or 'cohere', or give the nodes finite scores"
        )
    return relevance
