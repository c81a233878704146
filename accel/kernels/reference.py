"""Float64 reference decode + matvec for every layout the kernels read, built only on the format library.

The weight is decoded densely in float64 from the codes the layout stores (the format library's own `unpack`, so
the reference shares no code with the kernels): affine `q * scale + offset` (or `(q - (L-1)/2) * scale`), leech
`U^T (scale * sum_s alpha_s * point_s) V` through `decode_leech`. Tests compare every kernel against it.
"""

from __future__ import annotations

import numpy as np

from accel.formats.codecs import get_codec
from accel.formats.tensor import TensorEntry


def _codes(entry: TensorEntry, parts: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    codec = get_codec(entry.codec)
    return {name: codec.layout_for(entry.layout, name, entry.params).unpack(parts[name], levels, count)
            for name, (levels, count) in codec.streams(entry.params, entry.shape).items()}


def reference_weight(entry: TensorEntry, parts: dict[str, np.ndarray]) -> np.ndarray:
    """The dense float64 weight of an affine or leech tensor."""
    codes = _codes(entry, parts)
    if entry.codec == "affine":
        p = entry.params
        rows, cols = entry.shape
        group = p["group"]
        q = codes["codes"].astype(np.float64).reshape(rows, cols)
        cidx = np.arange(cols) // group
        scale = np.asarray(parts["scale"]).astype(np.float64)[:, cidx]
        if p["symmetric"]:
            return (q - (p["levels"] - 1) / 2.0) * scale
        return q * scale + np.asarray(parts["offset"]).astype(np.float64)[:, cidx]
    if entry.codec == "leech":
        from accel.formats.leech_codec import decode_leech

        return decode_leech(codes, np.asarray(parts["scale"]), entry.params, entry.shape)
    raise ValueError(f"no reference for codec '{entry.codec}'")


def reference_matvec(entry: TensorEntry, parts: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """y = W x in float64."""
    return reference_weight(entry, parts) @ np.asarray(x, dtype=np.float64)
