"""The codec registry: one small class per codec, pure array-in/array-out encode and decode, size accounting.

A codec turns a float tensor into integer codes (stored through a layout) plus side arrays (scales, palettes, ...).
Codec parameters are JSON values kept in the container document.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from accel.errors import FormatError
from accel.formats import dtypes
from accel.memory import row_passes


@dataclass
class Encoded:
    """What a codec produced for one tensor."""

    params: dict[str, Any]
    codes: np.ndarray | dict[str, np.ndarray] | None = None  # flat integer codes; a dict for several streams
    side: dict[str, np.ndarray] = field(default_factory=dict)  # side arrays, already in their stored dtype


@dataclass(frozen=True)
class SidePart:
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name


class Codec:
    """Base class; subclasses register themselves under `name`."""

    name: ClassVar[str]
    registry: ClassVar[dict[str, Codec]] = {}

    def __init_subclass__(cls, name: str, **kw):
        super().__init_subclass__(**kw)
        cls.name = name
        Codec.registry[name] = cls()

    def encode(self, x: np.ndarray, **params) -> Encoded:
        raise NotImplementedError

    def decode(self, codes: np.ndarray | None, side: dict[str, np.ndarray], params: dict, shape: tuple) -> np.ndarray:
        raise NotImplementedError

    def levels(self, params: dict) -> int:
        """Number of code levels; 0 when the codec stores no codes."""
        return 0

    def code_count(self, params: dict, shape: tuple[int, ...]) -> int:
        return math.prod(shape)

    def streams(self, params: dict, shape: tuple[int, ...]) -> dict[str, tuple[int, int]]:
        """Code streams as part name -> (levels, count). One stream, `codes`, unless a codec has several;
        a codec with several receives its codes in decode() as a dict keyed by part name."""
        levels = self.levels(params)
        return {"codes": (levels, self.code_count(params, shape))} if levels else {}

    def layout_for(self, name: str, stream: str, params: dict):
        """The layout object that stores one code stream; codecs with serving layouts of their own override this."""
        from accel.formats.layouts import get_layout

        return get_layout(name)

    def side_parts(self, params: dict, shape: tuple[int, ...]) -> dict[str, SidePart]:
        return {}

    def default_layout(self, params: dict) -> str:
        levels = self.levels(params)
        if levels == 0:
            return "dense"
        return "packed" if levels & (levels - 1) == 0 else "base"

    def check_params(self, params: dict, shape: tuple[int, ...]) -> None:
        """Raise FormatError when stored parameters are not ones this codec can have written."""


def get_codec(name: str) -> Codec:
    try:
        return Codec.registry[name]
    except KeyError:
        raise FormatError(f"unknown codec '{name}' (known: {', '.join(sorted(Codec.registry))})") from None


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise FormatError(message)


def _int_param(params: dict, key: str, lo: int, hi: int) -> int:
    value = params.get(key)
    _require(isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi,
             f"codec parameter {key}={value!r} is not an integer in [{lo}, {hi}]")
    return value


# Elements of a block of rows that the affine codec's float64 work runs on at a time (8 MiB a float64 temporary).
BLOCK_ELEMENTS = 1 << 20


def _row_blocks(rows: int, cols: int) -> list[slice]:
    """The affine codec's passes of rows (one empty pass for a tensor of no rows)."""
    return row_passes(rows, cols, BLOCK_ELEMENTS) or [slice(0, 0)]


def _rows(shape: tuple[int, ...]) -> tuple[int, int]:
    """A tensor is grouped along its last axis: (rows, columns)."""
    if len(shape) == 0:
        return 1, 1
    cols = shape[-1]
    return math.prod(shape[:-1]), cols


class RawCodec(Codec, name="raw"):
    """Floats stored as they are, in fp32, fp16 or bf16."""

    def encode(self, x, dtype: str = "float32"):
        if dtype not in dtypes.FLOAT_STORAGE:
            raise ValueError(f"raw codec dtype must be one of {sorted(dtypes.FLOAT_STORAGE)}, got {dtype!r}")
        return Encoded(params={"dtype": dtype}, side={"values": dtypes.to_storage(x, dtype)})

    def check_params(self, params, shape):
        dtype = params.get("dtype")
        _require(isinstance(dtype, str) and dtype in dtypes.FLOAT_STORAGE, f"raw codec dtype {dtype!r} is unknown")

    def side_parts(self, params, shape):
        return {"values": SidePart(tuple(shape), dtypes.FLOAT_STORAGE[params["dtype"]])}

    def decode(self, codes, side, params, shape):
        return dtypes.from_storage(side["values"], params["dtype"]).reshape(shape)


def grid_dtype(step: np.ndarray, top: int, offset: np.ndarray | None = None) -> str:
    """The stored dtype of an affine grid's scale (and offset): float16 unless its grid, rounded to float16, misses
    a group's range by more than half a step at either end, so that a code would land on the wrong value: a scale
    or offset past float16's range (overflow), a step so small that float16 holds it with few bits or not at all
    (a subnormal; weights around 1e-6 rounded their step to 0), an offset whose rounding error passes half a step
    (values of 60000 ± 2). `offset` None: a symmetric grid, (q - top/2)·step."""
    step = np.abs(np.asarray(step, dtype=np.float64))
    lo = np.zeros_like(step) if offset is None else np.asarray(offset, dtype=np.float64)
    if step.size == 0:
        return "float16"
    if not (np.all(step < 65000.0) and np.all(np.abs(lo) < 65000.0)):
        return "float32"
    span = top / 2.0 if offset is None else float(top)
    step16 = step.astype(np.float16).astype(np.float64)
    low_miss = np.abs(lo.astype(np.float16).astype(np.float64) - lo)
    high_miss = low_miss + span * np.abs(step16 - step)
    bad = (step > 0) & ((low_miss > step / 2) | (high_miss > step / 2))
    return "float32" if bad.any() else "float16"


class AffineCodec(Codec, name="affine"):
    """Uniform grid of L levels per group of the last axis: x = offset + q*scale, or (q-(L-1)/2)*scale if symmetric."""

    def levels(self, params):
        return params["levels"]

    def check_params(self, params, shape):
        _int_param(params, "levels", 2, 256)
        _int_param(params, "group", 1, 1 << 30)
        _require(isinstance(params.get("symmetric"), bool), "affine codec needs a boolean 'symmetric'")
        _require(params.get("scale_dtype") in ("float16", "float32"), "affine scale_dtype must be float16 or float32")

    def side_parts(self, params, shape):
        rows, cols = _rows(shape)
        groups = -(-cols // params["group"])
        part = SidePart((rows, groups), dtypes.FLOAT_STORAGE[params["scale_dtype"]])
        return {"scale": part} if params["symmetric"] else {"scale": part, "offset": part}

    @staticmethod
    def _grouped(x: np.ndarray, group: int) -> np.ndarray:
        """(rows, groups, group) float64 copy; a short last group is padded with its own last value."""
        rows, cols = _rows(np.shape(x))
        flat = np.asarray(x, dtype=np.float64).reshape(rows, cols)
        group = min(group, max(cols, 1))  # a group wider than a row is the row: no padding to its width
        groups = -(-cols // group)
        pad = groups * group - cols
        if pad:
            flat = np.concatenate([flat, np.repeat(flat[:, -1:], pad, axis=1)], axis=1)
        return flat.reshape(rows, groups, group)

    def encode(self, x, levels: int = 16, group: int = 64, symmetric: bool = False,
               scale: np.ndarray | None = None, offset: np.ndarray | None = None):
        """Codes on the grid fitted to each group, or on a given grid (stored-dtype `scale` and `offset` arrays).

        Rows are independent, so the float64 work runs on blocks of rows (`_row_blocks`): a few times a block's
        size in temporaries instead of 26 bytes a weight of the whole tensor (an 8B model's embedding table: 13 GB)."""
        if not 2 <= levels <= 256:
            raise ValueError(f"affine levels must be 2..256, got {levels}")
        if group < 1:
            raise ValueError(f"affine group must be positive, got {group}")
        rows, cols = _rows(np.shape(x))
        x2 = np.asarray(x).reshape(rows, cols)
        top = levels - 1
        blocks = _row_blocks(rows, cols)
        if scale is None:
            if symmetric:
                step = np.concatenate([np.abs(self._grouped(x2[b], group)).max(axis=2) for b in blocks]) / (top / 2.0)
                scale = dtypes.to_storage(step, grid_dtype(step, top))
            else:
                lows, highs = [], []
                for b in blocks:
                    g = self._grouped(x2[b], group)
                    lows.append(g.min(axis=2))
                    highs.append(g.max(axis=2))
                lo, hi = np.concatenate(lows), np.concatenate(highs)
                step = (hi - lo) / top
                if np.any((hi - lo) * (1 + 1e-6) > np.finfo(np.float32).max):
                    # decoding computes q·scale in float32 before it adds the offset: that product would be inf
                    raise ValueError("an affine group's values span more than float32's range (about 3.4e38): "
                                     "its decoded values would overflow")
                sdt = grid_dtype(step, top, lo)
                scale, offset = dtypes.to_storage(step, sdt), dtypes.to_storage(lo, sdt)
        sdt = "float16" if scale.dtype == np.float16 else "float32"
        s_all = dtypes.from_storage(scale, sdt).astype(np.float64)[..., None]
        o_all = None if symmetric else dtypes.from_storage(offset, sdt).astype(np.float64)[..., None]
        codes = np.empty((rows, cols), dtype=np.uint8)
        for b in blocks:
            g, s = self._grouped(x2[b], group), s_all[b]
            if symmetric:
                q = np.rint(np.divide(g, s, out=np.zeros_like(g), where=s > 0) + top / 2.0)
            else:
                q = np.rint(np.divide(g - o_all[b], s, out=np.zeros_like(g), where=s > 0))
            codes[b] = np.clip(q, 0, top).astype(np.uint8).reshape(len(g), g.shape[1] * g.shape[2])[:, :cols]
        side = {"scale": scale} if symmetric else {"scale": scale, "offset": offset}
        params = {"levels": levels, "group": group, "symmetric": symmetric, "scale_dtype": sdt}
        return Encoded(params=params, codes=codes.reshape(-1), side=side)

    def decode(self, codes, side, params, shape):
        rows, cols = _rows(shape)
        group, top = min(params["group"], max(cols, 1)), params["levels"] - 1
        groups = -(-cols // group)
        codes = np.asarray(codes).reshape(rows, cols)
        scale = dtypes.from_storage(side["scale"], params["scale_dtype"])[..., None]
        offset = None if params["symmetric"] else dtypes.from_storage(side["offset"], params["scale_dtype"])[..., None]
        out = np.empty((rows, cols), dtype=np.float32)
        for b in _row_blocks(rows, cols):
            q = np.zeros((b.stop - b.start, groups * group), dtype=np.float32)
            q[:, :cols] = codes[b]
            q = q.reshape(-1, groups, group)
            if params["symmetric"]:
                block = (q - np.float32(top / 2.0)) * scale[b]
            else:
                block = q * scale[b] + offset[b]
            out[b] = block.reshape(len(q), groups * group)[:, :cols]
        return out.reshape(shape)


class UintCodec(Codec, name="uint"):
    """Unsigned integers of 1..8 bits, stored losslessly (maps, masks, indices)."""

    def levels(self, params):
        return 1 << params["bits"]

    def check_params(self, params, shape):
        _int_param(params, "bits", 1, 8)

    def encode(self, x, bits: int = 8):
        if not 1 <= bits <= 8:
            raise ValueError(f"uint bits must be 1..8, got {bits}")
        x = np.asarray(x)
        if x.size and (x.dtype.kind not in "ui" or x.min() < 0 or int(x.max()) >= 1 << bits):
            raise ValueError(f"uint{bits} codec takes integers in [0, {1 << bits})")
        return Encoded(params={"bits": bits}, codes=x.reshape(-1).astype(np.uint8))

    def decode(self, codes, side, params, shape):
        return codes.astype(np.uint8).reshape(shape)


class LevelsCodec(Codec, name="levels"):
    """Integers in [0, L) for any L in 2..256, stored losslessly (base-L packed by default)."""

    def levels(self, params):
        return params["levels"]

    def check_params(self, params, shape):
        _int_param(params, "levels", 2, 256)

    def encode(self, x, levels: int = 3):
        if not 2 <= levels <= 256:
            raise ValueError(f"levels must be 2..256, got {levels}")
        x = np.asarray(x)
        if x.size and (x.dtype.kind not in "ui" or x.min() < 0 or int(x.max()) >= levels):
            raise ValueError(f"levels codec takes integers in [0, {levels})")
        return Encoded(params={"levels": levels}, codes=x.reshape(-1).astype(np.uint8))

    def decode(self, codes, side, params, shape):
        return codes.astype(np.uint8).reshape(shape)


class LutCodec(Codec, name="lut"):
    """Palette codes: per group of the last axis, L fp16 values found by 1-D k-means; codes index the palette."""

    def levels(self, params):
        return params["levels"]

    def check_params(self, params, shape):
        _int_param(params, "levels", 2, 256)
        _int_param(params, "group", 1, 1 << 30)

    def side_parts(self, params, shape):
        rows, cols = _rows(shape)
        groups = -(-cols // params["group"])
        return {"palette": SidePart((rows, groups, params["levels"]), "F16")}

    def encode(self, x, levels: int = 16, group: int = 64, iterations: int = 16):
        if not 2 <= levels <= 256:
            raise ValueError(f"lut levels must be 2..256, got {levels}")
        rows, cols = _rows(x.shape)
        grouped = AffineCodec._grouped(x, group)
        palettes, codes = [], []
        for start in range(0, rows, 128):  # row chunks bound the (rows, groups, group, levels) distance array
            p, c = self._kmeans(grouped[start : start + 128], levels, iterations)
            palettes.append(p)
            codes.append(c)
        palette16 = np.concatenate(palettes)
        codes = np.concatenate(codes).reshape(rows, -1)[:, :cols].reshape(-1)
        return Encoded(params={"levels": levels, "group": group}, codes=codes, side={"palette": palette16})

    @staticmethod
    def _kmeans(g: np.ndarray, levels: int, iterations: int) -> tuple[np.ndarray, np.ndarray]:
        # start from evenly spaced quantiles so the result is deterministic
        palette = np.quantile(g, (np.arange(levels) + 0.5) / levels, axis=2).transpose(1, 2, 0)
        for _ in range(iterations):
            assign = np.abs(g[..., :, None] - palette[..., None, :]).argmin(axis=-1)
            onehot = assign[..., None] == np.arange(levels)
            counts = onehot.sum(axis=2)
            sums = (onehot * g[..., None]).sum(axis=2)
            palette = np.where(counts > 0, sums / np.maximum(counts, 1), palette)
        palette16 = np.sort(palette, axis=-1).astype(np.float16)
        p = palette16.astype(np.float64)
        codes = np.abs(g[..., :, None] - p[..., None, :]).argmin(axis=-1).astype(np.uint8)
        return palette16, codes

    def decode(self, codes, side, params, shape):
        rows, cols = _rows(shape)
        group = min(params["group"], max(cols, 1))  # one group spans the row: no wider padding (as affine)
        groups = -(-cols // group)
        c = np.zeros((rows, groups * group), dtype=np.int64)
        c[:, :cols] = codes.reshape(rows, cols)
        c = c.reshape(rows, groups, group)
        palette = side["palette"].astype(np.float32)
        out = np.take_along_axis(palette, c, axis=2)
        return out.reshape(rows, -1)[:, :cols].reshape(shape)
