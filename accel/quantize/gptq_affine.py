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
    cols = w.shape[1]
    groups = -(-cols // group)
    pad = groups * group - cols
    if pad:  # pad to whole groups with zero-Hessian columns: they take no error and cost nothing
        w = np.concatenate([w, np.repeat(w[:, -1:], pad, axis=1)], axis=1)
        h = np.pad(h, ((0, pad), (0, pad)))
    u = damped_inverse_cholesky(h)
    # the grids are fitted to columns that error feedback has already changed, so their dtype is known only at the
    # end: float16 first, and again in float32 when a float16 grid missed its group (grid_dtype); a float16 pass
    # that overflows (inf grids, then NaN feedback) is the one thrown away, so its warnings would only be noise
    with np.errstate(over="ignore", invalid="ignore"):
        out, scale, offset, exact = _feedback_pass(w, u, levels - 1, group, "float16")
    if grid_dtype(exact[0], levels - 1, exact[1]) == "float32":
        out, scale, offset, _ = _feedback_pass(w, u, levels - 1, group, "float32")
    return out[:, :cols], scale, offset


def _feedback_pass(w: np.ndarray, u: np.ndarray, top: int, group: int, sdt: str
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One GPTQ pass with grids stored in `sdt`: (dequantized W, stored scale, stored offset, the unrounded steps
    and offsets [2, rows, groups])."""
    rows, groups = w.shape[0], w.shape[1] // group
    scale = np.zeros((rows, groups), dtype=dtypes.NUMPY_OF[dtypes.FLOAT_STORAGE[sdt]])
    offset = np.zeros_like(scale)
    exact = np.zeros((2, rows, groups))
    grid: dict[str, np.ndarray] = {}

    def quantize(a: int, ahead: np.ndarray) -> np.ndarray:
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
    return error_feedback(w, u, 1, quantize, lazy=lazy), scale, offset, exact


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

