"""Nearest-point and best-direction search over the Leech ball: exactness and argument checks."""

import numpy as np
import pytest

from accel.quantize.leech import (
    ball_index_size,
    class_offsets,
    class_table,
    codewords_of_weight,
    index_to_point,
    is_leech_point,
    nearest_direction,
    nearest_point,
    point_to_index,
    shell_of,
)
from accel.quantize.leech.search import best_in_class

_SCALES = (0.12, 0.3, 0.7, 2.0)  # from "target far outside the ball" to "target near the origin"


def _targets(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = rng.standard_normal((n, 24))
    q = n // 4
    t[:q] *= np.where(rng.random((q, 24)) < 0.1, 6.0, 1.0)  # a few outliers
    t[q : 2 * q] *= rng.random((q, 24)) < 0.3  # sparse: many ties between codewords
    return t


def _brute_force_shell_maxima(targets: np.ndarray, max_shell: int) -> dict[int, np.ndarray]:
    """max over the points p of each shell of <t, p>, by enumerating the ball through index_to_point."""
    best: dict[int, np.ndarray] = {}
    chunk = 1 << 18
    for m in range(2, max_shell + 1):  # shell m holds the indices [ball(m - 1), ball(m))
        start = ball_index_size(m - 1) if m > 2 else 0
        for lo in range(start, ball_index_size(m), chunk):
            points = index_to_point(np.arange(lo, min(ball_index_size(m), lo + chunk), dtype=np.uint64), max_shell)
            assert (shell_of(points[:: chunk // 64]) == m).all()
            cur = (targets @ points.T.astype(np.float64)).max(axis=1)
            best[m] = np.maximum(best[m], cur) if m in best else cur
    return best


def test_nearest_point_and_direction_optimal_against_brute_force_on_shells_2_3():
    targets = _targets(32, seed=0)
    maxima = _brute_force_shell_maxima(targets, 3)
    assert sorted(maxima) == [2, 3]
    tt = (targets * targets).sum(axis=1)
    for scale in _SCALES:
        result = nearest_point(targets, scale, 3)
        brute = np.min([tt - 2 * scale * maxima[m] + scale**2 * 16 * m for m in maxima], axis=0)
        assert np.allclose(result.objective, brute, rtol=1e-12, atol=1e-9), scale
    result = nearest_direction(targets, 3)
    brute = np.max([maxima[m] / np.sqrt(16 * m) for m in maxima], axis=0)
    assert np.allclose(result.objective, brute, rtol=1e-12, atol=1e-12)


def test_nearest_point_optimal_against_brute_force_on_shell_2_only():
    targets = _targets(24, seed=1)
    maxima = _brute_force_shell_maxima(targets, 2)
    tt = (targets * targets).sum(axis=1)
    for scale in _SCALES:
        result = nearest_point(targets, scale, 2)
        assert np.allclose(result.objective, tt - 2 * scale * maxima[2] + scale**2 * 32, rtol=1e-12, atol=1e-9)
    assert np.allclose(nearest_direction(targets, 2).objective, maxima[2] / np.sqrt(32), rtol=1e-12)


@pytest.mark.parametrize("max_shell", [12, 13])
def test_search_never_worse_than_random_ball_points(max_shell):
    rng = np.random.default_rng(max_shell)
    targets = _targets(48, seed=max_shell)
    pool = index_to_point(rng.integers(0, ball_index_size(max_shell), 3000, dtype=np.uint64), max_shell)
    pool = pool.astype(np.float64)
    dots = targets @ pool.T
    norms = (pool * pool).sum(axis=1)
    tt = (targets * targets).sum(axis=1)
    for scale in (0.2, 0.35, 0.6):
        result = nearest_point(targets, scale, max_shell)
        random_best = (tt[:, None] - 2 * scale * dots + scale**2 * norms[None, :]).min(axis=1)
        assert (result.objective <= random_best + 1e-9).all()
    result = nearest_direction(targets, max_shell)
    assert (result.objective >= (dots / np.sqrt(norms)[None, :]).max(axis=1) - 1e-12).all()


def test_search_result_is_consistent():
    targets = _targets(40, seed=3)
    scale = np.linspace(0.2, 0.5, 40)  # one scale per block
    for result, check in (
        (nearest_point(targets, scale, 13), lambda p: ((targets - scale[:, None] * p) ** 2).sum(axis=1)),
        (nearest_direction(targets, 13), lambda p: (targets * p).sum(axis=1) / np.sqrt((p * p).sum(axis=1))),
    ):
        points = result.points.astype(np.float64)
        assert result.points.dtype == np.int16 and result.indices.dtype == np.uint64
        assert is_leech_point(result.points).all()
        assert ((shell_of(result.points) >= 2) & (shell_of(result.points) <= 13)).all()
        assert np.array_equal(index_to_point(result.indices, 13), result.points)
        assert np.array_equal(point_to_index(result.points, 13), result.indices)
        assert np.allclose(result.objective, check(points))


def test_search_does_not_depend_on_batch_order():
    targets = _targets(30, seed=4)
    a = nearest_point(targets, 0.3, 13)
    b = nearest_point(targets[::-1], 0.3, 13)
    assert np.allclose(a.objective, b.objective[::-1])
    assert np.array_equal(a.indices, b.indices[::-1])


def test_direction_of_zero_target_and_of_a_lattice_point():
    targets = np.zeros((2, 24))
    point = index_to_point(np.array([123_456_789], dtype=np.uint64), 13)[0]
    targets[1] = point * 0.37
    result = nearest_direction(targets, 13)
    assert result.objective[0] == 0.0 and is_leech_point(result.points[:1]).all()
    # a scaled lattice point is its own best direction: it lies on shell 4, so 2p, 3p, ... are outside the ball
    assert shell_of(point[None, :])[0] == 4
    assert np.array_equal(result.points[1], point)
    assert np.array_equal(nearest_point(targets[1:], 0.37, 13).points[0], point)


def test_search_arguments_are_checked():
    t = np.zeros((3, 24))
    with pytest.raises(ValueError, match="shape"):
        nearest_point(np.zeros((3, 23)), 1.0, 13)
    with pytest.raises(ValueError, match="finite"):
        nearest_point(np.full((1, 24), np.nan), 1.0, 13)
    with pytest.raises(ValueError, match="positive"):
        nearest_point(t, 0.0, 13)
    with pytest.raises(ValueError, match="positive"):
        nearest_point(t, -1.0, 13)
    with pytest.raises(ValueError, match="shape"):
        nearest_point(t, np.ones(2), 13)
    with pytest.raises(ValueError, match="max_shell"):
        nearest_direction(t, 1)
    with pytest.raises(ValueError, match="int"):
        nearest_direction(t, 12.5)


def _check_best_in_class(max_shell: int, limit: int, seed: int) -> int:
    """Compare best_in_class with enumeration of (class, codeword) slices of at most `limit` points."""
    table = class_table(max_shell)
    offsets = class_offsets(max_shell).astype(np.int64)
    rng = np.random.default_rng(seed)
    targets = _targets(8, seed=seed)
    targets[0] = np.round(targets[0])  # ties
    checked = 0
    for j, cls in enumerate(table):
        per_word = cls.count // cls.n_codewords  # a codeword's points are one contiguous index range
        if per_word > limit:
            continue
        if cls.golay_weight is None:
            rank = word = int(rng.integers(0, 4096))
        else:
            ids = codewords_of_weight(cls.golay_weight)
            rank = int(rng.integers(0, ids.size))
            word = int(ids[rank])
        start = offsets[j] + rank * per_word
        points = index_to_point(np.arange(start, start + per_word, dtype=np.uint64), max_shell)
        brute = (targets @ points.T.astype(np.float64)).max(axis=1)
        assert np.allclose(best_in_class(targets, max_shell, j, word), brute, rtol=1e-12, atol=1e-12), cls
        checked += 1
    return checked


def test_best_in_class_is_exact_against_enumeration():
    # the per-(class, codeword) sorted matching with its sign and parity rules, on every small class
    assert _check_best_in_class(13, 50_000, seed=5) >= 60


@pytest.mark.slow
def test_best_in_class_is_exact_against_enumeration_large_classes():
    assert _check_best_in_class(13, 3_000_000, seed=6) >= 140


def test_pruned_search_equals_evaluating_every_codeword():
    # pruning by the relaxed bounds never drops the optimum: compare with the exact evaluation of all 8192
    # (coset, codeword) pairs of every block, on Gaussian, heavy-tailed, integer and sparse targets
    from accel.quantize.leech import search

    rng = np.random.default_rng(8)
    targets = np.concatenate([
        rng.standard_normal((4, 24)),
        rng.standard_t(2, (3, 24)),
        np.round(1.5 * rng.standard_normal((3, 24))),
        rng.standard_normal((3, 24)) * (rng.random((3, 24)) < 0.25),
    ])
    n = targets.shape[0]
    blk, col = np.repeat(np.arange(n), 8192), np.tile(np.arange(8192), n)
    tab = search._tables(13)
    norms = np.linalg.norm(targets, axis=1)
    for scale in (0.1, 0.3, 1.5, None):
        if scale is None:
            z, mode = targets / norms[:, None], "direction"
            got = nearest_direction(targets, 13).objective / norms
        else:
            z, mode = targets / scale, "nearest"
            got = (z * z).sum(axis=1) - nearest_point(targets, scale, 13).objective / scale**2
        every, _ = search._evaluate(tab, search._prepare(z), blk, col, mode)
        assert np.allclose(every.reshape(n, 8192).max(axis=1), got, rtol=1e-10, atol=1e-10), scale
