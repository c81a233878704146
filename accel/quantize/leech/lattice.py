"""Membership and shell of points of the Leech lattice in sqrt(8)-scaled integer coordinates."""

from __future__ import annotations

import numpy as np

from accel.quantize.leech.golay import LeechArgumentError, is_codeword

DIM = 24
# In these coordinates the squared norm of a shell-m point is 16 m (the lattice norm 2m, times 8).
NORM_PER_SHELL = 16


def as_points(x: np.ndarray, name: str = "points") -> np.ndarray:
    """Check that x is an (n, 24) integer array (or one 24-vector) and return it as (n, 24) int64."""
    x = np.asarray(x)
    if x.ndim == 1:
        x = x[None, :]
    if x.ndim != 2 or x.shape[1] != DIM:
        raise LeechArgumentError(f"{name} must have shape (n, 24), got {np.shape(x)}")
    if not np.issubdtype(x.dtype, np.integer) and (
        not np.issubdtype(x.dtype, np.floating) or not np.array_equal(x, np.round(x))
    ):
        raise LeechArgumentError(f"{name} must hold integers (sqrt(8)-scaled Leech coordinates)")
    return x.astype(np.int64)


def is_leech_point(x: np.ndarray) -> np.ndarray:
    """Boolean per row of x (n, 24): is it a point of the Leech lattice (the origin included)."""
    x = as_points(x)
    parity = x & 1
    all_even = (parity == 0).all(axis=1)
    all_odd = (parity == 1).all(axis=1)
    # Even coset: x/2 mod 2 is a codeword and sum = 0 mod 8; odd coset: (x-1)/2 mod 2 is, and sum = 4 mod 8.
    # Python-style floor shifts keep negative coordinates right: (-2 >> 1) & 1 == 1 and ((-1 - 1) >> 1) & 1 == 1.
    bits = np.where(all_odd[:, None], (x - 1) >> 1, x >> 1) & 1
    total = x.sum(axis=1) & 7
    sum_ok = np.where(all_odd, total == 4, total == 0)
    return (all_even | all_odd) & sum_ok & is_codeword(bits)


def squared_norm(x: np.ndarray) -> np.ndarray:
    """Sum of squares per row (int64)."""
    x = as_points(x)
    return (x * x).sum(axis=1)


def shell_of(x: np.ndarray) -> np.ndarray:
    """Shell m of each Leech point (squared norm 16 m); raises if a row is not in the lattice."""
    x = as_points(x)
    ok = is_leech_point(x)
    if not ok.all():
        bad = int(np.flatnonzero(~ok)[0])
        raise LeechArgumentError(f"row {bad} is not a Leech lattice point: {x[bad].tolist()}")
    return squared_norm(x) // NORM_PER_SHELL
