"""The extended binary Golay code [24, 12, 8]: generator, all codewords in a fixed order, and index maps."""

from __future__ import annotations

from functools import cache, lru_cache

import numpy as np

from accel.errors import AccelError

N = 24
K = 12
N_CODEWORDS = 1 << K
WEIGHTS = (0, 8, 12, 16, 24)

# Generator polynomial of the binary [23, 12, 7] quadratic-residue (Golay) code:
# g(x) = x^11 + x^10 + x^6 + x^5 + x^4 + x^2 + 1, coefficients from x^0 up.
_GOLAY_POLY = (1, 0, 1, 0, 1, 1, 1, 0, 0, 0, 1, 1)


class LeechArgumentError(AccelError, ValueError):
    """A bad argument to the Leech-lattice functions (a ValueError the CLI also knows as an AccelError)."""


@lru_cache(maxsize=1)
def generator_matrix() -> np.ndarray:
    """The (12, 24) uint8 generator in systematic form [I_12 | A].

    Built from the cyclic [23, 12] code extended by an overall parity bit, then row-reduced so that the first
    12 coordinates are the message: any 12 consecutive coordinates of a cyclic code form an information set,
    and the systematic form makes codeword -> index a plain read of the first 12 bits.
    """
    rows = np.zeros((K, N), dtype=np.uint8)
    for r in range(K):
        rows[r, r : r + len(_GOLAY_POLY)] = _GOLAY_POLY
    rows[:, 23] = rows[:, :23].sum(axis=1) % 2  # the parity bit that extends 23 -> 24
    for col in range(K):  # Gauss-Jordan over GF(2) on the first 12 columns
        pivot = next(r for r in range(col, K) if rows[r, col])
        rows[[col, pivot]] = rows[[pivot, col]]
        for r in range(K):
            if r != col and rows[r, col]:
                rows[r] ^= rows[col]
    rows.setflags(write=False)
    return rows


@lru_cache(maxsize=1)
def codewords() -> np.ndarray:
    """All 4096 codewords as a read-only (4096, 24) uint8 array; row i is the message of i's 12 bits, MSB first."""
    bits = (np.arange(N_CODEWORDS)[:, None] >> np.arange(K - 1, -1, -1)) & 1
    words = (bits @ generator_matrix().astype(np.int64)) % 2
    words = words.astype(np.uint8)
    words.setflags(write=False)
    return words


def codeword_to_index(words: np.ndarray) -> np.ndarray:
    """Index (int64) of each codeword row of an (n, 24) 0/1 array; raises if a row is not a Golay codeword."""
    words = np.asarray(words)
    if words.ndim != 2 or words.shape[1] != N:
        raise LeechArgumentError(f"codewords must have shape (n, 24), got {words.shape}")
    if words.size and not np.isin(words, (0, 1)).all():
        raise LeechArgumentError("codeword entries must be 0 or 1")
    idx = message_index(words)
    if not np.array_equal(codewords()[idx], words.astype(np.uint8)):
        raise LeechArgumentError("a row is not a codeword of the extended Golay code")
    return idx


def index_to_codeword(idx: np.ndarray) -> np.ndarray:
    """The codewords (n, 24) uint8 of indices idx (n,) in [0, 4096)."""
    idx = np.asarray(idx)
    if idx.size and (not np.issubdtype(idx.dtype, np.integer) or idx.min() < 0 or idx.max() >= N_CODEWORDS):
        raise LeechArgumentError("Golay codeword indices must be integers in [0, 4096)")
    return codewords()[idx]


def message_index(words: np.ndarray) -> np.ndarray:
    """The index read from the first 12 bits (no check that the rest matches); words is (..., 24) of 0/1."""
    w = np.asarray(words)[..., :K].astype(np.int64)
    return (w << np.arange(K - 1, -1, -1)).sum(axis=-1)


def is_codeword(words: np.ndarray) -> np.ndarray:
    """Boolean per row of an (..., 24) 0/1 array: is it a Golay codeword."""
    w = np.asarray(words).astype(np.uint8)
    return (codewords()[message_index(w)] == w).all(axis=-1)


@lru_cache(maxsize=1)
def codeword_weights() -> np.ndarray:
    """Hamming weight of every codeword, (4096,) int64, in index order."""
    return codewords().sum(axis=1, dtype=np.int64)


@cache
def codewords_of_weight(weight: int) -> np.ndarray:
    """Indices (int64, increasing) of the codewords of the given weight; a codeword's rank is its position here."""
    if weight not in WEIGHTS:
        raise LeechArgumentError(f"Golay codewords have weight 0, 8, 12, 16 or 24, not {weight}")
    out = np.flatnonzero(codeword_weights() == weight)
    out.setflags(write=False)
    return out


@lru_cache(maxsize=1)
def rank_in_weight() -> np.ndarray:
    """For each codeword index, its position in codewords_of_weight(its weight), (4096,) int64."""
    rank = np.empty(N_CODEWORDS, dtype=np.int64)
    for w in WEIGHTS:
        idx = codewords_of_weight(w)
        rank[idx] = np.arange(idx.size)
    rank.setflags(write=False)
    return rank
