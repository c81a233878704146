"""Exact nearest-point and best-direction search over the Leech ball of shells 2..max_shell."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Literal

import numpy as np

from accel.quantize.leech.golay import LeechArgumentError, codeword_weights, codewords
from accel.quantize.leech.index import index_layout, index_to_point, point_to_index
from accel.quantize.leech.lattice import DIM
from accel.quantize.leech.shells import MIN_SHELL

# Overview (docs/leech.md has the full argument).
# 1. Exact per (codeword, class): with the codeword c fixed, the best point of a class is found by sorting:
#    even coset -- the support magnitudes go to the support coordinates and the others to the rest, largest to
#    largest |t|, signs follow t, and if the number of negatives on the support has the wrong parity the
#    support coordinate with the smallest |t| (which carries the smallest support magnitude) flips;
#    odd coset -- the signs are forced (x_i = 1 + 2 c_i mod 4), which makes <t, x> = sum_k W[k] u_(k) with
#    u_i = t_i (1 - 2 c_i) sorted descending and W = (= 1 mod 4 magnitudes descending, then minus the = 3 mod 4
#    magnitudes ascending): the = 3 mod 4 magnitudes go to the smallest u_i (exchange argument).
# 2. Pruning by codeword: relaxing "x is a ball point of coset c" to "each x_i lies in its residue class
#    (2 c_i or 1 + 2 c_i mod 4) and |x_i| is at most the largest magnitude" makes the distance separable, so a
#    lower bound on the distance (upper bound on the objective) for all 4096 codewords is one matrix product.
#    The norm bound enters through a Lagrange multiplier (nearest point) or one scale per shell (direction).
#    Exact evaluation then only runs for the codewords whose bound beats the best value found so far.

_F32_MARGIN = 4e-6  # 32 * 2^-24, rounding margin of a float32 bound per unit of its terms' magnitudes
_CHUNK = 512  # blocks per batch: bounds are (chunk, 8192) float32
_PAIR_CHUNK = 1024  # (block, codeword) pairs evaluated exactly per pass
_SEEDS = 8  # codewords per block evaluated first, best bounds first, to set the pruning threshold
_N_WORDS = 4096
_WEIGHTS = (0, 8, 12, 16, 24)
_NO_POINT = np.float32(-1e9)  # bound offset for codewords whose weight has no class (float32 matmul safe)

Mode = Literal["nearest", "direction"]


@dataclass(frozen=True)
class SearchResult:
    """Best ball points for a batch of targets."""

    indices: np.ndarray  # (n,) uint64, the points' indices in the ball of shells 2..max_shell
    points: np.ndarray  # (n, 24) int16, sqrt(8)-scaled Leech coordinates
    objective: np.ndarray  # (n,) float64: ||t - scale p||^2 (nearest_point) or <t, p>/||p|| (nearest_direction)


@dataclass(frozen=True)
class _EvenGroup:
    weight: int
    mags: np.ndarray  # (K, 24) float64: support magnitudes descending, then off-support magnitudes descending
    min_support: np.ndarray  # (K,) smallest support magnitude
    parity: np.ndarray  # (K,) required parity of negatives on the support
    shell: np.ndarray  # (K,)
    class_id: np.ndarray  # (K,)


@dataclass(frozen=True)
class _Tables:
    max_shell: int
    all_mags: np.ndarray  # (C, 24) float64, every class's magnitudes descending (rearrangement bounds)
    shell: np.ndarray  # (C,) int64
    even: tuple[_EvenGroup, ...]
    odd_w: np.ndarray  # (K_odd, 24) float64, W per odd class
    odd_shell: np.ndarray
    odd_id: np.ndarray
    # per shell m (index m), the largest even / odd magnitude in the ball up to m and on shell m alone
    max_mag_ball: np.ndarray  # (max_shell + 1, 2)
    max_mag_shell: np.ndarray  # (max_shell + 1, 2)
    words: np.ndarray  # (4096, 24) uint8
    weight: np.ndarray  # (4096,) int64
    words_aug: np.ndarray  # (30, 4096) float32: codewords transposed, a row of ones, one row per Golay weight
    even_weights_ball: np.ndarray  # (max_shell + 1, 5) bool: shells 2..m hold an even class of each weight
    even_weights_shell: np.ndarray  # (max_shell + 1, 5) bool: shell m holds an even class of each weight
    layout_mags: np.ndarray  # (C, 24) float64: even -> support desc + off desc; odd -> W
    class_weight: np.ndarray  # (C,) int64 Golay weight (odd: -1)
    class_parity: np.ndarray  # (C,) int64


@cache
def _tables(max_shell: int) -> _Tables:
    layout = index_layout(max_shell)
    classes = layout.classes
    even = []
    for w in _WEIGHTS:
        ids = [i for i, c in enumerate(classes) if c.coset == "even" and c.golay_weight == w]
        if not ids:
            continue
        cs = [classes[i] for i in ids]
        even.append(_EvenGroup(
            weight=w,
            mags=np.array([c.support_magnitudes + c.off_support_magnitudes for c in cs], dtype=np.float64),
            min_support=np.array([min(c.support_magnitudes, default=0) for c in cs], dtype=np.float64),
            parity=np.array([c.negative_parity for c in cs], dtype=np.int64),
            shell=np.array([c.shell for c in cs], dtype=np.int64),
            class_id=np.array(ids, dtype=np.int64),
        ))
    odd_ids = [i for i, c in enumerate(classes) if c.coset == "odd"]
    odd_w = np.array(
        [[a for a in classes[i].magnitudes if a % 4 == 1] + [-a for a in sorted(classes[i].magnitudes) if a % 4 == 3]
         for i in odd_ids], dtype=np.float64)
    # W is non-increasing (= 1 mod 4 magnitudes descending, then -b for the = 3 mod 4 ones b ascending), so
    # W . sort_desc(u) is the rearrangement maximum of the class for a fixed codeword.
    max_ball = np.zeros((max_shell + 1, 2), dtype=np.int64)
    max_shell_arr = np.zeros((max_shell + 1, 2), dtype=np.int64)
    for c in classes:
        j = 0 if c.coset == "even" else 1
        max_shell_arr[c.shell, j] = max(max_shell_arr[c.shell, j], c.magnitudes[0])
    for m in range(MIN_SHELL, max_shell + 1):
        max_ball[m] = np.maximum(max_ball[m - 1], max_shell_arr[m])
    words = codewords()
    wt = codeword_weights()
    aug = np.vstack([words.T.astype(np.float32), np.ones((1, words.shape[0]), dtype=np.float32)]
                    + [(wt == w).astype(np.float32)[None, :] for w in _WEIGHTS])
    has_w_shell = np.zeros((max_shell + 1, len(_WEIGHTS)), dtype=bool)
    for c in classes:
        if c.coset == "even":
            has_w_shell[c.shell, _WEIGHTS.index(c.golay_weight)] = True
    has_w_ball = np.logical_or.accumulate(has_w_shell, axis=0)
    layout_mags = np.zeros((len(classes), DIM), dtype=np.float64)
    for g in even:
        layout_mags[g.class_id] = g.mags
    layout_mags[odd_ids] = odd_w.reshape(len(odd_ids), DIM)
    return _Tables(
        max_shell=max_shell,
        all_mags=np.array([c.magnitudes for c in classes], dtype=np.float64),
        shell=np.array([c.shell for c in classes], dtype=np.int64),
        even=tuple(even),
        odd_w=odd_w.reshape(len(odd_ids), DIM),
        odd_shell=np.array([classes[i].shell for i in odd_ids], dtype=np.int64),
        odd_id=np.array(odd_ids, dtype=np.int64),
        max_mag_ball=max_ball,
        max_mag_shell=max_shell_arr,
        words=words,
        weight=codeword_weights(),
        words_aug=aug,
        even_weights_ball=has_w_ball,
        even_weights_shell=has_w_shell,
        layout_mags=layout_mags,
        class_weight=np.array([-1 if c.golay_weight is None else c.golay_weight for c in classes], dtype=np.int64),
        class_parity=np.array([c.negative_parity for c in classes], dtype=np.int64),
    )


# ---------------------------------------------------------------------------------------------------------
# Bounds: relaxed (separable) squared distance from z to the coordinatewise nearest residue-class values.

_RESIDUES = np.array([0, 2, 1, 3], dtype=np.float64)  # even coset: c_i = 0, 1; odd coset: c_i = 0, 1


def _residue_costs(z: np.ndarray, even_max: np.ndarray, odd_max: np.ndarray) -> np.ndarray:
    """(n, 24, 4) squared distance from z to the nearest x = r mod 4 with |x| <= the coset's largest magnitude."""
    top = np.stack([even_max, even_max, odd_max, odd_max], axis=-1).astype(np.float64)[:, None, :]
    hi = top - np.mod(top - _RESIDUES, 4)  # largest allowed value of the residue
    lo = -top + np.mod(_RESIDUES + top, 4)  # smallest allowed value of the residue
    zz = z[:, :, None]
    x = np.clip(_RESIDUES + 4 * np.round((zz - _RESIDUES) / 4), lo, hi)
    cost = (zz - x) ** 2
    return np.where(lo <= hi, cost, 1e6)  # a residue with no allowed value: effectively impossible


def _bounds(tab: _Tables, z: np.ndarray, even_max: np.ndarray, odd_max: np.ndarray, kappa: np.ndarray,
            s: np.ndarray, has_weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(n, 8192) float32 upper bounds kappa - s * relaxed distance, columns [even coset | odd coset] x codeword,
    and (n,) a margin that covers their float32 rounding.

    has_weight (n, 5) says which Golay weights have an even class in the relaxed set; codewords of the other
    weights get a hopeless bound. All of it is one matrix product against [codewords; ones; weight rows].
    """
    n = z.shape[0]
    cost = _residue_costs(z, even_max, odd_max)
    coef = np.zeros((n, 2, tab.words_aug.shape[0]), dtype=np.float32)
    coef[:, 0, :DIM] = -s[:, None] * (cost[:, :, 1] - cost[:, :, 0])
    coef[:, 0, DIM] = kappa - s * cost[:, :, 0].sum(axis=1)
    coef[:, 0, DIM + 1:] = np.where(has_weight, 0, _NO_POINT)
    coef[:, 1, :DIM] = -s[:, None] * (cost[:, :, 3] - cost[:, :, 2])
    coef[:, 1, DIM] = kappa - s * cost[:, :, 2].sum(axis=1)
    # each term and each of the <= 30 additions rounds by at most 2^-24 relative to the terms' magnitudes
    margin = _F32_MARGIN * np.abs(coef[:, :, : DIM + 1]).sum(axis=2).max(axis=1)
    return (coef.reshape(2 * n, -1) @ tab.words_aug).reshape(n, -1), margin


# ---------------------------------------------------------------------------------------------------------
# Exact evaluation of (block, codeword) pairs over every class of the coset.


@dataclass(frozen=True)
class _Prepared:
    z: np.ndarray  # (n, 24) float64 targets in lattice units
    order: np.ndarray  # (n, 24) coordinates by |z| descending (stable)
    v: np.ndarray  # (n, 24) |z| in that order
    neg: np.ndarray  # (n, 24) bool, z < 0 in that order


def _prepare(z: np.ndarray) -> _Prepared:
    order = np.argsort(-np.abs(z), axis=1, kind="stable")
    zs = np.take_along_axis(z, order, axis=1)
    return _Prepared(z=z, order=order, v=np.abs(zs), neg=zs < 0)


def _class_objective(shell: np.ndarray, mode: Mode) -> tuple[np.ndarray, np.ndarray]:
    """objective = <z, x> * p - q per class: direction <z,x>/||x||, nearest 2<z,x> - ||x||^2 (= |z|^2 - dist)."""
    if mode == "direction":
        return 1.0 / (4.0 * np.sqrt(shell)), np.zeros(shell.shape)
    return np.full(shell.shape, 2.0), 16.0 * shell


def _even_values(prep: _Prepared, blk: np.ndarray, words: np.ndarray, g: _EvenGroup) -> np.ndarray:
    """(pairs, classes of g) max <z, x> over the points of each class of g on the pair's codeword.

    words (pairs, 24) are the codewords (all of weight g.weight) in each block's |z|-descending frame.
    """
    # support coordinates first, then the rest, each still by |z| descending: a sorted matching
    x = np.take_along_axis(prep.v[blk], np.argsort(1 - words.astype(np.int8), axis=1, kind="stable"), axis=1)
    vals = x @ g.mags.T
    if g.weight:
        negatives = (words.astype(bool) & prep.neg[blk]).sum(axis=1) & 1
        wrong = negatives[:, None] != g.parity[None, :]
        vals -= wrong * (2.0 * g.min_support)[None, :] * x[:, g.weight - 1][:, None]
    return vals


def _odd_values(tab: _Tables, prep: _Prepared, blk: np.ndarray, cw: np.ndarray) -> np.ndarray:
    """(pairs, odd classes) max <z, x> over the points of each odd class on the pair's codeword."""
    u, _ = _odd_u(tab, prep, blk, cw)
    return np.sort(u, axis=1)[:, ::-1] @ tab.odd_w.T


def _eval_even(tab: _Tables, prep: _Prepared, blk: np.ndarray, cw: np.ndarray, mode: Mode
               ) -> tuple[np.ndarray, np.ndarray]:
    """Best objective and class id for each even-coset pair (block blk[k], codeword cw[k])."""
    obj = np.full(blk.size, -np.inf)
    cls = np.full(blk.size, -1, dtype=np.int64)
    words = tab.words[cw[:, None], prep.order[blk]]  # codewords in each block's |z|-descending frame
    wts = tab.weight[cw]
    for g in tab.even:
        sel = np.flatnonzero(wts == g.weight)
        if sel.size == 0:
            continue
        p, q = _class_objective(g.shell, mode)
        o = _even_values(prep, blk[sel], words[sel], g) * p - q
        j = np.argmax(o, axis=1)
        obj[sel] = o[np.arange(sel.size), j]
        cls[sel] = g.class_id[j]
    return obj, cls


def _odd_u(tab: _Tables, prep: _Prepared, blk: np.ndarray, cw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """u = z_i (1 - 2 c_i) in the sorted frame, and the codewords in that frame."""
    words = tab.words[cw[:, None], prep.order[blk]]
    flip = words.astype(bool) ^ prep.neg[blk]
    return np.where(flip, -prep.v[blk], prep.v[blk]), words


def _eval_odd(tab: _Tables, prep: _Prepared, blk: np.ndarray, cw: np.ndarray, mode: Mode
              ) -> tuple[np.ndarray, np.ndarray]:
    """Best objective and class id for each odd-coset pair."""
    if tab.odd_id.size == 0:
        return np.full(blk.size, -np.inf), np.full(blk.size, -1, dtype=np.int64)
    p, q = _class_objective(tab.odd_shell, mode)
    o = _odd_values(tab, prep, blk, cw) * p - q
    j = np.argmax(o, axis=1)
    return o[np.arange(blk.size), j], tab.odd_id[j]


def best_in_class(targets: np.ndarray, max_shell: int, class_id: int, codeword: int) -> np.ndarray:
    """max <t, p> over the points p of class class_id of class_table(max_shell) that use Golay codeword
    `codeword` (an index into codewords()); -inf where the class does not use it. For checks and tools."""
    t = _check_targets(targets)
    tab = _check_max_shell(max_shell)
    if not 0 <= class_id < tab.shell.size or not 0 <= codeword < _N_WORDS:
        raise LeechArgumentError(f"class_id must be in [0, {tab.shell.size}) and codeword in [0, 4096)")
    prep = _prepare(t)
    blk = np.arange(t.shape[0])
    cw = np.full(t.shape[0], codeword)
    if tab.class_weight[class_id] < 0:
        j = int(np.flatnonzero(tab.odd_id == class_id)[0])
        return _odd_values(tab, prep, blk, cw)[:, j]
    g = next(g for g in tab.even if class_id in g.class_id)
    if tab.weight[codeword] != g.weight:
        return np.full(t.shape[0], -np.inf)
    j = int(np.flatnonzero(g.class_id == class_id)[0])
    return _even_values(prep, blk, tab.words[cw[:, None], prep.order], g)[:, j]


def _build_points(tab: _Tables, prep: _Prepared, cw: np.ndarray, cls: np.ndarray) -> np.ndarray:
    """The point of class cls[b] and codeword cw[b] that the exact evaluation chose for each block b."""
    n = cw.size
    mags = tab.layout_mags[cls]
    w = tab.class_weight[cls]
    x_sorted = np.zeros((n, DIM))
    odd = w < 0
    rows = np.flatnonzero(odd)
    if rows.size:
        u, words = _odd_u(tab, prep, rows, cw[rows])
        rank = np.argsort(-u, axis=1, kind="stable")
        signs = 1.0 - 2.0 * np.take_along_axis(words, rank, axis=1)
        # x_i = W[rank of u_i] (1 - 2 c_i): the residue 1 + 2 c_i mod 4 holds for either sign of W
        vals = np.zeros((rows.size, DIM))
        np.put_along_axis(vals, rank, mags[rows] * signs, axis=1)
        x_sorted[rows] = vals
    rows = np.flatnonzero(~odd)
    if rows.size:
        words = tab.words[cw[rows, None], prep.order[rows]]
        place = np.argsort(1 - words.astype(np.int8), axis=1, kind="stable")
        vals = np.zeros((rows.size, DIM))
        np.put_along_axis(vals, place, mags[rows], axis=1)
        neg = prep.neg[rows].copy()
        ws = w[rows]
        has = np.flatnonzero(ws > 0)
        if has.size:
            wrong = ((words[has].astype(bool) & neg[has]).sum(axis=1) & 1) != tab.class_parity[cls[rows[has]]]
            last = place[has, ws[has] - 1]  # support coordinate with the smallest |z|
            neg[has, last] ^= wrong
        x_sorted[rows] = np.where(neg, -vals, vals)
    x = np.zeros((n, DIM))
    np.put_along_axis(x, prep.order, x_sorted, axis=1)
    return np.rint(x).astype(np.int16)


def _evaluate(tab: _Tables, prep: _Prepared, blk: np.ndarray, col: np.ndarray, mode: Mode
              ) -> tuple[np.ndarray, np.ndarray]:
    """Exact best objective and class for pairs (block, bound column); chunked to keep temporaries small."""
    obj = np.empty(blk.size)
    cls = np.empty(blk.size, dtype=np.int64)
    odd = col >= _N_WORDS
    cw = col - _N_WORDS * odd
    for flag, evaluate in ((False, _eval_even), (True, _eval_odd)):
        sel = np.flatnonzero(odd == flag)
        for lo in range(0, sel.size, _PAIR_CHUNK):
            part = sel[lo : lo + _PAIR_CHUNK]
            obj[part], cls[part] = evaluate(tab, prep, blk[part], cw[part], mode)
    return obj, cls


def _branch_and_bound(tab: _Tables, prep: _Prepared, first: np.ndarray, first_margin: np.ndarray,
                      more_bounds: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]] | None,
                      mode: Mode) -> tuple[np.ndarray, np.ndarray]:
    """Best (codeword, class) per block.

    first (n, 8192): bounds whose best columns seed the incumbent (the more seeds, the tighter the pruning
    that follows). more_bounds(incumbent) returns (bounds, margin) that prune, valid for the whole ball; None
    means `first` (with first_margin) is such a bound itself (it is then overwritten). Every column whose
    bound reaches the incumbent, less the rounding margin, is then evaluated exactly.
    """
    n = first.shape[0]
    rows = np.arange(n)
    seeds = np.empty((n, _SEEDS), dtype=np.int64)
    masked = first if more_bounds is None else first.copy()
    for j in range(_SEEDS):  # repeated argmax: cheaper than argpartition for a handful of columns
        seeds[:, j] = np.argmax(masked, axis=1)
        masked[rows, seeds[:, j]] = -np.inf
    blk = np.repeat(rows, _SEEDS)
    obj, cls = _evaluate(tab, prep, blk, seeds.ravel(), mode)
    pick = np.argmax(obj.reshape(n, _SEEDS), axis=1)
    best = obj.reshape(n, _SEEDS)[rows, pick]
    best_col = seeds[rows, pick]
    best_cls = cls.reshape(n, _SEEDS)[rows, pick]
    if more_bounds is None:
        bounds, margin = masked, first_margin  # the seeds are already masked out
    else:
        bounds, margin = more_bounds(best)
        bounds[blk, seeds.ravel()] = -np.inf  # already evaluated exactly
    threshold = best - margin
    active = np.flatnonzero(bounds.max(axis=1) >= threshold)  # most blocks are done after the seeds
    blk, col = np.nonzero(bounds[active] >= threshold[active, None])
    blk = active[blk]
    if blk.size:
        obj, cls = _evaluate(tab, prep, blk, col, mode)
        # best pair per block: sort by (block, -objective) and keep each block's first
        order = np.lexsort((-obj, blk))
        blk, obj, cls, col = blk[order], obj[order], cls[order], col[order]
        head = np.flatnonzero(np.r_[True, blk[1:] != blk[:-1]])
        better = obj[head] > best[blk[head]]
        head = head[better]
        best[blk[head]] = obj[head]
        best_col[blk[head]] = col[head]
        best_cls[blk[head]] = cls[head]
    return best_col % _N_WORDS, best_cls


# ---------------------------------------------------------------------------------------------------------
# Public API.


def _check_targets(targets: np.ndarray) -> np.ndarray:
    t = np.asarray(targets)
    if t.ndim == 1:
        t = t[None, :]
    if t.ndim != 2 or t.shape[1] != DIM:
        raise LeechArgumentError(f"targets must have shape (n, 24), got {np.shape(targets)}")
    if not (np.issubdtype(t.dtype, np.floating) or np.issubdtype(t.dtype, np.integer)):
        raise LeechArgumentError(f"targets must be real numbers, got dtype {t.dtype}")
    t = t.astype(np.float64)
    if not np.isfinite(t).all():
        raise LeechArgumentError("targets must be finite (no NaN or inf)")
    return t


def _check_max_shell(max_shell: int) -> _Tables:
    if isinstance(max_shell, bool) or not isinstance(max_shell, (int, np.integer)):
        raise LeechArgumentError(f"max_shell must be an int, got {max_shell!r}")
    return _tables(int(max_shell))


def nearest_point(targets: np.ndarray, scale: float | np.ndarray, max_shell: int) -> SearchResult:
    """For each target t (n, 24), the ball point p (shells 2..max_shell) minimising ||t - scale * p||.

    scale is one positive number or one per target. Exact: every class is searched exactly, and a codeword is
    skipped only when a lower bound on its distance exceeds a distance already reached.
    """
    t = _check_targets(targets)
    tab = _check_max_shell(max_shell)
    try:
        alpha = np.asarray(scale, dtype=np.float64)
    except (TypeError, ValueError):
        raise LeechArgumentError(f"scale must be a positive number or an array of them, got {scale!r}") from None
    if alpha.ndim == 0:
        alpha = np.full(t.shape[0], float(alpha))
    elif alpha.shape != (t.shape[0],):
        raise LeechArgumentError(f"scale must be a number or have shape ({t.shape[0]},), got {alpha.shape}")
    if not (np.isfinite(alpha).all() and (alpha > 0).all()):
        raise LeechArgumentError("scale must be finite and positive")
    points = _search_nonzero(t, lambda rows: _nearest_chunk(tab, t[rows] / alpha[rows, None]), tab)
    diff = t - alpha[:, None] * points
    return SearchResult(point_to_index(points, tab.max_shell), points, (diff * diff).sum(axis=1))


def _search_nonzero(t: np.ndarray, search, tab: _Tables) -> np.ndarray:
    """Run search(rows) over chunks of the nonzero targets; a zero target gets the point of index 0.

    For a zero target every shell-2 point is nearest (and every direction as good): the search would have to
    prove a many-way tie, so the answer is fixed instead.
    """
    points = np.empty((t.shape[0], DIM), dtype=np.int16)
    zero = ~t.any(axis=1)
    points[zero] = index_to_point(np.zeros(1, dtype=np.uint64), tab.max_shell)[0]
    live = np.flatnonzero(~zero)
    for lo in range(0, live.size, _CHUNK):
        rows = live[lo : lo + _CHUNK]
        points[rows] = search(rows)
    return points


def _nearest_chunk(tab: _Tables, y: np.ndarray) -> np.ndarray:
    prep = _prepare(y)
    m = tab.max_shell
    n = y.shape[0]
    yy = (y * y).sum(axis=1)
    # Lagrangian for the ball 32 <= ||x||^2 <= 16 m: for every f > 0 and every ball point x,
    #   |y - x|^2 = f |x - y/f|^2 + |y|^2 (1 - 1/f) + (1 - f) |x|^2 >= f |x - y/f|^2 + |y|^2 (1 - 1/f) + (1 - f) r
    # with r = 16 m when f >= 1 and r = 32 when f < 1. f rescales y onto the ball's range of norms.
    f = np.maximum(np.sqrt(yy / np.clip(yy, 32.0, 16.0 * m)), 1e-3)
    r = np.where(f >= 1.0, 16.0 * m, 32.0)
    even_max = np.full(n, tab.max_mag_ball[m, 0])
    odd_max = np.full(n, tab.max_mag_ball[m, 1])
    has_w = np.broadcast_to(tab.even_weights_ball[m], (n, len(_WEIGHTS)))
    bounds, margin = _bounds(tab, y / f[:, None], even_max, odd_max, yy / f + (f - 1.0) * r, f, has_w)
    cw, cls = _branch_and_bound(tab, prep, bounds, margin, None, "nearest")
    return _build_points(tab, prep, cw, cls)


def nearest_direction(targets: np.ndarray, max_shell: int) -> SearchResult:
    """For each target t (n, 24), the ball point p maximising <t, p> / ||p|| (the shape of a shape-gain code).

    The gain is the caller's: the best one for a returned p is <t, p> / ||p||^2. A zero target gets the point
    of index 0 (every direction is as good; it is also a nearest point of a zero target in nearest_point).
    """
    t = _check_targets(targets)
    tab = _check_max_shell(max_shell)
    norms = np.sqrt((t * t).sum(axis=1))
    unit = np.where(norms[:, None] > 0, t / np.where(norms > 0, norms, 1.0)[:, None], 0.0)
    points = _search_nonzero(t, lambda rows: _direction_chunk(tab, unit[rows]), tab)
    pn = np.sqrt((points.astype(np.float64) ** 2).sum(axis=1))
    return SearchResult(point_to_index(points, tab.max_shell), points, (t * points).sum(axis=1) / pn)


def _direction_chunk(tab: _Tables, unit: np.ndarray) -> np.ndarray:
    n = unit.shape[0]
    prep = _prepare(unit)
    shells = np.arange(MIN_SHELL, tab.max_shell + 1)
    # Rearrangement bound per class (every sign and placement free), then the best per shell.
    ub = (prep.v @ tab.all_mags.T) / (4.0 * np.sqrt(tab.shell))[None, :]
    starts = np.searchsorted(tab.shell, shells)
    shell_ub = np.maximum.reduceat(ub, starts, axis=1)  # (n, S); every shell 2..max holds classes
    m0 = shells[np.argmax(shell_ub, axis=1)]

    def shell_bounds(rows: np.ndarray, m: np.ndarray) -> np.ndarray:
        # For x on shell m and any alpha > 0: <t,x> <= (|t|^2 + 16 m alpha^2 - |t - alpha x|^2) / (2 alpha);
        # with |t| = 1 and alpha = 1/(4 sqrt m) this is cos <= 1 - relaxed|y - x|^2 / (32 m), y = 4 sqrt(m) t.
        y = unit[rows] * (4.0 * np.sqrt(m))[:, None]
        return _bounds(tab, y, tab.max_mag_shell[m, 0], tab.max_mag_shell[m, 1], np.ones(rows.size),
                       1.0 / (32.0 * m), tab.even_weights_shell[m])

    first, first_margin = shell_bounds(np.arange(n), m0)

    def all_bounds(best: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        acc = np.full((n, 2 * _N_WORDS), -np.inf, dtype=np.float32)
        margin = np.zeros(n)
        for j, m in enumerate(shells):
            # ub is float64 and a true bound, so this test needs no margin beyond the exact values' own
            rows = np.flatnonzero(shell_ub[:, j] >= best - 1e-12)
            if 2 * rows.size > n:  # computing a few needless rows beats gathering and scattering
                b, e = shell_bounds(np.arange(n), np.full(n, m))
                np.maximum(acc, b, out=acc)
                np.maximum(margin, e, out=margin)
            elif rows.size:
                b, e = shell_bounds(rows, np.full(rows.size, m))
                acc[rows] = np.maximum(acc[rows], b)
                margin[rows] = np.maximum(margin[rows], e)
        return acc, margin

    cw, cls = _branch_and_bound(tab, prep, first, first_margin, all_bounds, "direction")
    return _build_points(tab, prep, cw, cls)
