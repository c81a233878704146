"""Seeded randomized Hadamard transforms for any size n = m * 2**k (m odd): incoherence before quantization.

The transform is Q = (R_m ⊗ H_{2^k}/√2^k) · diag(s): random signs s, a normalized Walsh-Hadamard matrix on the
power-of-two factor and a seeded Haar-random orthogonal R_m on the odd factor (SmolLM2's 576 = 9·64 and
1536 = 3·512, Llama's 14336 = 7·2048). Q is orthogonal, so Q^T undoes it; only (n, seed) is stored.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from accel.memory import row_passes


def split_size(n: int) -> tuple[int, int]:
    """n = odd * 2**k -> (odd, 2**k)."""
    if n < 1:
        raise ValueError(f"transform size must be positive, got {n}")
    power = n & -n
    return n // power, power


@cache
def _factors(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    odd, _ = split_size(n)
    rng = np.random.default_rng([seed, n, 0x5EED])
    signs = rng.choice(np.array([-1.0, 1.0]), size=n)
    a = rng.standard_normal((odd, odd))
    q, r = np.linalg.qr(a)
    q *= np.sign(np.diag(r))  # Haar measure: fix the QR sign ambiguity
    signs.setflags(write=False)
    q.setflags(write=False)
    return signs, q


def _fwht(x: np.ndarray) -> np.ndarray:
    """Normalized Walsh-Hadamard transform along the last axis (length a power of two), float64."""
    n = x.shape[-1]
    y = x.reshape(-1, n).copy()
    h = 1
    while h < n:
        y = y.reshape(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = np.stack([a + b, a - b], axis=2).reshape(-1, n)
        h *= 2
    return (y / np.sqrt(n)).reshape(x.shape)


# Elements transformed in one pass (rht): the passes' temporaries, several float64 copies of a pass, stay near
# 8 MiB each instead of several copies of the whole matrix (a 14336 x 4096 weight: 0.44 GiB a copy).
RHT_ELEMENTS = 1 << 20


def rht(x: np.ndarray, seed: int, inverse: bool = False) -> np.ndarray:
    """Apply Q (or Q^T) to every vector along the last axis of x, in float64 (a pass of vectors at a time: each
    vector's result depends on it alone)."""
    x = np.asarray(x, dtype=np.float64)
    n = x.shape[-1]
    flat = x.reshape(-1, n)
    out = np.empty(flat.shape, dtype=np.float64)
    for r in row_passes(len(flat), n, RHT_ELEMENTS):
        out[r] = _rht_rows(flat[r], seed, inverse)
    return out.reshape(x.shape)


def _rht_rows(x: np.ndarray, seed: int, inverse: bool) -> np.ndarray:
    n = x.shape[-1]
    odd, power = split_size(n)
    signs, r = _factors(n, seed)
    lead = x.shape[:-1]
    if not inverse:
        y = (x * signs).reshape(*lead, odd, power)
        y = _fwht(y)
        y = np.einsum("ij,...jk->...ik", r, y)
        return y.reshape(*lead, n)
    y = x.reshape(*lead, odd, power)
    y = np.einsum("ji,...jk->...ik", r, y)
    y = _fwht(y)  # the normalized WHT is its own inverse
    return y.reshape(*lead, n) * signs


def transform_weight(w: np.ndarray, seed_out: int, seed_in: int) -> np.ndarray:
    """W -> U W V^T with U, V the transforms of the output and input sizes (rows and columns)."""
    first = rht(w, seed_in)
    del w  # a caller that passes a temporary (quantize_leech's padded copy) frees it here, before the second pass
    return rht(first.T, seed_out).T


def untransform_weight(w: np.ndarray, seed_out: int, seed_in: int) -> np.ndarray:
    """Inverse of transform_weight: U^T W V."""
    return rht(rht(w.T, seed_out, inverse=True).T, seed_in, inverse=True)


def transform_hessian(h: np.ndarray, seed_in: int) -> np.ndarray:
    """H -> V H V^T, the proxy Hessian seen by the transformed weight."""
    return rht(rht(h, seed_in).T, seed_in).T
