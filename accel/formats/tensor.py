"""Logical tensors: a codec's output bound to a layout and named stored parts, and back."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from accel.errors import FormatError
from accel.formats import dtypes
from accel.formats.codecs import get_codec
from accel.formats.layouts import LAYOUT_ALIASES

ROLES = ("quantized", "kept", "map", "data")
MAX_ELEMENTS = 2**40  # a logical tensor's elements, and each of its sizes, stay below this


@dataclass
class TensorEntry:
    """One logical tensor of the container document (docs/format.md, "Logical tensors")."""

    name: str
    codec: str
    params: dict[str, Any]
    shape: tuple[int, ...]
    layout: str
    role: str
    parts: dict[str, str] = field(default_factory=dict)  # part name -> stored tensor name

    def to_json(self) -> dict[str, Any]:
        return {"codec": self.codec, "params": self.params, "shape": list(self.shape), "layout": self.layout,
                "role": self.role, "parts": self.parts}

    @classmethod
    def from_json(cls, name: str, doc: Any) -> TensorEntry:
        if not isinstance(doc, dict):
            raise FormatError(f"tensor '{name}': its document entry is not an object")
        try:
            shape = tuple(doc["shape"])
            entry = cls(name=name, codec=doc["codec"], params=doc["params"], shape=shape, layout=doc["layout"],
                        role=doc["role"], parts=doc["parts"])
        except (KeyError, TypeError) as exc:
            raise FormatError(f"tensor '{name}': document entry lacks or mangles {exc}") from None
        if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < MAX_ELEMENTS for d in shape):
            raise FormatError(f"tensor '{name}': shape {list(shape)} is not a list of sizes")
        if math.prod(shape) >= MAX_ELEMENTS:
            raise FormatError(f"tensor '{name}': shape {list(shape)} holds 2^40 elements or more")
        if not isinstance(entry.params, dict) or not isinstance(entry.parts, dict):
            raise FormatError(f"tensor '{name}': params and parts must be objects")
        if not all(isinstance(v, str) for v in (entry.codec, entry.layout, entry.role, *entry.parts.values())):
            raise FormatError(f"tensor '{name}': codec, layout, role and part names must be strings")
        if entry.role not in ROLES:
            raise FormatError(f"tensor '{name}': unknown role '{entry.role}'")
        return entry

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def expected_parts(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Part name -> (shape, safetensors dtype) the codec and layout imply; validates params and layout."""
        codec = get_codec(self.codec)
        try:
            codec.check_params(self.params, self.shape)
        except FormatError as exc:
            raise FormatError(f"tensor '{self.name}': {exc}") from None
        expected = {k: (p.shape, p.dtype) for k, p in codec.side_parts(self.params, self.shape).items()}
        streams = codec.streams(self.params, self.shape)
        for part, (levels, count) in streams.items():
            layout = codec.layout_for(self.layout, part, self.params)
            if not layout.supports(levels):
                raise FormatError(f"tensor '{self.name}': layout '{self.layout}' cannot hold {levels}-level codes")
            expected[part] = (layout.stored_shape(levels, count), "U8")
        if not streams and self.layout != "dense":
            raise FormatError(f"tensor '{self.name}': codec '{self.codec}' stores no codes, layout must be 'dense'")
        return expected


def stored_name(logical: str, part: str, codec: str) -> str:
    """Raw values keep the logical name, so other tools see an ordinary checkpoint; other parts get a suffix."""
    return logical if (codec == "raw" and part == "values") else f"{logical}:{part}"


def encode_tensor(name: str, x: np.ndarray, codec: str, *, role: str = "quantized", layout: str | None = None,
                  **params) -> tuple[TensorEntry, dict[str, np.ndarray]]:
    """Encode `x` with a registered codec; returns the entry and its stored arrays keyed by stored name."""
    impl = get_codec(codec)
    enc = impl.encode(x, **params)
    layout = LAYOUT_ALIASES.get(layout, layout) or impl.default_layout(enc.params)  # written by its own name
    parts = dict(enc.side)
    codes = enc.codes if isinstance(enc.codes, dict) else ({"codes": enc.codes} if enc.codes is not None else {})
    streams = impl.streams(enc.params, tuple(np.shape(x)))
    for part, (levels, _) in streams.items():
        parts[part] = impl.layout_for(layout, part, enc.params).pack(codes[part], levels)
    entry = TensorEntry(name=name, codec=codec, params=enc.params, shape=tuple(int(d) for d in np.shape(x)),
                        layout=layout, role=role)
    arrays = {}
    for part, array in sorted(parts.items()):
        entry.parts[part] = stored_name(name, part, codec)
        arrays[entry.parts[part]] = array
    return entry, arrays


def decode_parts(entry: TensorEntry, parts: dict[str, np.ndarray]) -> np.ndarray:
    """Decode a logical tensor from its stored arrays (keyed by part name)."""
    codec = get_codec(entry.codec)
    streams = codec.streams(entry.params, entry.shape)
    codes = {}
    for part, (levels, count) in streams.items():
        try:
            codes[part] = codec.layout_for(entry.layout, part, entry.params).unpack(parts[part], levels, count)
        except FormatError as exc:
            raise FormatError(f"tensor '{entry.name}': {exc}") from None
    side = {k: v for k, v in parts.items() if k not in streams}
    arg = codes.get("codes") if set(codes) <= {"codes"} else codes
    return codec.decode(arg, side, entry.params, entry.shape)


def storage_dtype_of(array: np.ndarray, expected: str) -> str:
    """The safetensors dtype to write an array under (BF16 arrays are uint16 bits)."""
    return "BF16" if expected == "BF16" else dtypes.safetensors_dtype(array)
