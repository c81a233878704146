"""The index bijection between [0, N) and the Leech ball of shells 2..max_shell."""

import numpy as np
import pytest

from accel.quantize.leech import (
    ball_index_size,
    ball_size,
    class_offsets,
    class_table,
    index_to_point,
    is_leech_point,
    point_to_index,
    shell_of,
)


def _indices_of_every_class(max_shell: int, per_class: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random indices of every class (plus each class's first and last) and the class of each."""
    offsets = class_offsets(max_shell).astype(np.int64)
    rng = np.random.default_rng(seed)
    idx, cls = [], []
    for j in range(offsets.size - 1):
        lo, hi = int(offsets[j]), int(offsets[j + 1])
        picks = np.concatenate([[lo, hi - 1], rng.integers(lo, hi, per_class)])
        idx.append(picks)
        cls.append(np.full(picks.size, j))
    return np.concatenate(idx).astype(np.uint64), np.concatenate(cls)


def test_every_decoded_point_is_in_leech_on_its_class_shell():
    table = class_table(13)
    idx, cls = _indices_of_every_class(13, 40, seed=0)
    points = index_to_point(idx, 13)
    assert points.dtype == np.int16 and points.shape == (idx.size, 24)
    assert is_leech_point(points).all()
    assert np.array_equal(shell_of(points), [table[j].shell for j in cls])
    mags = -np.sort(-np.abs(points.astype(np.int64)), axis=1)
    assert np.array_equal(mags, np.array([table[j].magnitudes for j in cls]))
    odd = np.array([table[j].coset == "odd" for j in cls])
    assert np.array_equal(points[:, 0] % 2 == 1, odd)


def test_index_roundtrip_every_class():
    for max_shell in (12, 13):
        idx, _ = _indices_of_every_class(max_shell, 60, seed=max_shell)
        back = point_to_index(index_to_point(idx, max_shell), max_shell)
        assert back.dtype == np.uint64
        assert np.array_equal(back, idx)


def test_index_roundtrip_point_first():
    # decode -> encode -> decode on random points of the whole ball
    rng = np.random.default_rng(7)
    idx = rng.integers(0, ball_index_size(13), 5000, dtype=np.uint64)
    points = index_to_point(idx, 13)
    assert np.array_equal(index_to_point(point_to_index(points, 13), 13), points)


def test_shell_2_exhaustive_all_distinct_in_leech_and_roundtrip():
    n = ball_index_size(2)
    assert n == 196_560
    idx = np.arange(n, dtype=np.uint64)
    points = index_to_point(idx, 2)
    assert is_leech_point(points).all()
    assert (shell_of(points) == 2).all()
    rows = np.ascontiguousarray(points).view(np.dtype((np.void, points.itemsize * 24))).ravel()
    assert np.unique(rows).size == n
    assert np.array_equal(point_to_index(points, 2), idx)
    assert np.array_equal(point_to_index(points, 13), idx)  # shells are nested at the front of every ball


def test_index_sizes_match_ball_sizes_and_fit_48_bits():
    assert ball_index_size(12) == ball_size(12) < 2**47
    assert ball_index_size(13) == ball_size(13) < 2**48
    offsets = class_offsets(13)
    assert offsets[0] == 0 and int(offsets[-1]) == ball_size(13)
    assert np.array_equal(np.diff(offsets.astype(np.int64)), [c.count for c in class_table(13)])
    # the last index decodes and round-trips
    last = np.array([ball_size(13) - 1], dtype=np.uint64)
    assert np.array_equal(point_to_index(index_to_point(last, 13), 13), last)


def test_index_order_within_a_class_is_mixed_radix():
    # consecutive indices of shell 2's (2^8, 0^16) class: the last digit (sign bits) changes first
    start = int(class_offsets(2)[1])
    points = index_to_point(np.arange(start, start + 4, dtype=np.uint64), 2)
    support = points != 0
    assert (support == support[0]).all()  # same codeword
    assert (np.abs(points) == np.abs(points[0])).all()  # same magnitudes: only signs differ
    assert len({tuple(p) for p in points.tolist()}) == 4


def test_index_arguments_are_checked():
    with pytest.raises(ValueError, match="out of range"):
        index_to_point(np.array([ball_index_size(3)], dtype=np.uint64), 3)
    with pytest.raises(ValueError, match="non-negative"):
        index_to_point(np.array([-1]), 3)
    with pytest.raises(ValueError, match="integers"):
        index_to_point(np.array([1.5]), 3)
    with pytest.raises(ValueError, match="not a Leech"):
        point_to_index(np.ones((1, 24), dtype=np.int64), 3)
    deep = index_to_point(np.array([ball_index_size(4) - 1], dtype=np.uint64), 4)
    with pytest.raises(ValueError, match="outside the ball"):
        point_to_index(deep, 3)
    with pytest.raises(ValueError, match="outside the ball"):
        point_to_index(np.zeros((1, 24), dtype=np.int64), 3)  # the origin is not in the ball
    with pytest.raises(ValueError, match="shape"):
        point_to_index(np.zeros((2, 23), dtype=np.int64), 3)
    with pytest.raises(ValueError, match="max_shell"):
        index_to_point(np.array([0], dtype=np.uint64), 1)
