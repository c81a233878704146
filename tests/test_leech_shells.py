"""Shell classes of the Leech lattice: definition, combinatorial counts and the ball sizes."""

from math import comb

import numpy as np
import pytest

from accel.quantize.leech import (
    LeechClass,
    ball_size,
    class_table,
    codewords,
    is_leech_point,
    shell_classes,
    shell_size,
)


def _theta_leech(m: int) -> int:
    """Number of Leech vectors of norm 2m: 65520/691 (sigma_11(m) - tau(m)), tau from q prod (1 - q^n)^24."""
    series = np.zeros(m + 1, dtype=object)
    series[0] = 1
    for n in range(1, m + 1):  # multiply by (1 - q^n)^24, truncated
        for _ in range(24):
            series[n:] = series[n:] - series[: m + 1 - n]
    tau = series[m - 1]  # Delta = q prod (1 - q^n)^24
    sigma = sum(d**11 for d in range(1, m + 1) if m % d == 0)
    value = 65520 * (sigma - tau)
    assert value % 691 == 0
    return value // 691


def test_shell_sizes_2_3_4_follow_from_class_counts():
    assert shell_size(2) == 196_560
    assert shell_size(3) == 16_773_120
    assert shell_size(4) == 398_034_000


def test_shell_sizes_match_the_theta_series_up_to_shell_13():
    for m in range(2, 14):
        assert shell_size(m) == _theta_leech(m), m


def test_class_counts_are_3_4_8_in_shells_2_3_4():
    assert [len(shell_classes(m)) for m in (2, 3, 4)] == [3, 4, 8]


def test_301_classes_in_shells_2_to_12():
    assert len(class_table(12)) == 301
    assert len(class_table(13)) == 301 + len(shell_classes(13))


def test_ball_sizes_fit_47_and_48_bits():
    assert 1.1e14 <= ball_size(12) < 1.12e14
    assert ball_size(12) < 2**47
    assert 2**47 < ball_size(13) < 2**48


def test_shell_2_classes_are_the_three_minimal_vector_shapes():
    cls = shell_classes(2)
    assert [(c.coset, c.magnitudes[:3], c.golay_weight, c.count) for c in cls] == [
        ("even", (4, 4, 0), 0, comb(24, 2) * 4),
        ("even", (2, 2, 2), 8, 759 * 2**7),
        ("odd", (3, 1, 1), None, 4096 * 24),
    ]


def test_classes_are_frozen_sorted_and_in_deterministic_order():
    table = class_table(13)
    assert table == class_table(13)
    for c in table:
        assert isinstance(c, LeechClass)
        assert len(c.magnitudes) == 24 and list(c.magnitudes) == sorted(c.magnitudes, reverse=True)
        assert sum(a * a for a in c.magnitudes) == 16 * c.shell
        assert c.count == c.n_codewords * c.n_signs * c.n_support_arrangements * c.n_off_support_arrangements
    keys = [(c.shell, c.coset != "even", tuple(-a for a in c.magnitudes)) for c in table]
    assert keys == sorted(keys)
    with pytest.raises(AttributeError):
        table[0].shell = 5  # type: ignore[misc]


def test_even_class_golay_weight_is_the_number_of_magnitudes_2_mod_4():
    for c in class_table(13):
        if c.coset == "even":
            assert c.golay_weight == sum(1 for a in c.magnitudes if a % 4 == 2)
            assert c.golay_weight in (0, 8, 12, 16, 24)
            assert all(a % 2 == 0 for a in c.magnitudes)
        else:
            assert c.golay_weight is None and c.n_codewords == 4096 and c.n_signs == 1
            assert all(a % 2 == 1 for a in c.magnitudes)


def test_odd_class_every_codeword_and_arrangement_is_a_lattice_point():
    # the claim behind the odd classes: with signs forced by x_i = 1 + 2 c_i (mod 4), the sum condition holds
    # for every codeword and arrangement once the multiset has an odd number of magnitudes = 3, 5 mod 8
    rng = np.random.default_rng(2)
    words = codewords().astype(np.int64)
    for c in class_table(9):
        if c.coset != "odd":
            continue
        mags = np.array([rng.permutation(c.magnitudes) for _ in range(64)])
        word = words[rng.integers(0, 4096, 64)]
        x = np.where((mags & 3) == 1 + 2 * word, mags, -mags)
        assert is_leech_point(x).all()


def _odd_multisets(norm: int) -> list[tuple[int, ...]]:
    """All non-increasing 24-tuples of odd positive integers with the given sum of squares."""
    out = []

    def rec(prefix: tuple[int, ...], left: int, cap: int) -> None:
        if len(prefix) == 24:
            if left == 0:
                out.append(prefix)
            return
        for a in range(cap, 0, -2):
            if a * a + (23 - len(prefix)) <= left:  # the rest need at least 1 each
                rec(prefix + (a,), left - a * a, a)

    rec((), norm, 15)
    return out


def test_odd_classes_are_exactly_the_multisets_with_odd_count_of_3_5_mod_8():
    words = codewords().astype(np.int64)
    rng = np.random.default_rng(3)
    for m in range(2, 9):
        classes = {c.magnitudes for c in shell_classes(m) if c.coset == "odd"}
        for mags in _odd_multisets(16 * m):
            valid = sum(1 for a in mags if a % 8 in (3, 5)) % 2 == 1
            assert (mags in classes) == valid, mags
            # the forced-sign points are all in the lattice, or none is
            arr = np.array([rng.permutation(mags) for _ in range(8)])
            word = words[rng.integers(0, 4096, 8)]
            x = np.where((arr & 3) == 1 + 2 * word, arr, -arr)
            assert (is_leech_point(x) == valid).all(), mags


def test_bad_shell_arguments_raise_value_error():
    for bad in (1, 0, 25, -3):
        with pytest.raises(ValueError, match="shell"):
            shell_classes(bad)
    with pytest.raises(ValueError, match="int"):
        class_table(12.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ball_size(True)  # type: ignore[arg-type]
