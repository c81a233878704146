"""Bijection between integers [0, N) and the Leech points of shells 2..max_shell, by mixed radix arithmetic."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import cache, lru_cache
from math import comb

import numpy as np

from accel.quantize.leech.golay import (
    LeechArgumentError,
    codewords,
    codewords_of_weight,
    message_index,
    rank_in_weight,
)
from accel.quantize.leech.lattice import DIM, as_points, is_leech_point
from accel.quantize.leech.shells import LeechClass, class_table

# Index layout (see docs/leech.md): index = offset[class] + local, classes in class_table order, and
#   even coset: local = ((golay_rank * n_signs + sign_digit) * n_support_arr + support_rank) * n_off_arr + off_rank
#   odd coset:  local = golay_index * n_arr + arrangement_rank
# An arrangement rank places the distinct magnitudes of a part (support / off-support / all 24 coordinates,
# slots in increasing coordinate order) one value at a time, least frequent first, the most frequent value
# filling what is left: each value's slots, as indices among the slots still free, form a k-subset whose
# colex rank sum_i C(s_i, i) is one mixed-radix digit (radix C(free, k)). Work is proportional to the number
# of non-dominant coordinates, which is small in every class.

_MAX_SLOTS = 24
_BINOM = np.array([[np.int64(comb(n, k)) for k in range(_MAX_SLOTS + 1)] for n in range(_MAX_SLOTS + 1)],
                  dtype=np.int64)  # _BINOM[n, k] = C(n, k)


@dataclass(frozen=True)
class Parts:
    """How a class's magnitudes fill one part: values in placement order (front-padded with count 0)."""

    values: np.ndarray  # (C, P) int64
    counts: np.ndarray  # (C, P) int64
    radix: np.ndarray  # (C, P) int64, C(free slots, count) per value


def _parts(groups: list[tuple[int, ...]]) -> Parts:
    orders = []
    for mags in groups:
        cnt = Counter(mags)
        orders.append(sorted(cnt.items(), key=lambda vc: (vc[1], vc[0])))  # most frequent (then largest) last
    width = max(1, max(len(o) for o in orders))
    values = np.zeros((len(groups), width), dtype=np.int64)
    counts = np.zeros_like(values)
    radix = np.ones_like(values)
    for c, (mags, order) in enumerate(zip(groups, orders)):
        free = len(mags)
        for j, (val, k) in enumerate(order, start=width - len(order)):
            values[c, j], counts[c, j], radix[c, j] = val, k, comb(free, k)
            free -= k
    for a in (values, counts, radix):
        a.setflags(write=False)
    return Parts(values, counts, radix)


@dataclass(frozen=True)
class IndexLayout:
    """Per-class arrays for vectorised index arithmetic over the ball of shells 2..max_shell."""

    max_shell: int
    classes: tuple[LeechClass, ...]
    offsets: np.ndarray  # (C + 1,) int64, offsets[-1] = ball size
    odd: np.ndarray  # (C,) bool
    weight: np.ndarray  # (C,) int64 Golay weight (24 for odd classes: they arrange over all coordinates)
    n_signs: np.ndarray  # (C,) int64
    n_support_arr: np.ndarray  # (C,) int64
    n_off_arr: np.ndarray  # (C,) int64
    support: Parts  # even: the support part; odd: all 24 coordinates
    off_support: Parts
    negative_parity: np.ndarray  # (C,) int64
    n_values: int  # magnitudes are < n_values
    lookup: dict[tuple[int, ...], int]  # magnitude counts (n_values,) -> class id

    @property
    def size(self) -> int:
        return int(self.offsets[-1])


@cache
def index_layout(max_shell: int) -> IndexLayout:
    """The cached layout for a ball; raises if the ball would not fit int64 arithmetic."""
    classes = class_table(max_shell)
    counts = [c.count for c in classes]
    total = sum(counts)
    if total >= 1 << 62:
        raise LeechArgumentError(f"the ball of shells 2..{max_shell} has {total} points, too many for 62 bits")
    n_values = max(max(c.magnitudes) for c in classes) + 1
    lookup: dict[tuple[int, ...], int] = {}
    for i, c in enumerate(classes):
        hist = [0] * n_values
        for a in c.magnitudes:
            hist[a] += 1
        lookup[tuple(hist)] = i
    arrays = {
        "offsets": np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        "odd": np.array([c.coset == "odd" for c in classes]),
        "weight": np.array([24 if c.golay_weight is None else c.golay_weight for c in classes], dtype=np.int64),
        "n_signs": np.array([c.n_signs for c in classes], dtype=np.int64),
        "n_support_arr": np.array([c.n_support_arrangements for c in classes], dtype=np.int64),
        "n_off_arr": np.array([c.n_off_support_arrangements for c in classes], dtype=np.int64),
        "negative_parity": np.array([c.negative_parity for c in classes], dtype=np.int64),
    }
    for a in arrays.values():
        a.setflags(write=False)
    return IndexLayout(
        max_shell=max_shell,
        classes=classes,
        support=_parts([c.support_magnitudes for c in classes]),
        off_support=_parts([c.off_support_magnitudes for c in classes]),
        n_values=n_values,
        lookup=lookup,
        **arrays,
    )


def ball_index_size(max_shell: int) -> int:
    """N, the number of indices of the ball of shells 2..max_shell."""
    return index_layout(max_shell).size


def class_offsets(max_shell: int) -> np.ndarray:
    """(C + 1,) uint64: class j of class_table(max_shell) holds the indices [offsets[j], offsets[j + 1])."""
    return index_layout(max_shell).offsets.astype(np.uint64)


def unrank_arrangements(rank: np.ndarray, parts: Parts, cls: np.ndarray, slots: int) -> np.ndarray:
    """(n, slots) int64 magnitudes of the arrangements with the given ranks, for classes cls (n,)."""
    n = rank.size
    values, counts, radix = parts.values[cls], parts.counts[cls], parts.radix[cls]
    width = values.shape[1]
    digits = np.empty((n, width), dtype=np.int64)
    rank = rank.astype(np.int64)
    for j in range(width - 1, -1, -1):
        rank, digits[:, j] = np.divmod(rank, radix[:, j])
    out = np.repeat(values[:, -1:], slots, axis=1)  # the most frequent value fills every slot left over
    placed = int(counts[:, :-1].max(axis=0, initial=0).sum())
    taken = np.full((n, placed), slots, dtype=np.int64)  # positions already given, ascending; `slots` = unused
    n_taken = 0
    for j in range(width - 1):
        k = counts[:, j]
        k_max = int(k.max(initial=0))
        if k_max == 0:
            continue
        r = digits[:, j].copy()
        rel = np.zeros((n, k_max), dtype=np.int64)
        for i in range(k_max, 0, -1):  # colex: the largest s with C(s, i) <= r is the i-th smallest index
            act = np.flatnonzero(k >= i)
            s = np.searchsorted(_BINOM[:, i], r[act], side="right") - 1
            rel[act, i - 1] = s
            r[act] -= _BINOM[s, i]
        pos = rel.copy()
        for t in range(n_taken):  # the rel-th free slot: step over the taken slots at or before it
            pos += taken[:, t : t + 1] <= pos
        used = np.arange(k_max)[None, :] < k[:, None]
        rows, cols = np.nonzero(used)
        out[rows, pos[rows, cols]] = values[rows, j]
        taken[:, n_taken : n_taken + k_max] = np.where(used, pos, slots)
        n_taken += k_max
        taken[:, :n_taken] = np.sort(taken[:, :n_taken], axis=1)
    return out


def rank_arrangements(vals: np.ndarray, parts: Parts, cls: np.ndarray) -> np.ndarray:
    """Inverse of unrank_arrangements: the rank of each row of magnitudes vals (n, slots)."""
    n, slots = vals.shape
    values, radix = parts.values[cls], parts.radix[cls]
    width = values.shape[1]
    free = np.ones((n, slots), dtype=bool)
    rank = np.zeros(n, dtype=np.int64)
    for j in range(width - 1):
        here = (vals == values[:, j : j + 1]) & free & (parts.counts[cls, j] > 0)[:, None]
        rel = np.cumsum(free, axis=1) - 1  # index of each slot among the free ones
        nth = np.cumsum(here, axis=1)  # 1-based rank of each slot of this value
        digit = np.where(here, _BINOM[np.maximum(rel, 0), nth], 0).sum(axis=1)
        rank = rank * radix[:, j] + digit
        free &= ~here
    return rank


@lru_cache(maxsize=1)
def support_order() -> np.ndarray:
    """(4096, 24) int64: per codeword, its support coordinates ascending, then the others ascending (the slots)."""
    order = np.argsort(1 - codewords().astype(np.int8), axis=1, kind="stable").astype(np.int64)
    order.setflags(write=False)
    return order


_CHUNK = 1 << 14  # rows per pass: keeps the (rows, 24) temporaries in cache


def index_to_point(idx: np.ndarray, max_shell: int) -> np.ndarray:
    """Decode indices (n,) in [0, ball_index_size(max_shell)) to Leech points (n, 24) int16."""
    layout = index_layout(max_shell)
    idx = _as_indices(idx, layout.size)
    out = np.empty((idx.size, DIM), dtype=np.int16)
    for lo in range(0, idx.size, _CHUNK):
        out[lo : lo + _CHUNK] = _decode(idx[lo : lo + _CHUNK], layout)
    return out


def _decode(idx: np.ndarray, layout: IndexLayout) -> np.ndarray:
    cls = np.searchsorted(layout.offsets, idx, side="right") - 1
    local = idx - layout.offsets[cls]
    out = np.zeros((idx.size, DIM), dtype=np.int16)
    odd = layout.odd[cls]
    rows = np.flatnonzero(odd)
    if rows.size:
        c = cls[rows]
        g, arr = np.divmod(local[rows], layout.n_support_arr[c])
        mags = unrank_arrangements(arr, layout.support, c, DIM)
        # the residue must be 1 + 2 c_i mod 4: +a has residue a mod 4, -a the other one
        negative = (mags & 3) != 1 + 2 * codewords()[g].astype(np.int64)
        out[rows] = np.where(negative, -mags, mags)
    for w in (0, 8, 12, 16, 24):
        rows = np.flatnonzero(~odd & (layout.weight[cls] == w))
        if rows.size:
            out[rows] = _decode_even(local[rows], cls[rows], w, layout)
    return out


def _decode_even(local: np.ndarray, c: np.ndarray, w: int, layout: IndexLayout) -> np.ndarray:
    n_on, n_off = layout.n_support_arr[c], layout.n_off_arr[c]
    rest, off_rank = np.divmod(local, n_off)
    rest, on_rank = np.divmod(rest, n_on)
    g, digit = np.divmod(rest, layout.n_signs[c])
    slots = support_order()[codewords_of_weight(w)[g]]
    vals = np.empty((local.size, DIM), dtype=np.int64)  # magnitudes in slot order
    if w:
        vals[:, :w] = unrank_arrangements(on_rank, layout.support, c, w)
    if w < DIM:
        vals[:, w:] = unrank_arrangements(off_rank, layout.off_support, c, DIM - w)
    negative = np.zeros((local.size, DIM), dtype=bool)
    if w:
        # sign bits 0 .. w-2: the support slots but the last; the last one's sign fixes the parity
        negative[:, : w - 1] = (digit[:, None] >> np.arange(w - 1)) & 1
        digit = digit >> (w - 1)
        parity = negative[:, : w - 1].sum(axis=1) & 1
        negative[:, w - 1] = parity != layout.negative_parity[c]
    nonzero = vals[:, w:] != 0  # then one bit per nonzero off-support slot, in slot order
    bit = np.maximum(np.cumsum(nonzero, axis=1) - 1, 0)
    negative[:, w:] = nonzero & (((digit[:, None] >> bit) & 1) == 1)
    out = np.empty((local.size, DIM), dtype=np.int64)
    np.put_along_axis(out, slots, np.where(negative, -vals, vals), axis=1)
    return out


def point_to_index(points: np.ndarray, max_shell: int) -> np.ndarray:
    """Encode Leech points (n, 24) of shells 2..max_shell to their indices (n,) uint64."""
    layout = index_layout(max_shell)
    x = as_points(points)
    out = np.empty(x.shape[0], dtype=np.uint64)
    for lo in range(0, x.shape[0], _CHUNK):
        out[lo : lo + _CHUNK] = _encode(x[lo : lo + _CHUNK], layout)
    return out


def _encode(x: np.ndarray, layout: IndexLayout) -> np.ndarray:
    ok = is_leech_point(x)
    if not ok.all():
        bad = int(np.flatnonzero(~ok)[0])
        raise LeechArgumentError(f"row {bad} is not a Leech lattice point")
    mags = np.abs(x)
    if mags.size and mags.max() >= layout.n_values:
        raise LeechArgumentError(f"a point lies outside the ball of shells 2..{layout.max_shell}")
    counts = np.zeros((x.shape[0], layout.n_values), dtype=np.int64)
    np.add.at(counts, (np.arange(x.shape[0])[:, None], mags), 1)
    cls = _classes_of(counts, layout)
    local = np.zeros(x.shape[0], dtype=np.int64)
    odd = layout.odd[cls]
    rows = np.flatnonzero(odd)
    if rows.size:
        c = cls[rows]
        g = message_index(((x[rows] - 1) >> 1) & 1)
        arr = rank_arrangements(mags[rows], layout.support, c)
        local[rows] = g * layout.n_support_arr[c] + arr
    for w in (0, 8, 12, 16, 24):
        rows = np.flatnonzero(~odd & (layout.weight[cls] == w))
        if rows.size:
            local[rows] = _encode_even(x[rows], cls[rows], w, layout)
    return (layout.offsets[cls] + local).astype(np.uint64)


def _encode_even(x: np.ndarray, c: np.ndarray, w: int, layout: IndexLayout) -> np.ndarray:
    cw = message_index((x >> 1) & 1)
    g = rank_in_weight()[cw]
    signed = np.take_along_axis(x, support_order()[cw], axis=1)  # slot order
    vals = np.abs(signed)
    negative = signed < 0
    n_on, n_off = layout.n_support_arr[c], layout.n_off_arr[c]
    on_rank = rank_arrangements(vals[:, :w], layout.support, c) if w else 0
    off_rank = rank_arrangements(vals[:, w:], layout.off_support, c) if w < DIM else 0
    nonzero = vals[:, w:] != 0
    bit = np.maximum(np.cumsum(nonzero, axis=1) - 1, 0) + max(w - 1, 0)
    digit = np.where(negative[:, w:] & nonzero, np.int64(1) << bit, 0).sum(axis=1)
    if w:
        digit += (negative[:, : w - 1].astype(np.int64) << np.arange(w - 1)).sum(axis=1)
    return ((g * layout.n_signs[c] + digit) * n_on + on_rank) * n_off + off_rank


def _classes_of(counts: np.ndarray, layout: IndexLayout) -> np.ndarray:
    """Class id of each row of magnitude counts; raises for a multiset outside the ball."""
    if counts.shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    uniq, inverse = np.unique(counts, axis=0, return_inverse=True)
    ids = np.empty(uniq.shape[0], dtype=np.int64)
    for j, row in enumerate(uniq):
        cid = layout.lookup.get(tuple(row.tolist()))
        if cid is None:
            raise LeechArgumentError(f"a point lies outside the ball of shells 2..{layout.max_shell}")
        ids[j] = cid
    return ids[inverse.reshape(-1)]


def _as_indices(idx: np.ndarray, size: int) -> np.ndarray:
    idx = np.asarray(idx)
    if idx.ndim == 0:
        idx = idx.reshape(1)
    if idx.ndim != 1:
        raise LeechArgumentError(f"indices must be a 1-D array, got shape {idx.shape}")
    if idx.size and not np.issubdtype(idx.dtype, np.integer):
        raise LeechArgumentError(f"indices must be integers, got dtype {idx.dtype}")
    if idx.size and np.issubdtype(idx.dtype, np.signedinteger) and idx.min() < 0:
        raise LeechArgumentError("indices must be non-negative")
    if idx.size and int(idx.max()) >= size:
        raise LeechArgumentError(f"index {int(idx.max())} is out of range: the ball has {size} points")
    return idx.astype(np.int64)
