"""TurboQuant-MSE: the post-rotation coordinate law, the Lloyd-Max codebook's optimality, the vector coder."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import integrate, special

from accel.quantize import turboquant as tq


def _pdf(y: float, dim: int) -> float:
    return tq._density_constant(dim) * (1.0 - y * y) ** ((dim - 3) / 2)


@pytest.mark.parametrize("dim", [2, 3, 10, 64, 128])
def test_coordinate_cdf_is_the_sphere_marginal(dim):
    y = np.array([-1.0, -0.5, -0.05, 0.0, 0.01, 0.2, 0.7, 1.0])
    # y^2 ~ Beta(1/2, (d-1)/2) for one coordinate of a uniform point on S^{d-1}
    ref = 0.5 + np.sign(y) * 0.5 * special.betainc(0.5, (dim - 1) / 2, y * y)
    np.testing.assert_allclose(tq.sphere_coordinate_cdf(y, dim), ref, atol=1e-13)


@pytest.mark.parametrize("levels,dim", [(2, 64), (3, 64), (4, 10), (5, 64), (7, 3), (8, 2), (11, 128), (16, 64)])
def test_lloyd_max_is_a_fixed_point(levels, dim):
    c, t = tq.lloyd_max(levels, dim)
    assert c.shape == (levels,) and t.shape == (levels - 1,)
    assert np.all(np.diff(c) > 0) and np.allclose(c, -c[::-1], atol=1e-15)
    np.testing.assert_allclose(t, (c[1:] + c[:-1]) / 2, atol=0)  # midpoint condition
    angles = np.arcsin(np.concatenate([[-1.0], t, [1.0]]))
    const = tq._density_constant(dim)
    for j in range(levels):  # centroid condition, by quadrature of the density in y = sin(theta) (smooth there)
        lo, hi = angles[j], angles[j + 1]
        mass = integrate.quad(lambda a: const * np.cos(a) ** (dim - 2), lo, hi, epsabs=1e-15, epsrel=1e-12)[0]
        moment = integrate.quad(lambda a: const * np.sin(a) * np.cos(a) ** (dim - 2), lo, hi, epsabs=1e-15,
                                epsrel=1e-12)[0]
        assert moment / mass == pytest.approx(c[j], abs=1e-9)


@pytest.mark.parametrize("levels,dim", [(3, 64), (5, 10), (16, 64)])
def test_distortion_matches_float64_references(levels, dim):
    c, t = tq.lloyd_max(levels, dim)
    exact = tq.codebook_distortion(c, dim)
    edges = np.concatenate([[-1.0], t, [1.0]])
    by_quad = sum(integrate.quad(lambda y, cj=cj: (y - cj) ** 2 * _pdf(y, dim), edges[j], edges[j + 1],
                                 epsabs=1e-15, epsrel=1e-12, limit=200)[0] for j, cj in enumerate(c))
    assert exact == pytest.approx(by_quad, rel=1e-8)
    rng = np.random.default_rng(0)  # Monte Carlo: coordinates of uniform points on the sphere, float64
    x = rng.standard_normal((40_000, dim))
    y = (x / np.linalg.norm(x, axis=1, keepdims=True)).ravel()
    mc = np.mean((y - c[np.searchsorted(t, y)]) ** 2)
    assert mc == pytest.approx(exact, rel=0.02)


@pytest.mark.parametrize("levels", [3, 6, 13])
def test_no_nearby_codebook_does_better(levels):
    c, _ = tq.lloyd_max(levels, 64)
    best = tq.codebook_distortion(c, 64)
    rng = np.random.default_rng(levels)
    for _ in range(50):
        worse = tq.codebook_distortion(c + rng.normal(0, 1e-3, levels), 64)
        assert worse >= best - 1e-15


def test_high_dimension_approaches_the_gaussian_lloyd_max():
    c, _ = tq.lloyd_max(4, 1024)
    np.testing.assert_allclose(c * np.sqrt(1024), [-1.510, -0.4528, 0.4528, 1.510], atol=2e-3)


@pytest.mark.parametrize("dim", [10, 64, 96])
def test_vector_coder_error_is_the_codebook_distortion(dim):
    rng = np.random.default_rng(dim)
    x = (rng.standard_normal((2000, 3, dim)) * rng.uniform(0.5, 8, (2000, 3, 1))).astype(np.float32)
    levels = np.full(2000, 6)
    codes, norms = tq.encode(x, levels, seed=11)
    assert codes.dtype == np.uint8 and codes.max() < 6 and norms.dtype == np.float16
    xh = tq.decode(codes, levels, norms, seed=11)
    rel = ((xh - x) ** 2).sum(-1) / (x**2).sum(-1)
    assert rel.mean() == pytest.approx(dim * tq.codebook_distortion(tq.lloyd_max(6, dim)[0], dim), rel=0.05)
    mixed = np.where(np.arange(2000) % 2 == 0, 3, 9)  # rows with different L decode with their own codebook
    codes, norms = tq.encode(x, mixed, seed=11)
    assert codes[mixed == 3].max() == 2 and codes[mixed == 9].max() == 8
    xh = tq.decode(codes, mixed, norms, seed=11)
    assert ((xh - x) ** 2).sum(-1)[mixed == 9].mean() < ((xh - x) ** 2).sum(-1)[mixed == 3].mean()
    zero = np.zeros((1, 3, dim), np.float32)
    c0, n0 = tq.encode(zero, np.array([4]), seed=1)
    assert np.all(tq.decode(c0, np.array([4]), n0, seed=1) == 0)


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="2..256"):
        tq.lloyd_max(1, 64)
    with pytest.raises(ValueError, match="at least 2"):
        tq.lloyd_max(4, 1)
