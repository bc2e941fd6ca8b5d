"""Tests for score calibration: our regularized incomplete beta against scipy and quadrature."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import itertools
import math
import sys
import warnings
from types import ModuleType

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llama_index.packs.self_rag_rse.rse.calibration import (
    CALIBRATIONS,
    COHERE_RERANK_BETA,
    DEFAULT_COSINE_RANGE,
    RANK_ONLY_RELEVANCE,
    VOYAGE_RERANK_BETA,
    beta_cdf,
    calibrate,
    calibrate_beta,
    calibrate_cosine_adaptive,
    calibrate_minmax,
    calibrate_spread,
    calibrate_zscore,
)

SHAPES = [
    (0.4, 0.4),
    (0.5, 1.8),
    (1.0, 1.0),
    (0.05, 0.05),
    (0.1, 5.0),
    (5.0, 0.1),
    (2.0, 3.0),
    (40.0, 60.0),
    (500.0, 300.0),
    (1e-3, 1e3),
]


def quadrature_beta_cdf(x: float, a: float, b: float) -> float:
    """I_x(a, b) by composite Gauss-Legendre: an oracle that shares nothing with ours.

    Integrates on the half where x <= 1/2 (the other half by the mirror identity). For a < 1 the
    substitution u = t^a removes the singularity at 0: t^(a-1) dt = du / a.
    """
    if x > 0.5:
        return 1.0 - quadrature_beta_cdf(1.0 - x, b, a)
    nodes, weights = np.polynomial.legendre.leggauss(40)
    log_beta = math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)
    if a < 1.0:
        upper = x**a
        edges = np.linspace(0.0, upper, 41)

        def integrand(u: np.ndarray) -> np.ndarray:
            return np.power(1.0 - np.power(u, 1.0 / a), b - 1.0) / a

    else:
        upper = x
        edges = np.linspace(0.0, upper, 41)

        def integrand(u: np.ndarray) -> np.ndarray:
            return np.exp((a - 1.0) * np.log(u) + (b - 1.0) * np.log1p(-u))

    total = 0.0
    for lo, hi in itertools.pairwise(edges):
        points = 0.5 * (hi - lo) * nodes + 0.5 * (hi + lo)
        total += 0.5 * (hi - lo) * float(np.dot(weights, integrand(points)))
    return total / math.exp(log_beta)


@pytest.mark.parametrize(("a", "b"), SHAPES)
def test_beta_cdf_matches_scipy(a: float, b: float) -> None:
    import scipy.special as special

    rng = np.random.default_rng(1)
    x = np.concatenate([rng.random(500), np.linspace(0.0, 1.0, 101), [1e-300, 1e-12, 1 - 1e-12]])
    np.testing.assert_allclose(beta_cdf(x, a, b), special.betainc(a, b, x), rtol=0, atol=1e-9)


@pytest.mark.parametrize(("a", "b"), [(0.4, 0.4), (0.5, 1.8), (1.0, 1.0), (2.0, 3.0), (0.3, 7.0)])
def test_beta_cdf_matches_quadrature(a: float, b: float) -> None:
    for x in [1e-6, 0.01, 0.2, 0.37, 0.5, 0.63, 0.9, 0.999]:
        assert beta_cdf(x, a, b) == pytest.approx(quadrature_beta_cdf(x, a, b), abs=1e-9)


def test_beta_cdf_known_values() -> None:
    assert beta_cdf(0.3, 1.0, 1.0) == pytest.approx(0.3, abs=1e-15)  # uniform
    assert beta_cdf(0.5, 0.4, 0.4) == pytest.approx(0.5, abs=1e-15)  # symmetric
    assert beta_cdf(0.25, 2.0, 1.0) == pytest.approx(0.0625, abs=1e-15)  # x^2
    assert beta_cdf(0.25, 1.0, 2.0) == pytest.approx(1 - 0.75**2, abs=1e-15)


def test_beta_cdf_edges_and_shapes() -> None:
    assert beta_cdf(0.0, 0.4, 0.4) == 0.0
    assert beta_cdf(1.0, 0.4, 0.4) == 1.0
    assert beta_cdf(-0.5, 0.4, 0.4) == 0.0  # a CDF: 0 below the support
    assert beta_cdf(3.0, 0.4, 0.4) == 1.0  # and 1 above it
    assert math.isnan(beta_cdf(float("nan"), 0.4, 0.4))
    assert isinstance(beta_cdf(0.3, 0.4, 0.4), float)
    grid = np.linspace(-0.5, 1.5, 12).reshape(3, 4)
    out = beta_cdf(grid, 0.5, 1.8)
    assert isinstance(out, np.ndarray) and out.shape == (3, 4)
    assert np.all(np.diff(out.ravel()) >= 0)
    # a and b broadcast against x.
    out = beta_cdf(0.3, np.array([0.4, 1.0, 2.0]), 1.0)
    np.testing.assert_allclose(out, [0.3**0.4, 0.3, 0.09], atol=1e-14)


@pytest.mark.parametrize(("a", "b"), [(0.0, 1.0), (1.0, -2.0), (float("nan"), 1.0), (math.inf, 1)])
def test_beta_cdf_rejects_bad_shapes(a: float, b: float) -> None:
    with pytest.raises(ValueError, match=r"a > 0 and b > 0|finite"):
        beta_cdf(0.5, a, b)


@settings(max_examples=200, deadline=None)
@given(
    # Dyadic x, so that 1 - x is exact and the identity is not blurred by its rounding.
    x=st.integers(0, 2**20).map(lambda k: k / 2**20),
    a=st.floats(0.05, 50.0),
    b=st.floats(0.05, 50.0),
)
def test_beta_cdf_mirror_identity_and_range(x: float, a: float, b: float) -> None:
    value = beta_cdf(x, a, b)
    assert 0.0 <= value <= 1.0
    assert value + beta_cdf(1.0 - x, b, a) == pytest.approx(1.0, abs=1e-12)


def test_calibrate_beta_clips_then_maps() -> None:
    scores = np.array([-0.2, 0.0, 0.05, 0.5, 0.95, 1.0, 1.3])
    out = calibrate_beta(scores, *COHERE_RERANK_BETA)
    np.testing.assert_allclose(out, beta_cdf(np.clip(scores, 0, 1), 0.4, 0.4), atol=0)
    assert out[0] == 0.0 and out[-1] == 1.0
    assert isinstance(calibrate_beta(0.7, *VOYAGE_RERANK_BETA), float)


@pytest.fixture(scope="module")
def dsrag_reranker() -> ModuleType:
    """dsRAG 0.5.6's reranker.py, loaded by path with its API-client imports stubbed (the
    transforms need only scipy; the package's __init__ pulls heavy dependencies).
    """
    path = importlib.metadata.distribution("dsrag").locate_file("dsrag/reranker.py")
    clients = ModuleType("dsrag.utils.imports")
    clients.cohere = clients.voyageai = None  # type: ignore[attr-defined]
    stubs = {"dsrag": ModuleType("dsrag"), "dsrag.utils": ModuleType("dsrag.utils")}
    stubs["dsrag.utils.imports"] = clients
    spec = importlib.util.spec_from_file_location("dsrag_reranker_oracle", str(path))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as patch:
        for name, stub in stubs.items():
            patch.setitem(sys.modules, name, stub)
        spec.loader.exec_module(module)
    return module


def test_calibrate_beta_matches_dsrag_transforms(dsrag_reranker: ModuleType) -> None:
    """Our Beta CDF with our constants against dsRAG's own reranker transforms (scipy)."""
    scores = np.linspace(0.0, 1.0, 201)
    for name, params in (
        ("CohereReranker", COHERE_RERANK_BETA),
        ("VoyageReranker", VOYAGE_RERANK_BETA),
    ):
        theirs = getattr(dsrag_reranker, name).transform(None, scores)
        np.testing.assert_allclose(calibrate_beta(scores, *params), theirs, atol=1e-9)
        np.testing.assert_allclose(calibrate(name[:6].lower(), scores), theirs, atol=1e-9)


def test_calibrate_minmax() -> None:
    out = calibrate_minmax([0.0, 0.1, 0.45, 0.8, 0.95], low=0.1, high=0.8)
    np.testing.assert_allclose(out, [0.0, 0.0, 0.5, 1.0, 1.0], atol=1e-15)
    assert calibrate_minmax(0.3, 0.2, 0.4) == pytest.approx(0.5)
    assert isinstance(calibrate_minmax(0.3, 0.2, 0.4), float)
    with pytest.raises(ValueError, match="high > low"):
        calibrate_minmax([0.5], low=0.8, high=0.8)


def test_cosine_adaptive_stretches_to_the_best_hit_and_no_further() -> None:
    # Strong hits: a fixed (0.1, 0.5) range maps 0.55, 0.65 and 0.75 all to 1.
    strong = np.array([0.75, 0.65, 0.55, 0.3, 0.1, 0.05])
    assert calibrate_minmax(strong, 0.1, 0.5)[:3].tolist() == [1.0, 1.0, 1.0]
    out = calibrate_cosine_adaptive(strong, 0.1, 0.5)
    np.testing.assert_allclose(out, (np.clip(strong, 0.1, None) - 0.1) / 0.65, atol=1e-15)
    assert out[0] == 1.0 and out[0] > out[1] > out[2] > out[3] > 0.0 and out[4] == out[5] == 0.0
    # Weak hits only: the fixed range applies, so nothing is made to look relevant.
    weak = np.array([0.3, 0.2, 0.05])
    np.testing.assert_array_equal(
        calibrate_cosine_adaptive(weak, 0.1, 0.5), calibrate_minmax(weak, 0.1, 0.5)
    )
    # Infinities saturate without stretching the range; no scores, no values.
    with_inf = calibrate_cosine_adaptive([np.inf, 0.6, -np.inf], 0.1, 0.5)
    np.testing.assert_allclose(with_inf, [1.0, 1.0, 0.0])
    assert calibrate_cosine_adaptive([], 0.1, 0.5).shape == (0,)
    with pytest.raises(ValueError, match="high > low"):
        calibrate_cosine_adaptive([0.2], 0.5, 0.5)


@given(st.lists(st.floats(-1.0, 1.0), min_size=1, max_size=30))
def test_cosine_adaptive_keeps_the_order_and_stays_in_range(scores: list[float]) -> None:
    values = np.array(scores)
    out = calibrate_cosine_adaptive(values, *DEFAULT_COSINE_RANGE)
    assert np.all((out >= 0.0) & (out <= 1.0))
    order = np.argsort(values, kind="stable")
    assert np.all(np.diff(out[order]) >= 0.0)
    if values.max() > DEFAULT_COSINE_RANGE[1]:
        assert out.max() == 1.0


@given(
    st.lists(st.integers(-100, 100), min_size=1, max_size=30),
    st.floats(0.05, 5.0),
    st.floats(-1.0, 1.0),
)
def test_spread_ignores_the_embedders_scale_and_offset(
    hundredths: list[int], scale: float, shift: float
) -> None:
    """Best hit 1, median hit 0, in range, order kept; and a model scoring the same ranking on
    another scale (compressed cosines, say) gets the same relevance. (Scores on a grid of
    hundredths: a scale or shift that rounds distinct scores together is another ranking.)
    """
    values = np.array(hundredths) / 100
    out = calibrate_spread(values)
    assert np.all((out >= 0.0) & (out <= 1.0))
    order = np.argsort(values, kind="stable")
    assert np.all(np.diff(out[order]) >= 0.0)
    assert out[np.argmax(values)] == 1.0
    assert np.all(out[values <= np.median(values)] == 0.0) or values.max() == np.median(values)
    np.testing.assert_allclose(calibrate_spread(values * scale + shift), out, atol=1e-9)


def test_spread_edge_cases() -> None:
    np.testing.assert_array_equal(calibrate_spread(np.array([0.4])), [1.0])
    np.testing.assert_array_equal(calibrate_spread(np.array([0.4, 0.4, 0.4])), [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(
        calibrate_spread(np.array([np.inf, 0.2, 0.5, -np.inf, 0.3])), [1.0, 0.0, 1.0, 0.0, 0.0]
    )


# -- the registry: every calibration named once ---------------------------------------------------


def test_calibrate_dispatches_by_name():
    scores = np.array([-0.2, 0.05, 0.3, 0.55, 0.97])
    assert sorted(CALIBRATIONS) == [
        "cohere",
        "cosine",
        "cosine_adaptive",
        "rank",
        "raw",
        "spread",
        "voyage",
        "zscore",
    ]
    np.testing.assert_array_equal(calibrate("spread", scores), calibrate_spread(scores))
    np.testing.assert_array_equal(calibrate("zscore", scores), calibrate_zscore(scores))
    np.testing.assert_array_equal(
        calibrate("cosine_adaptive", scores),
        calibrate_cosine_adaptive(scores, *DEFAULT_COSINE_RANGE),
    )
    np.testing.assert_array_equal(
        calibrate("cosine", scores), calibrate_minmax(scores, *DEFAULT_COSINE_RANGE)
    )
    np.testing.assert_array_equal(calibrate("cosine", scores, (0.0, 1.0)), np.clip(scores, 0, 1))
    np.testing.assert_array_equal(calibrate("raw", scores), scores)
    np.testing.assert_array_equal(
        calibrate("cohere", scores), calibrate_beta(scores, *COHERE_RERANK_BETA)
    )
    np.testing.assert_array_equal(
        calibrate("voyage", scores), calibrate_beta(scores, *VOYAGE_RERANK_BETA)
    )
    np.testing.assert_array_equal(calibrate(lambda s: s / 2, scores), scores / 2)


def test_unknown_calibration_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"'softmax'.*cohere.*cosine.*raw.*voyage"):
        calibrate("softmax", [0.5])


def test_a_callable_must_return_one_number_per_score():
    scores = np.array([0.2, 0.5, 0.9])
    with pytest.raises(ValueError, match=r"calibration <lambda> returned shape \(\) for"):
        calibrate(lambda s: 0.5, scores)
    with pytest.raises(ValueError, match="returned 'high', not numbers"):
        calibrate(lambda s: "high", scores)


def test_minmax_takes_scores_at_the_float_limit_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaled = calibrate_minmax(np.array([1.7e308, -1.7e308, 0.3]), 0.1, 0.5)
    np.testing.assert_allclose(scaled, [1.0, 0.0, 0.5])


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.floats(-1, 1), min_size=2, max_size=40),
    scale=st.floats(0.1, 10),
    shift=st.floats(-5, 5),
)
def test_zscore_is_per_query_and_ignores_the_embedders_scale(values, scale, shift) -> None:
    """The mean hit counts 0, a hit two deviations above it 1; scale and offset do not matter."""
    scores = np.array(values)
    out = calibrate_zscore(scores)
    assert np.all((out >= 0.0) & (out <= 1.0))
    order = np.argsort(scores, kind="stable")
    assert np.all(np.diff(out[order]) >= 0.0)
    if scores.std() > 1e-6:
        assert np.all(out[scores <= scores.mean()] == 0.0)
        expected = np.clip((scores - scores.mean()) / (2 * scores.std()), 0, 1)
        np.testing.assert_allclose(out, expected, atol=1e-9)
        np.testing.assert_allclose(calibrate_zscore(scores * scale + shift), out, atol=1e-6)


def test_zscore_edge_cases() -> None:
    np.testing.assert_array_equal(calibrate_zscore(np.array([0.4, 0.4])), [1.0, 1.0])
    np.testing.assert_allclose(
        calibrate_zscore(np.array([np.inf, 0.2, 0.4, -np.inf])), [1.0, 0.0, 0.5, 0.0]
    )


def test_rank_only_gives_every_hit_the_same_relevance() -> None:
    out = calibrate("rank", np.array([0.9, 0.1, -0.3]))
    np.testing.assert_array_equal(out, [RANK_ONLY_RELEVANCE] * 3)
    assert RANK_ONLY_RELEVANCE == 0.8  # dsRAG's ignore_absolute_relevance
