"""The `leech` codec: 24-weight blocks as Leech-lattice ball indices (one or two residual stages), plus its
serving layouts (bit planes, one-hot magnitude masks) that hold the lattice coordinates for shift-and-mask decode.

Decoding: point p = index_to_point(code), block = Σ_stage alpha_stage * p_stage, row r of the transformed weight is
scale[r] * blocks, and the weight is U^T (that) V cut to its logical columns (accel.quantize.incoherence).
"""

from __future__ import annotations

from functools import cache

import numpy as np

from accel.errors import FormatError
from accel.formats.codecs import Codec, Encoded, SidePart, _int_param, _require
from accel.formats.layouts import Layout, get_layout

BLOCK = 24
STREAM_NAMES = ("codes", "codes2")


def max_padding(cols: int) -> int:
    """The most zero columns a leech weight of `cols` logical columns may store: less than a block, or up to
    cols/32 (format version 2: the writer may pad further to a width whose transform is cheaper; docs/format.md
    §4.1). Also what bounds a hostile `cols`."""
    return max(BLOCK - 1, cols // 32)


def _lattice():
    from accel.quantize import (
        leech,  # the lattice math; imported on use so the format library loads without it
    )

    return leech


@cache
def ball_levels(max_shell: int) -> int:
    return int(_lattice().ball_index_size(max_shell))


@cache
def max_magnitude(max_shell: int) -> int:
    return max(max(c.magnitudes) for c in _lattice().class_table(max_shell))


class LeechCodec(Codec, name="leech"):
    """Params: `stages` [{"max_shell", "alpha"}], `cols` (padded width: whole blocks), `seed_in`, `seed_out`,
    `scale_dtype`. Parts: `codes` (and `codes2` for a second stage) and `scale` (rows,)."""

    def check_params(self, params, shape):
        stages = params.get("stages")
        _require(isinstance(stages, list) and 1 <= len(stages) <= len(STREAM_NAMES), "leech needs 1 or 2 stages")
        for stage in stages:
            _require(isinstance(stage, dict), "leech stage must be an object")
            _int_param(stage, "max_shell", 2, 13)
            _require(isinstance(stage.get("alpha"), float) and stage["alpha"] > 0, "leech stage alpha must be > 0")
        _require(len(shape) == 2, f"leech tensors are 2-D, got shape {list(shape)}")
        cols = _int_param(params, "cols", 1, 1 << 30)
        _require(cols % BLOCK == 0 and shape[1] <= cols <= shape[1] + max_padding(shape[1]),
                 f"leech padded width {cols} is not a multiple of {BLOCK} from {shape[1]} to "
                 f"{shape[1] + max_padding(shape[1])} columns")
        _int_param(params, "seed_in", 0, 2**32 - 1)
        _int_param(params, "seed_out", 0, 2**32 - 1)
        _require(params.get("scale_dtype") == "float16", "leech scale_dtype must be float16")

    def streams(self, params, shape):
        count = shape[0] * params["cols"] // BLOCK
        return {STREAM_NAMES[i]: (ball_levels(s["max_shell"]), count) for i, s in enumerate(params["stages"])}

    def side_parts(self, params, shape):
        return {"scale": SidePart((shape[0],), "F16")}

    def default_layout(self, params):
        return "packed"

    def layout_for(self, name, stream, params):
        stage = params["stages"][STREAM_NAMES.index(stream)]
        if name == "planes":
            return LeechPlanesLayout(stage["max_shell"])
        if name == "onehot":
            return LeechOneHotLayout(stage["max_shell"])
        if name in ("packed", "compact"):
            return get_layout(name)
        raise FormatError(f"layout '{name}' cannot hold leech codes (use compact, planes or onehot)")

    def encode(self, x, shells: tuple[int, ...] = (13,), seed_in: int = 0, seed_out: int = 1,
               hessian: np.ndarray | None = None):
        """Quantize a 2-D weight (see accel.quantize.leech_weights.quantize_leech)."""
        from accel.quantize.leech_weights import quantize_leech

        if np.ndim(x) != 2:
            raise ValueError(f"leech quantizes 2-D weights, got shape {list(np.shape(x))}")
        streams, scale16, params = quantize_leech(np.asarray(x, dtype=np.float64), tuple(shells), seed_in,
                                                  seed_out, hessian)
        return Encoded(params=params, codes=streams, side={"scale": scale16})

    def decode(self, codes, side, params, shape):
        return decode_leech(codes if isinstance(codes, dict) else {"codes": codes}, side["scale"], params,
                            shape).astype(np.float32)


def decode_leech(codes: dict[str, np.ndarray], scale: np.ndarray, params: dict, shape: tuple[int, ...]
                 ) -> np.ndarray:
    """Float64 decode of a leech tensor from its code streams (indices) and fp16 row scales."""
    from accel.quantize.incoherence import untransform_weight

    rows, cols = shape[0], params["cols"]
    blocks = np.zeros((rows * cols // BLOCK, BLOCK), dtype=np.float64)
    for name, stage in zip(STREAM_NAMES, params["stages"], strict=False):
        points = _lattice().index_to_point(np.asarray(codes[name], dtype=np.uint64), stage["max_shell"])
        blocks += stage["alpha"] * points
    transformed = blocks.reshape(rows, cols) * scale.astype(np.float64)[:, None]
    return untransform_weight(transformed, params["seed_out"], params["seed_in"])[:, : shape[1]]


def _plane_bits(max_shell: int) -> int:
    """Two's-complement bits of v = (x - parity) / 2 for |x| <= the ball's largest magnitude."""
    m = max_magnitude(max_shell)
    lo, hi = -((m + 1) // 2), m // 2
    bits = 1
    while not (-(1 << (bits - 1)) <= lo and hi <= (1 << (bits - 1)) - 1):
        bits += 1
    return bits


def _pack_flags(flags: np.ndarray) -> np.ndarray:
    return np.packbits(flags.astype(np.uint8).reshape(-1), bitorder="little")


def _unpack_flags(stored: np.ndarray, count: int) -> np.ndarray:
    return np.unpackbits(stored, count=count, bitorder="little")


def _unpack_parity(stored: np.ndarray, count: int, what: str) -> np.ndarray:
    """The parity plane that ends both serving layouts: one bit per block, then zero padding to a whole byte (the
    coordinate planes, 3 bytes a block, have none); non-zero padding is refused (docs/format.md §4.2, §5)."""
    tail = count % 8
    if tail and stored.size and int(stored[-1]) >> tail:
        raise FormatError(f"{what} have non-zero padding bits after the last block's parity bit")
    return _unpack_flags(stored, count).astype(np.int16)


class _LeechServing(Layout):
    """Base of the leech serving layouts: they store the coordinates of the decoded points."""

    name = "leech-serving"

    def __init__(self, max_shell: int = 13):
        self.max_shell = max_shell

    def supports(self, levels):
        return levels == ball_levels(self.max_shell)

    def _points(self, codes) -> np.ndarray:
        return _lattice().index_to_point(np.asarray(codes, dtype=np.uint64).reshape(-1), self.max_shell)

    def points(self, stored: np.ndarray, levels: int, count: int) -> np.ndarray:
        """The stored vectors (count, 24), the layout's own structure checked, not yet their ball membership."""
        raise NotImplementedError

    def check_ball(self, points: np.ndarray) -> None:
        """Refuse a vector that is not a point of shells 2 .. max_shell (the codec's ball)."""
        leech = _lattice()
        shells = leech.squared_norm(points) // leech.NORM_PER_SHELL  # a lattice point's norm is 16 m
        ok = leech.is_leech_point(points) & (shells >= 2) & (shells <= self.max_shell)
        if not ok.all():
            raise FormatError(f"serving layout holds a vector that is not a point of the ball (block {np.argmin(ok)})")

    def check(self, stored: np.ndarray, levels: int, count: int) -> None:
        """What unpack checks, without computing the indices (readers of the points themselves: the kernels)."""
        self.check_ball(self.points(stored, levels, count))

    def unpack(self, stored, levels, count):
        points = self.points(stored, levels, count)
        self.check_ball(points)
        return _lattice().point_to_index(points, self.max_shell)


class LeechPlanesLayout(_LeechServing):
    """Bit planes: v = (x - parity) / 2 in b-bit two's complement, plane j = bit j of every coordinate
    (3 bytes per block per plane), then one parity bit per block. x = 2 * v + parity."""

    def stored_shape(self, levels, count):
        return (_plane_bits(self.max_shell) * 3 * count + (count + 7) // 8,)

    def pack(self, codes, levels):
        x = self._points(codes).astype(np.int16)
        parity = x[:, 0] & 1
        v = (x - parity[:, None]) >> 1
        bits = _plane_bits(self.max_shell)
        u = (v & ((1 << bits) - 1)).astype(np.uint8).reshape(-1)
        planes = [_pack_flags((u >> j) & 1) for j in range(bits)]
        return np.concatenate(planes + [_pack_flags(parity)])

    def points(self, stored, levels, count):
        bits = _plane_bits(self.max_shell)
        plane = 3 * count
        if stored.shape != self.stored_shape(levels, count):
            raise FormatError(f"leech bit planes hold {stored.size} bytes, expected {self.stored_shape(levels, count)[0]}")
        u = np.zeros(count * BLOCK, dtype=np.int16)
        for j in range(bits):
            u |= _unpack_flags(stored[j * plane : (j + 1) * plane], count * BLOCK).astype(np.int16) << j
        v = np.where(u >= 1 << (bits - 1), u - (1 << bits), u).reshape(count, BLOCK)
        parity = _unpack_parity(stored[bits * plane :], count, "leech bit planes")
        return 2 * v + parity[:, None]


class LeechOneHotLayout(_LeechServing):
    """One-hot magnitude masks: |x| = 2k + parity; mask k (k = 1..K) marks the coordinates with that k (k = 0 has
    no mask), then a sign plane, each 3 bytes per block, then one parity bit per block."""

    def _levels(self) -> int:
        return max_magnitude(self.max_shell) // 2

    def stored_shape(self, levels, count):
        return ((self._levels() + 1) * 3 * count + (count + 7) // 8,)

    def pack(self, codes, levels):
        x = self._points(codes).astype(np.int16)
        parity = x[:, 0] & 1
        k = (np.abs(x) - parity[:, None]) >> 1
        masks = [_pack_flags(k == level) for level in range(1, self._levels() + 1)]
        return np.concatenate(masks + [_pack_flags(x < 0), _pack_flags(parity)])

    def points(self, stored, levels, count):
        if stored.shape != self.stored_shape(levels, count):
            raise FormatError(f"leech one-hot masks hold {stored.size} bytes, expected "
                              f"{self.stored_shape(levels, count)[0]}")
        plane = 3 * count
        n = count * BLOCK
        k = np.zeros(n, dtype=np.int16)
        hits = np.zeros(n, dtype=np.int16)
        for level in range(1, self._levels() + 1):
            bits = _unpack_flags(stored[(level - 1) * plane : level * plane], n).astype(np.int16)
            k += bits * level
            hits += bits
        if np.any(hits > 1):
            raise FormatError("leech one-hot masks set two magnitudes for one coordinate")
        sign = _unpack_flags(stored[self._levels() * plane : (self._levels() + 1) * plane], n).astype(bool)
        parity = _unpack_parity(stored[(self._levels() + 1) * plane :], count, "leech one-hot masks")
        x = (2 * k.reshape(count, BLOCK) + parity[:, None]) * np.where(sign.reshape(count, BLOCK), -1, 1)
        return x.astype(np.int16)

