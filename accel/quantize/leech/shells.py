"""Shells of the Leech lattice split into classes (coset, magnitude multiset), counted combinatorially."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import cache, cached_property
from math import factorial, isqrt, prod
from numbers import Integral
from typing import Literal

from accel.quantize.leech.golay import N_CODEWORDS, LeechArgumentError, codewords_of_weight

MIN_SHELL = 2  # Lambda24 has no vectors of norm 2 (shell 1): shell 2 holds the minimal vectors
MAX_SHELL = 24  # enough for any rate we use; keeps enumeration and int64 index arithmetic safe

Coset = Literal["even", "odd"]


def multinomial(values: tuple[int, ...]) -> int:
    """Number of distinct arrangements of a multiset over len(values) slots."""
    return factorial(len(values)) // prod(factorial(c) for c in Counter(values).values())


@dataclass(frozen=True)
class LeechClass:
    """One class of a shell: all Leech points of one coset whose sorted |coordinates| equal `magnitudes`.

    Even coset: the coordinates = 2 mod 4 sit exactly on the support of a Golay codeword, so the codeword's
    weight (`golay_weight`) is the number of magnitudes = 2 mod 4. Odd coset: every codeword is possible (the
    sign of each coordinate is then forced), so `golay_weight` is None.
    """

    shell: int
    coset: Coset
    magnitudes: tuple[int, ...]  # 24 magnitudes, non-increasing
    golay_weight: int | None
    count: int

    @cached_property
    def support_magnitudes(self) -> tuple[int, ...]:
        """Magnitudes placed on the codeword support (even: the = 2 mod 4 ones); odd: all 24, over all slots."""
        if self.coset == "odd":
            return self.magnitudes
        return tuple(a for a in self.magnitudes if a % 4 == 2)

    @cached_property
    def off_support_magnitudes(self) -> tuple[int, ...]:
        """Magnitudes placed off the support (even: the = 0 mod 4 ones, zeros included); odd: none."""
        if self.coset == "odd":
            return ()
        return tuple(a for a in self.magnitudes if a % 4 == 0)

    @property
    def n_codewords(self) -> int:
        """How many Golay codewords the class uses."""
        if self.golay_weight is None:
            return N_CODEWORDS
        return int(codewords_of_weight(self.golay_weight).size)

    @property
    def n_free_signs(self) -> int:
        """Number of free sign bits (odd coset: 0, the residues force the signs)."""
        if self.coset == "odd":
            return 0
        nonzero_off = sum(1 for a in self.off_support_magnitudes if a)
        # On the support one sign is fixed by the sum condition (parity of the negatives); none when w = 0.
        return nonzero_off + max(len(self.support_magnitudes) - 1, 0)

    @property
    def n_signs(self) -> int:
        return 1 << self.n_free_signs

    @property
    def n_support_arrangements(self) -> int:
        return multinomial(self.support_magnitudes)

    @property
    def n_off_support_arrangements(self) -> int:
        return multinomial(self.off_support_magnitudes)

    @property
    def negative_parity(self) -> int:
        """Even coset: required parity of the number of negative support coordinates (sum = 0 mod 8)."""
        # sum x = sum|x| - 2 sum_{negative}|x|; a negative = 2 mod 4 coordinate shifts the sum by 4 mod 8,
        # a negative = 0 mod 4 one by 0 mod 8, so the parity is (sum|x| mod 8) / 4.
        return (sum(self.magnitudes) % 8) // 4 if self.coset == "even" else 0


def _multisets(total: int, values: tuple[int, ...], slots: int) -> list[tuple[int, ...]]:
    """All non-increasing tuples of `slots` entries from `values` (given descending) with sum of squares total."""
    out: list[tuple[int, ...]] = []

    def rec(i: int, remaining: int, left: int, acc: tuple[int, ...]) -> None:
        if i == len(values):
            if remaining == 0 and left == 0:
                out.append(acc)
            return
        sq = values[i] * values[i]
        most = left if sq == 0 else min(left, remaining // sq)
        for c in range(most, -1, -1):
            rec(i + 1, remaining - c * sq, left - c, acc + (values[i],) * c)

    rec(0, total, slots, ())
    return out


def _check_shell(m: int, name: str = "shell") -> int:
    if isinstance(m, bool) or not isinstance(m, Integral):
        raise LeechArgumentError(f"{name} must be an int, got {m!r}")
    m = int(m)
    if not MIN_SHELL <= m <= MAX_SHELL:
        raise LeechArgumentError(f"{name} must be in [{MIN_SHELL}, {MAX_SHELL}], got {m}")
    return m


@cache
def shell_classes(m: int) -> tuple[LeechClass, ...]:
    """The classes of shell m (squared norm 16 m): even coset first, then odd; each by magnitudes, descending."""
    m = _check_shell(m)
    norm = 16 * m
    top = isqrt(norm)
    classes: list[LeechClass] = []
    even_values = tuple(range(top - top % 2, -1, -2))
    for mags in sorted(_multisets(norm, even_values, 24), reverse=True):
        w = sum(1 for a in mags if a % 4 == 2)
        if w not in (0, 8, 12, 16, 24):
            continue  # the = 2 mod 4 positions must be the support of a codeword
        if w == 0 and sum(mags) % 8:
            continue  # no support coordinate whose sign could fix sum = 0 mod 8
        classes.append(_make(m, "even", mags, w))
    odd_values = tuple(range(top - (1 - top % 2), 0, -2))
    for mags in sorted(_multisets(norm, odd_values, 24), reverse=True):
        # With x_i = 1 + 2 c_i + 4 z_i the sum is 24 + 2 wt(c) + 4 sum z = 4 sum z (mod 8), and z_i is odd
        # exactly when c_i differs from [|x_i| = 3 or 5 mod 8]; wt(c) is even, so sum = 4 mod 8 iff the number
        # of magnitudes = 3 or 5 mod 8 is odd -- for every codeword and every arrangement alike.
        if sum(1 for a in mags if a % 8 in (3, 5)) % 2 == 1:
            classes.append(_make(m, "odd", mags, None))
    return tuple(classes)


def _make(m: int, coset: Coset, mags: tuple[int, ...], w: int | None) -> LeechClass:
    proto = LeechClass(m, coset, mags, w, 0)
    count = proto.n_codewords * proto.n_signs * proto.n_support_arrangements * proto.n_off_support_arrangements
    return LeechClass(m, coset, mags, w, count)


@cache
def class_table(max_shell: int) -> tuple[LeechClass, ...]:
    """All classes of shells 2..max_shell in index order (by shell, then as in shell_classes)."""
    max_shell = _check_shell(max_shell, "max_shell")
    return tuple(c for m in range(MIN_SHELL, max_shell + 1) for c in shell_classes(m))


def shell_size(m: int) -> int:
    """Number of Leech points on shell m."""
    return sum(c.count for c in shell_classes(m))


def ball_size(max_shell: int) -> int:
    """Number of Leech points on shells 2..max_shell (the origin excluded)."""
    return sum(c.count for c in class_table(max_shell))
