"""A transformers cache that keeps GDN / KDA recurrent states in mixed precision between decode steps.

Each linear-attention layer's state [batch, heads, d_k, d_v] is stored per channel (a d_k row of d_v values) in
one of the row formats below; a scheme says which format each channel gets. The cache quantizes on store
(`update_recurrent_state`) and dequantizes on load (`get_recurrent_state`); between steps it holds only the
stored parts, whose bytes it counts (`state_bits_per_value` is measured from them, not computed).

Row formats (`fmt`):
- `fp32`, `fp16`, `bf16`: the values cast, no side data.
- `intK` (K = 2..16): symmetric round-to-nearest-even of x · (1 / scale) on 2^K - 1 levels with one float16
  scale per row (absmax / (2^(K-1) - 1)), codes packed K bits each in a little-endian bit stream (`int8` is one byte a value).
- `fp8`: float8 e4m3 with one float16 scale per row (absmax / 448).

Uniform baselines register as `--state` methods here (`fp32`, `fp16`, `bf16`, `fp8`, `int8`, `int4`, and
`int:K` for any K), so `accel eval MODEL --state int8` runs them in the same harness as a DAMP map.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from accel.errors import AccelError
from accel.formats.bitpack import pack_bits, unpack_bits
from accel.quantize.maps import MapMethod, Runtime, StoredMap
from accel.runtime.state_shapes import StateShape, state_shape

SCALE_DTYPE = torch.float16
_FLOATS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
FP8_MAX = 448.0


def check_format(fmt: str) -> str:
    if fmt in _FLOATS or fmt == "fp8":
        return fmt
    m = re.fullmatch(r"int(\d+)", fmt)
    if m and 2 <= int(m.group(1)) <= 16:
        return fmt
    raise AccelError(f"unknown state format {fmt!r} (fp32, fp16, bf16, fp8, int2..int16)")


def int_bits(fmt: str) -> int | None:
    return int(fmt[3:]) if fmt.startswith("int") else None


def row_bits(fmt: str, d_v: int) -> float:
    """Bits per value of a row in `fmt`, its scale counted (packing slack of a whole tensor is not: < 1 byte)."""
    if fmt in _FLOATS:
        return float(torch.finfo(_FLOATS[fmt]).bits)
    code = 8 if fmt == "fp8" else int_bits(fmt)
    return code + 16.0 / d_v


# ---- bit streams: the format library's (accel.formats.bitpack), on tensors ----

def pack_codes(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Non-negative integers < 2**width -> uint8 stream, value i at bits [i*width, (i+1)*width)."""
    flat = codes.reshape(-1)
    if width == 8:
        return flat.to(torch.uint8)
    if width == 4 and flat.numel() % 2 == 0:  # the same stream, two codes a byte, low nibble first
        pairs = flat.to(torch.uint8).reshape(-1, 2)
        return pairs[:, 0] | (pairs[:, 1] << 4)
    return torch.from_numpy(pack_bits(flat.to(torch.int64).numpy(), width))


def unpack_codes(stream: torch.Tensor, width: int, count: int) -> torch.Tensor:
    if width == 8:
        return stream.to(torch.int32)
    if width == 4 and count % 2 == 0 and stream.numel() * 2 == count:
        return torch.stack([stream & 15, stream >> 4], dim=1).reshape(-1).to(torch.int32)
    return torch.from_numpy(unpack_bits(stream.numpy(), width, count).astype(np.int32))


# ---- row encoders ----

def _scales(rows: torch.Tensor, qmax: float) -> torch.Tensor:
    absmax = rows.abs().amax(dim=-1)
    return torch.clamp(absmax / qmax, min=2.0**-24).to(SCALE_DTYPE)


def _int_codes(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(signed codes as float32, float16 scales) of INT-K rows."""
    qmax = float(2 ** (k - 1) - 1)
    scale = _scales(rows, qmax)
    return torch.clamp(torch.round(rows * (1.0 / scale.float())[:, None]), -qmax, qmax), scale


def int_round_trip(rows: torch.Tensor, k: int) -> torch.Tensor:
    """What INT-K storage gives back for rows [N, d_v] float32 (`quantize_rows` without packing the codes)."""
    q, scale = _int_codes(rows, k)
    return q * scale.float()[:, None]


@cache
def _c_rows() -> Any:
    """accel.kernels.state_update when its C library builds here, else None (INT-K rows then pack in numpy)."""
    from accel.kernels import state_update

    return state_update if state_update.available() else None


def _c_int(fmt: str, rows_or_n: torch.Tensor | int, d_v: int) -> Any:
    """The C row coder for an INT-K format it takes (K = 2..16 but 8, d_v * K whole bytes, finite rows), or None."""
    k = int_bits(fmt)
    if k is None or k == 8 or (d_v * k) % 8:
        return None
    if isinstance(rows_or_n, torch.Tensor) and not bool(torch.isfinite(rows_or_n).all()):
        return None
    return _c_rows()


def encode_rows(rows: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """rows [N, d_v] float32 -> stored parts."""
    c = _c_int(fmt, rows, rows.shape[-1])
    if c is not None:
        return c.encode_int_rows(rows, int_bits(fmt))
    return encode_rows_torch(rows, fmt)


def encode_rows_torch(rows: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """encode_rows in torch and numpy only (the definition the C row coder reproduces bit for bit)."""
    if fmt in _FLOATS:
        return {"values": rows.to(_FLOATS[fmt]).contiguous()}
    if fmt == "fp8":
        scale = _scales(rows, FP8_MAX)
        x = torch.clamp(rows * (1.0 / scale.float())[:, None], -FP8_MAX, FP8_MAX)
        return {"codes": x.to(torch.float8_e4m3fn).view(torch.uint8).contiguous(), "scales": scale}
    k = int_bits(fmt)
    q, scale = _int_codes(rows, k)
    if k == 8:
        return {"codes": q.to(torch.int8).contiguous(), "scales": scale}
    return {"codes": pack_codes(q.to(torch.int32) & ((1 << k) - 1), k), "scales": scale}  # K-bit two's complement


def decode_rows(parts: dict[str, torch.Tensor], fmt: str, n: int, d_v: int) -> torch.Tensor:
    c = _c_int(fmt, n, d_v)
    if c is not None:
        return c.decode_int_rows(parts, int_bits(fmt), n, d_v)
    return decode_rows_torch(parts, fmt, n, d_v)


def decode_rows_torch(parts: dict[str, torch.Tensor], fmt: str, n: int, d_v: int) -> torch.Tensor:
    """decode_rows in torch and numpy only."""
    if fmt in _FLOATS:
        return parts["values"].to(torch.float32)
    scale = parts["scales"].float()[:, None]
    if fmt == "fp8":
        return parts["codes"].view(torch.float8_e4m3fn).to(torch.float32) * scale
    k = int_bits(fmt)
    if k == 8:
        return parts["codes"].to(torch.float32) * scale
    field = unpack_codes(parts["codes"], k, n * d_v).reshape(n, d_v)
    q = field - ((field >> (k - 1)) << k)  # sign-extended from bit K - 1
    return q.to(torch.float32) * scale


def quantize_rows(rows: torch.Tensor, fmt: str) -> torch.Tensor:
    """Round trip through `fmt` (what a store then a load gives)."""
    return decode_rows(encode_rows(rows, fmt), fmt, rows.shape[0], rows.shape[1])


# ---- schemes: which format each channel gets ----

@dataclass
class StoredState:
    """One layer's state between steps: the stored parts of its high and low channel groups."""

    batch: int
    parts: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return int(sum(t.numel() * t.element_size() for t in self.parts.values()))


@dataclass
class StateScheme:
    """Which format each channel is stored in, per layer.

    Two ways to say it: `masks` (layer -> bool [heads * d_k], the channels stored in `high`; the rest in `low`),
    or `row_formats` (layer -> one format name per row, e.g. DAMP's water-filled int2..int16 allocation). A layer
    named in neither is stored wholly in `low`. Rows of one format in a layer are stored together, as one group.
    """

    shape: StateShape
    low: str
    high: str = "fp16"
    masks: dict[int, torch.Tensor] = field(default_factory=dict)  # layer index -> bool [heads * d_k]
    row_formats: dict[int, list[str]] = field(default_factory=dict)  # layer index -> [heads * d_k] format names

    def __post_init__(self) -> None:
        check_format(self.low)
        check_format(self.high)
        rows = self.shape.heads * self.shape.d_k
        self._groups: dict[int, list[tuple[str, str, torch.Tensor]]] = {}
        for layer, mask in self.masks.items():
            flat = torch.as_tensor(mask, dtype=torch.bool).reshape(-1)
            self._groups[layer] = [("high", self.high, torch.nonzero(flat).reshape(-1)),
                                   ("low", self.low, torch.nonzero(~flat).reshape(-1))]
        for layer, fmts in self.row_formats.items():
            if layer in self._groups:
                raise AccelError(f"layer {layer}: a state scheme takes a mask or row formats, not both")
            if len(fmts) != rows:
                raise AccelError(f"layer {layer}: {len(fmts)} row formats for {rows} rows")
            names = np.asarray([check_format(str(f)) for f in fmts])
            self._groups[layer] = [(fmt, fmt, torch.from_numpy(np.nonzero(names == fmt)[0]))
                                   for fmt in sorted(set(names.tolist()), key=lambda f: (row_bits(f, 1), f))]

    def groups(self, layer: int) -> list[tuple[str, str, torch.Tensor]]:
        """(tag, format, row indices into the layer's heads * d_k rows) of each stored group."""
        if layer not in self._groups:
            self._groups[layer] = [("low", self.low, torch.arange(self.shape.heads * self.shape.d_k))]
        return self._groups[layer]

    def split(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(high row indices, low row indices) of a two-tier scheme."""
        groups = {tag: idx for tag, _, idx in self.groups(layer)}
        if set(groups) - {"high", "low"}:
            raise AccelError(f"layer {layer}: the scheme stores more than two tiers")
        return groups.get("high", torch.zeros(0, dtype=torch.long)), groups.get("low", torch.zeros(0, dtype=torch.long))

    def store(self, layer: int, state: torch.Tensor) -> StoredState:
        b, h, dk, dv = state.shape
        if (h, dk, dv) != (self.shape.heads, self.shape.d_k, self.shape.d_v):
            raise AccelError(f"layer {layer}: state of {h}x{dk}x{dv}, the scheme is for "
                             f"{self.shape.heads}x{self.shape.d_k}x{self.shape.d_v}")
        rows = state.detach().to(torch.float32).reshape(b, h * dk, dv)
        parts = {}
        for tag, fmt, idx in self.groups(layer):
            if idx.numel():
                for key, t in encode_rows(rows[:, idx].reshape(-1, dv), fmt).items():
                    parts[f"{tag}.{key}"] = t
        return StoredState(b, parts)

    def load(self, layer: int, stored: StoredState) -> torch.Tensor:
        s = self.shape
        b = stored.batch
        rows = torch.empty(b, s.heads * s.d_k, s.d_v, dtype=torch.float32)
        for tag, fmt, idx in self.groups(layer):
            if idx.numel():
                group = tag + "."
                parts = {k[len(group):]: t for k, t in stored.parts.items() if k.startswith(group)}
                rows[:, idx] = decode_rows(parts, fmt, b * idx.numel(), s.d_v).reshape(b, idx.numel(), s.d_v)
        return rows.reshape(b, s.heads, s.d_k, s.d_v)

    def bits_per_value(self) -> float:
        """Expected bits per value at batch 1 (the cache measures the real figure)."""
        s = self.shape
        total = sum(idx.numel() * row_bits(fmt, s.d_v) for li in s.layers for _, fmt, idx in self.groups(li))
        return total / s.channels


class QuantizedStateCache(DynamicCache):
    """DynamicCache whose linear-attention recurrent states live in a `StateScheme`'s storage between steps."""

    def __init__(self, config: Any, scheme: StateScheme):
        super().__init__(config=config)
        self.scheme = scheme
        self.stored: dict[int, StoredState] = {}
        self.loads = 0
        self.stores = 0

    def _linear(self, layer_idx: int) -> LinearAttentionCacheLayerMixin:
        layer = self.layers[layer_idx]
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            raise TypeError(f"layer {layer_idx} ({type(layer).__name__}) keeps no recurrent state")
        return layer

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        layer = self._linear(layer_idx)
        if state_idx != 0:
            return super().get_recurrent_state(layer_idx, state_idx)
        if not layer.has_previous_state[0] or layer_idx not in self.stored:
            return None
        self.loads += 1
        return self.scheme.load(layer_idx, self.stored[layer_idx])

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs: Any) -> torch.Tensor:
        self._linear(layer_idx)
        if state_idx != 0:
            return super().update_recurrent_state(recurrent_states, layer_idx, state_idx, **kwargs)
        self.stored[layer_idx] = self.scheme.store(layer_idx, recurrent_states)
        self.stores += 1
        return recurrent_states

    def state_nbytes(self) -> int:
        """Bytes the stored states occupy now (all layers)."""
        return sum(s.nbytes for s in self.stored.values())

    def sequences(self) -> int:
        """Sequences (the batch) whose states the cache holds."""
        return max((st.batch for st in self.stored.values()), default=0)

    def state_values(self) -> int:
        s = self.scheme.shape
        return sum(st.batch for st in self.stored.values()) * s.heads * s.d_k * s.d_v

    def reset(self) -> None:
        super().reset()
        self.stored.clear()


class StateRuntime(Runtime):
    """`accel eval`'s side of a state scheme: a fresh cache per window; bytes measured on the caches made."""

    def __init__(self, model: Any, scheme: StateScheme):
        self.model, self.scheme = model, scheme
        self.caches: list[QuantizedStateCache] = []

    def make_cache(self) -> QuantizedStateCache:
        cache = QuantizedStateCache(self.model.config, self.scheme)
        self.caches.append(cache)
        return cache

    def report(self) -> dict[str, Any]:
        used = [c for c in self.caches if c.stored]
        if not used:
            return {}
        nbytes = sum(c.state_nbytes() for c in used)
        values = sum(c.state_values() for c in used)
        s = self.scheme.shape
        per_seq = nbytes / sum(c.sequences() for c in used)
        return {"state_bits_per_value": 8.0 * nbytes / values, "state_bytes": per_seq,
                "state_fp32_bytes": 4 * s.values, "state_layers": len(s.layers)}


# ---- uniform baselines as --state methods ----

class _Uniform(MapMethod):
    """Every channel in one format (a baseline in the same harness as DAMP)."""

    fmt: str = ""

    def _format(self, arg: str | None) -> str:
        if self.fmt:
            if arg is not None:
                raise AccelError(f"--state {self.name} takes no argument (got {arg!r})")
            return self.fmt
        if arg is None or not arg.isdigit():
            raise AccelError("--state int:K needs a bit width K (2..16), e.g. int:6")
        return check_format(f"int{arg}")

    def from_eval_spec(self, arg: str | None, config: dict[str, Any]) -> StoredMap:
        fmt = self._format(arg)
        shape = state_shape(config)
        return StoredMap("state", self.name, {"format": fmt, "shape": shape.to_json(),
                                              "bits_per_value": row_bits(fmt, shape.d_v)})

    def build(self, arg: str | None, ctx: Any) -> StoredMap:
        return self.from_eval_spec(arg, ctx.config)

    def check(self, stored: StoredMap, config: dict[str, Any]) -> None:
        check_shape(stored, state_shape(config))
        check_format(str(stored.params.get("format")))

    def runtime(self, stored: StoredMap, model: Any) -> StateRuntime:
        shape = state_shape(model.config)
        return StateRuntime(model, StateScheme(shape, low=stored.params["format"]))


def check_shape(stored: StoredMap, shape: StateShape) -> None:
    """Refuse a state map made for another model (layers, heads or channels differ)."""
    doc = stored.params.get("shape")
    if not isinstance(doc, dict):
        raise AccelError(f"the state map ({stored.method}) does not record the state shape it was made for")
    try:
        theirs = StateShape(str(doc["arch"]), tuple(int(i) for i in doc["layers"]), int(doc["heads"]),
                            int(doc["d_k"]), int(doc["d_v"]))
    except (KeyError, TypeError, ValueError):
        raise AccelError(f"the state map ({stored.method}) has a malformed shape record: {doc!r}") from None
    if theirs != shape:
        raise AccelError(f"the state map is for {theirs.describe()} ({theirs.arch}, layers "
                         f"{list(theirs.layers)}), but the model has {shape.describe()} ({shape.arch}, layers "
                         f"{list(shape.layers)})")


def _uniform(name: str, fmt: str, text: str) -> None:
    """Register a uniform --state method (the class registers itself on creation)."""
    type(f"Uniform_{name}", (_Uniform,), {"fmt": fmt, "description": text}, kind="state", name=name)


for _name, _fmt, _text in (("fp32", "fp32", "float32 state (transformers' own precision)"),
                           ("fp16", "fp16", "float16 state"), ("bf16", "bf16", "bfloat16 state"),
                           ("fp8", "fp8", "float8 e4m3 with a float16 scale per channel"),
                           ("int8", "int8", "INT8 with a float16 scale per channel"),
                           ("int4", "int4", "INT4 with a float16 scale per channel"),
                           ("int", "", "INT-K (int:K) with a float16 scale per channel")):
    _uniform(_name, _fmt, _text)


def masks_from_array(high: np.ndarray, shape: StateShape) -> dict[int, torch.Tensor]:
    """[layers, heads, d_k] 0/1 array -> {layer index: bool mask}."""
    return {layer: torch.from_numpy(np.asarray(high[i]) != 0).reshape(-1) for i, layer in enumerate(shape.layers)}
