"""TurboQuant-MSE for KV vectors: store the norm, rotate with a seeded randomized Hadamard transform, then code
every coordinate with the Lloyd-Max quantizer of the post-rotation coordinate distribution.

After normalizing x to the unit sphere S^{d-1} and rotating it with a random orthogonal Q, each coordinate y of
Q x / |x| follows the marginal of a uniform point on the sphere:

    f_d(y) = C_d (1 - y^2)^((d-3)/2) on [-1, 1],   C_d = Γ(d/2) / (√π Γ((d-1)/2)),

so one scalar codebook per (L, d) serves every coordinate. It is solved by Lloyd's iteration (thresholds at the
midpoints of neighbouring centroids, centroids at the conditional means of their cells) with exact cell integrals:
with y = sin θ the density is C_d cos^{d-2} θ dθ, whose integral has a closed recursion (∫cos^n, below) and whose
first moment is C_d [cos^{d-1} α - cos^{d-1} β] / (d - 1). Everything is float64 and needs no SciPy.

Decode: x̂ = |x|_fp16 · Qᵀ c[codes]. Q is `accel.quantize.incoherence.rht` (any d = m·2^k), one seed per use.
"""

from __future__ import annotations

import math
from functools import cache
from statistics import NormalDist

import numpy as np

from accel.quantize.incoherence import rht

MAX_ITERATIONS = 20_000
TOLERANCE = 1e-14


def _cos_power_integral(theta: np.ndarray, n: int) -> np.ndarray:
    """∫_0^θ cos^n t dt for integer n >= 0 (the recursion I_n = cos^{n-1} sin / n + (n-1)/n I_{n-2})."""
    theta = np.asarray(theta, dtype=np.float64)
    s, c = np.sin(theta), np.cos(theta)
    prev = theta if n % 2 == 0 else s  # I_0 or I_1
    for k in range(2 if n % 2 == 0 else 3, n + 1, 2):
        prev = c ** (k - 1) * s / k + (k - 1) / k * prev
    return prev


def _density_constant(dim: int) -> float:
    return math.exp(math.lgamma(dim / 2) - math.lgamma((dim - 1) / 2)) / math.sqrt(math.pi)


def sphere_coordinate_cdf(y: np.ndarray, dim: int) -> np.ndarray:
    """P(Y <= y) for one coordinate of a uniform point on S^{dim-1} (dim >= 2)."""
    theta = np.arcsin(np.clip(np.asarray(y, dtype=np.float64), -1.0, 1.0))
    return 0.5 + _density_constant(dim) * _cos_power_integral(theta, dim - 2)


def _cell_moments(edges: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(mass, first moment) of each cell between consecutive edges (edges include -1 and 1)."""
    theta = np.arcsin(np.clip(edges, -1.0, 1.0))
    const = _density_constant(dim)
    mass = np.diff(const * _cos_power_integral(theta, dim - 2))
    cpow = np.cos(theta) ** (dim - 1)
    moment = const * (cpow[:-1] - cpow[1:]) / (dim - 1)
    return mass, moment


def codebook_distortion(centroids: np.ndarray, dim: int) -> float:
    """E[(Y - c(Y))^2] per coordinate with nearest-centroid coding (exact, float64)."""
    centroids = np.sort(np.asarray(centroids, dtype=np.float64))
    thresholds = (centroids[1:] + centroids[:-1]) / 2
    edges = np.concatenate([[-1.0], thresholds, [1.0]])
    mass, moment = _cell_moments(edges, dim)
    return float(1.0 / dim - 2 * (centroids * moment).sum() + (centroids**2 * mass).sum())


@cache
def lloyd_max(levels: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(centroids [L], thresholds [L-1]) of the MSE-optimal scalar quantizer for f_dim, float64, read-only."""
    if not 2 <= levels <= 256:
        raise ValueError(f"TurboQuant takes 2..256 levels, got {levels}")
    if dim < 2:
        raise ValueError(f"TurboQuant needs vectors of at least 2 values, got {dim}")
    sigma = 1.0 / math.sqrt(dim)
    normal = NormalDist()
    c = np.array([normal.inv_cdf((j + 0.5) / levels) * sigma for j in range(levels)])
    c = np.clip(c, -0.999, 0.999)
    for _ in range(MAX_ITERATIONS):
        t = (c[1:] + c[:-1]) / 2
        mass, moment = _cell_moments(np.concatenate([[-1.0], t, [1.0]]), dim)
        new = np.where(mass > 0, moment / np.where(mass > 0, mass, 1.0), c)
        new = (new - new[::-1]) / 2  # the density is even: keep the codebook exactly symmetric
        done = np.max(np.abs(new - c)) < TOLERANCE
        c = new
        if done:
            break
    t = (c[1:] + c[:-1]) / 2
    c.setflags(write=False)
    t.setflags(write=False)
    return c, t


def encode(x: np.ndarray, levels: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """x [N, H, d] float32, levels [N] -> codes [N, H, d] uint8, norms [N, H] fp16."""
    x = np.asarray(x, dtype=np.float64)
    levels = np.asarray(levels, dtype=np.int64)
    dim = x.shape[-1]
    norm = np.sqrt((x * x).sum(axis=-1))
    unit = x / np.where(norm > 0, norm, 1.0)[..., None]
    y = rht(unit, seed)
    codes = np.empty(x.shape, dtype=np.uint8)
    for lv in np.unique(levels):
        rows = levels == lv
        _, thresholds = lloyd_max(int(lv), dim)
        codes[rows] = np.searchsorted(thresholds, y[rows]).astype(np.uint8)
    # saturated at float16's largest value: a vector of fp16 entries can be longer (128 entries of 6000), and an
    # infinite norm would decode to NaN; the saturated one shortens it by the excess (3.5% there)
    return codes, np.minimum(norm, float(np.finfo(np.float16).max)).astype(np.float16)


def decode(codes: np.ndarray, levels: np.ndarray, norms: np.ndarray, seed: int) -> np.ndarray:
    """Inverse of encode (float32 [N, H, d])."""
    levels = np.asarray(levels, dtype=np.int64)
    dim = codes.shape[-1]
    y = np.empty(codes.shape, dtype=np.float64)
    for lv in np.unique(levels):
        rows = levels == lv
        centroids, _ = lloyd_max(int(lv), dim)
        y[rows] = centroids[codes[rows]]
    return (rht(y, seed, inverse=True) * norms.astype(np.float64)[..., None]).astype(np.float32)
