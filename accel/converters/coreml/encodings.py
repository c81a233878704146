"""Weight encodings for Core ML packages: fp16, int8 blockwise shift-scale, 2/4-bit per-group LUTs, ternary.

An encoding turns a float weight matrix (rows = output channels, cols = input channels) into the arrays of one
Core ML constexpr op (`constexpr_blockwise_shift_scale` or `constexpr_lut_to_dense`, iOS 18) or a plain fp16
const. `decode` is the NumPy reference for what Core ML reconstructs; `from_codes` reuses the integer codes of an
accel OUT_DIR tensor instead of re-quantizing its float decode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from accel.errors import AccelError

LUT_ROW_GROUP = 16      # output channels that share one LUT (per-grouped-channel palettization)
INT8_MAX_BLOCK = 256    # int8 scales: one per output channel and block of at most this many input channels
KMEANS_ITERATIONS = 16


@dataclass
class EncodedWeight:
    """One weight as the inputs of one MIL op.

    kind "const": values (fp16). kind "shift_scale": data (int8/uint8/uint4 codes), scale (fp16), optional
    offset (fp16): w = scale * (data - offset), scale/offset repeated over blocks. kind "lut": indices (uint codes
    of `bits`), lut (fp16, (row_groups, col_groups, 2**bits)): w = lut[row // rows_per_lut, col // cols_per_lut,
    index]. All arrays are 2-D (rows, cols) views; `as_mil_shapes` adds the trailing axes of a conv weight.
    """

    kind: str
    shape: tuple[int, int]
    arrays: dict[str, np.ndarray]
    bits: int
    source: str = "float"   # "float": encoded from float weights; "codes": reused an OUT_DIR's codes
    notes: dict[str, object] = field(default_factory=dict)

    def decode(self) -> np.ndarray:
        """The weight Core ML reconstructs, float32 (fp16 values widened exactly)."""
        return decode_arrays(self.kind, self.arrays, self.shape)

    @property
    def storage_bytes(self) -> int:
        """Bytes in the package's weight file: sub-byte codes packed, side data at its dtype."""
        total = 0
        for name, a in self.arrays.items():
            bits = self.bits if name in ("data", "indices") else a.dtype.itemsize * 8
            total += math.ceil(a.size * bits / 8)
        return total


def decode_arrays(kind: str, arrays: dict[str, np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    """Reference decompression (MIL semantics) on arrays of any rank; used by the interpreter too."""
    if kind == "const":
        return arrays["values"].astype(np.float32)
    if kind == "shift_scale":
        # In fp16 arithmetic, one rounding per step, as the MIL op is specified (codes up to 255 are exact).
        data = arrays["data"].astype(np.float16)
        if "offset" in arrays:
            data = data - _repeat_to(arrays["offset"].astype(np.float16), data.shape)
        return (_repeat_to(arrays["scale"].astype(np.float16), data.shape) * data).astype(np.float32)
    if kind == "lut":
        indices = arrays["indices"]
        table = arrays["lut"][..., 0]  # (*blocks, palette): block b of axis i covers shape[i] / blocks[i] entries
        palette = table.shape[-1]
        flat_block = np.zeros((1,) * indices.ndim, dtype=np.int64)
        stride = 1
        for axis in reversed(range(indices.ndim)):
            size, blocks = indices.shape[axis], table.shape[axis]
            along = (np.arange(size) // (size // blocks)).reshape([-1 if a == axis else 1 for a in range(indices.ndim)])
            flat_block = flat_block + along * stride
            stride *= blocks
        flat = table.reshape(-1, palette).astype(np.float32)
        return flat[flat_block, indices.astype(np.int64)]
    raise ValueError(f"unknown encoded kind {kind!r}")


def _repeat_to(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    for axis in range(len(shape)):
        if a.shape[axis] != shape[axis]:
            a = np.repeat(a, shape[axis] // a.shape[axis], axis=axis)
    return a


class Encoding:
    """Base class; subclasses register under `name` with their nominal width in bits per weight."""

    registry: ClassVar[dict[str, Encoding]] = {}
    name: str
    bits: int
    levels: int

    def __init_subclass__(cls, name: str | None = None, bits: int = 0, levels: int = 0, **kw):
        super().__init_subclass__(**kw)
        if name is not None:  # abstract helpers register nothing
            cls.name, cls.bits, cls.levels = name, bits, levels
            Encoding.registry[name] = cls()

    def encode(self, w: np.ndarray) -> EncodedWeight:
        raise NotImplementedError

    def from_codes(self, codec: str, params: dict, codes: np.ndarray, side: dict[str, np.ndarray],
                   shape: tuple[int, int]) -> EncodedWeight | None:
        """Reuse integer codes (accel `affine` or `lut` codecs) when they fit this encoding; else None."""
        return None

    def predicted_bytes(self, rows: int, cols: int) -> int:
        """Storage bytes of a (rows, cols) weight under this encoding, side data included."""
        raise NotImplementedError


def get_encoding(name: str) -> Encoding:
    try:
        return Encoding.registry[name]
    except KeyError:
        known = ", ".join(Encoding.registry)
        raise AccelError(f"unknown encoding {name!r} (choose from {known})") from None


def encoding_names() -> list[str]:
    return list(Encoding.registry)


def lut_row_group(rows: int) -> int:
    return math.gcd(rows, LUT_ROW_GROUP)


def int8_block(cols: int) -> int:
    """The largest divisor of `cols` not above INT8_MAX_BLOCK (scales must tile the input axis exactly)."""
    return max(d for d in range(1, min(cols, INT8_MAX_BLOCK) + 1) if cols % d == 0)


class Fp16(Encoding, name="fp16", bits=16, levels=0):
    def encode(self, w):
        return EncodedWeight("const", w.shape, {"values": _fp16(w)}, bits=16)

    def predicted_bytes(self, rows, cols):
        return 2 * rows * cols


class Int8(Encoding, name="int8", bits=8, levels=256):
    """Symmetric int8, one fp16 scale per output channel and block of input channels."""

    def encode(self, w):
        rows, cols = w.shape
        block = int8_block(cols)
        g = w.astype(np.float64).reshape(rows, cols // block, block)
        scale = _fp16(np.abs(g).max(axis=2) / 127.0)
        s = scale.astype(np.float64)[..., None]
        data = np.clip(np.rint(np.divide(g, s, out=np.zeros_like(g), where=s > 0)), -127, 127)
        return EncodedWeight("shift_scale", (rows, cols), {"data": data.astype(np.int8).reshape(rows, cols),
                                                           "scale": scale}, bits=8, notes={"block": block})

    def from_codes(self, codec, params, codes, side, shape):
        return _affine_shift_scale(codec, params, codes, side, shape, bits=8) if _fits(codec, params, 256) else None

    def predicted_bytes(self, rows, cols):
        return rows * cols + 2 * rows * (cols // int8_block(cols))


class _Lut(Encoding):
    """Per-grouped-channel LUT: LUT_ROW_GROUP output channels share 2**bits fp16 entries, fitted by k-means."""

    def encode(self, w):
        rows, cols = w.shape
        group = lut_row_group(rows)
        values = w.astype(np.float32).reshape(rows // group, group * cols)
        palettes, indices = kmeans_rows(values, 1 << self.bits)
        return EncodedWeight("lut", (rows, cols), {"indices": indices.reshape(rows, cols).astype(np.uint8),
                                                   "lut": palettes[:, None, :, None]}, bits=self.bits,
                             notes={"row_group": group})

    def from_codes(self, codec, params, codes, side, shape):
        if not _fits(codec, params, self.levels):
            return None
        if self.bits >= 4 and codec == "affine":
            return _affine_shift_scale(codec, params, codes, side, shape, bits=self.bits)
        return _codes_as_lut(codec, params, codes, side, shape, self.bits)

    def predicted_bytes(self, rows, cols):
        return math.ceil(rows * cols * self.bits / 8) + 2 * (rows // lut_row_group(rows)) * (1 << self.bits)


class Lut4(_Lut, name="lut4", bits=4, levels=16):
    pass


class Lut2(_Lut, name="lut2", bits=2, levels=4):
    pass


class Ternary(_Lut, name="ternary", bits=2, levels=3):
    """{-a, 0, +a} per group of output channels, stored as a 2-bit LUT [-a, 0, a, 0] (TWN threshold 0.7 mean|w|)."""

    def encode(self, w):
        rows, cols = w.shape
        group = lut_row_group(rows)
        g = w.astype(np.float64).reshape(rows // group, group * cols)
        mag = np.abs(g)
        delta = 0.7 * mag.mean(axis=1, keepdims=True)
        big = mag > delta
        count = np.maximum(big.sum(axis=1, keepdims=True), 1)
        a = _fp16((mag * big).sum(axis=1, keepdims=True) / count)
        codes = np.where(big, np.where(g > 0, 2, 0), 1).astype(np.uint8)
        lut = np.concatenate([-a, np.zeros_like(a), a, np.zeros_like(a)], axis=1)
        return EncodedWeight("lut", (rows, cols), {"indices": codes.reshape(rows, cols),
                                                   "lut": lut[:, None, :, None]}, bits=2,
                             notes={"row_group": group})


def _fp16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float64).astype(np.float16)


def _fits(codec: str, params: dict, levels: int) -> bool:
    return codec in ("affine", "lut") and int(params.get("levels", 1 << 30)) <= levels


def _affine_groups(params: dict, shape: tuple[int, int]) -> int:
    group = int(params["group"])
    if shape[1] % group:
        raise _NotExact(f"group {group} does not tile {shape[1]} input channels")
    return group


class _NotExact(Exception):
    """Codes that no constexpr op represents exactly: the caller falls back to the float path."""


def _affine_shift_scale(codec, params, codes, side, shape, bits):
    """affine codes q with x = q*scale + offset  ->  scale * (q - offset'), offset' = -offset/scale (fp16)."""
    if codec != "affine":
        return None
    try:
        group = _affine_groups(params, shape)
    except _NotExact:
        return None
    rows, cols = shape
    scale = side["scale"].astype(np.float64).reshape(rows, cols // group)
    q = codes.reshape(rows, cols)
    if params["symmetric"]:
        offset = np.full_like(scale, (int(params["levels"]) - 1) / 2.0)
    else:
        low = side["offset"].astype(np.float64).reshape(rows, cols // group)
        zero = scale == 0
        # A constant group was coded as q = 0 with scale 0: write it as scale' = low, offset' = -1.
        offset = np.where(zero, -1.0, -np.divide(low, scale, out=np.zeros_like(low), where=~zero))
        scale = np.where(zero, low, scale)
    if np.abs(scale).max(initial=0) >= 65504 or np.abs(offset).max(initial=0) >= 65504:
        return None
    data = q.astype(np.uint8)
    return EncodedWeight("shift_scale", shape, {"data": data, "scale": _fp16(scale), "offset": _fp16(offset)},
                         bits=bits, source="codes", notes={"block": group})


def _codes_as_lut(codec, params, codes, side, shape, bits):
    """Per (output channel, group) LUTs holding the codec's own levels exactly (rounded to fp16)."""
    try:
        group = _affine_groups(params, shape)
    except _NotExact:
        return None
    rows, cols = shape
    levels = int(params["levels"])
    k = np.arange(1 << bits, dtype=np.float64)
    if codec == "affine":
        scale = side["scale"].astype(np.float64).reshape(rows, cols // group, 1)
        if params["symmetric"]:
            table = (k - (levels - 1) / 2.0) * scale
        else:
            table = side["offset"].astype(np.float64).reshape(rows, cols // group, 1) + k * scale
    else:  # lut codec: palette (rows, groups, levels)
        palette = side["palette"].astype(np.float64).reshape(rows, cols // group, levels)
        table = np.concatenate([palette, np.repeat(palette[..., -1:], (1 << bits) - levels, axis=2)], axis=2)
    table = np.where(k < levels, table, table[..., :1])
    return EncodedWeight("lut", shape, {"indices": codes.reshape(rows, cols).astype(np.uint8),
                                        "lut": _fp16(table)[..., None]}, bits=bits, source="codes",
                         notes={"col_group": group})


def kmeans_rows(values: np.ndarray, k: int, iterations: int = KMEANS_ITERATIONS) -> tuple[np.ndarray, np.ndarray]:
    """1-D k-means per row of `values` (n_rows, n): fp16 palettes (n_rows, k), sorted, and uint8 codes.

    Lloyd's iterations run on the sorted row with prefix sums, so each costs O(k log n) per row; the start is the
    (i + 0.5)/k quantiles. Codes are the nearest fp16 palette entry.
    """
    n_rows, n = values.shape
    order = np.sort(values.astype(np.float64), axis=1)
    prefix = np.concatenate([np.zeros((n_rows, 1)), np.cumsum(order, axis=1)], axis=1)
    centers = np.quantile(order, (np.arange(k) + 0.5) / k, axis=1).T  # (n_rows, k)
    rows = np.arange(n_rows)[:, None]
    for _ in range(iterations):
        mids = (centers[:, 1:] + centers[:, :-1]) / 2
        cut = _searchsorted_rows(order, mids)                                   # (n_rows, k-1)
        bounds = np.concatenate([np.zeros((n_rows, 1), np.int64), cut, np.full((n_rows, 1), n)], axis=1)
        counts = np.diff(bounds, axis=1)
        sums = prefix[rows, bounds[:, 1:]] - prefix[rows, bounds[:, :-1]]
        centers = np.where(counts > 0, sums / np.maximum(counts, 1), centers)
        centers = np.sort(centers, axis=1)
    palettes = np.sort(_fp16(centers), axis=1)
    mids = (palettes[:, 1:].astype(np.float64) + palettes[:, :-1]) / 2
    codes = _searchsorted_rows(values.astype(np.float64), mids, side="left", unsorted=True)
    return palettes, codes.astype(np.uint8)


def _searchsorted_rows(data: np.ndarray, points: np.ndarray, side: str = "left",
                       unsorted: bool = False) -> np.ndarray:
    """Per row: with sorted `data`, the insertion index of each point; with `unsorted`, how many points lie
    below each data value (the bucket index of each value among sorted points)."""
    if unsorted:
        out = np.zeros(data.shape, dtype=np.int64)
        for j in range(points.shape[1]):
            out += data > points[:, j:j + 1]
        return out
    return np.stack([np.searchsorted(d, p, side=side) for d, p in zip(data, points, strict=True)])
