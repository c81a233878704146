"""GPTQ baseline `gptq2`..`gptq4`: the error-feedback machinery with a scalar asymmetric grid per group.

The grid of a group is fitted when the feedback reaches its first column (so it covers the corrected weights), and
the result is stored with the same `affine` codec as rtnN: only the choice of codes differs.
"""

from __future__ import annotations

import numpy as np

from accel.formats import dtypes
from accel.formats.codecs import grid_dtype
from accel.formats.tensor import encode_tensor
from accel.quantize.gptq import damped_inverse_cholesky, error_feedback
from accel.quantize.methods import WeightMethod, WeightSettings, register_weight_method


def gptq_affine(w: np.ndarray, h: np.ndarray, levels: int, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GPTQ with per-group min-max grids; returns (dequantized W, stored scale, stored offset)."""
    rows, cols = w.shape
    groups = -(-cols // group)
    pad = groups * group - cols
    if pad:  # pad to whole groups with zero-Hessian columns: they take no error and cost nothing
        w = np.concatenate([w, np.repeat(w[:, -1:], pad, axis=1)], axis=1)
        h = np.pad(h, ((0, pad), (0, pad)))
    u = damped_inverse_cholesky(h)
    top = levels - 1
    # the grids are fitted to columns that error feedback has already changed, so their dtype is known only at the
    # end: float16 first, and again in float32 when a float16 grid missed its group (grid_dtype)
    for sdt in ("float16", "float32"):
        scale = np.zeros((rows, groups), dtype=dtypes.NUMPY_OF[dtypes.FLOAT_STORAGE[sdt]])
        offset = np.zeros_like(scale)
        exact = np.zeros((2, rows, groups))  # the unrounded steps and offsets
        grid: dict[str, np.ndarray] = {}

        def quantize(a: int, ahead: np.ndarray, sdt=sdt, scale=scale, offset=offset, exact=exact, grid=grid):
            if a % group == 0:
                g = ahead[:, :group]
                lo = g.min(axis=1)
                exact[0, :, a // group], exact[1, :, a // group] = (g.max(axis=1) - lo) / top, lo
                scale[:, a // group] = dtypes.to_storage(exact[0, :, a // group], sdt)
                offset[:, a // group] = dtypes.to_storage(lo, sdt)
                grid["s"] = dtypes.from_storage(scale[:, a // group], sdt).astype(np.float64)
                grid["o"] = dtypes.from_storage(offset[:, a // group], sdt).astype(np.float64)
            s, o = grid["s"], grid["o"]
            col = ahead[:, 0]
            q = np.clip(np.rint(np.divide(col - o, s, out=np.zeros_like(col), where=s > 0)), 0, top)
            return (q * s + o)[:, None]

        lazy = max(group, 128 - 128 % group)
        out = error_feedback(w, u, 1, quantize, lazy=lazy)
        if sdt == "float32" or grid_dtype(exact[0], top, exact[1]) == "float16":
            return out[:, :cols], scale, offset
    raise AssertionError("unreachable")


def _gptq(bits: int):
    def encode(name: str, weight: np.ndarray, settings: WeightSettings):
        h = settings.hessians.get(name, weight.shape[1])
        q, scale, offset = gptq_affine(weight.astype(np.float64), h, 1 << bits, settings.group)
        return encode_tensor(name, q, "affine", layout=settings.layout, levels=1 << bits, group=settings.group,
                             symmetric=False, scale=scale, offset=offset)

    return encode


for _bits in (2, 3, 4):
    register_weight_method(WeightMethod(f"gptq{_bits}", f"GPTQ error feedback, {_bits}-bit asymmetric affine per group",
                                        _gptq(_bits), needs_calibration=True, uses_calibration=True,
                                        parallel=True))

