"""Leech-lattice weight quantization `leech2|leech3|leech4`: RHT incoherence, per-row scales, nearest ball points
per 24-column block, optional residual second stage, block-LDLQ error feedback when Hessians are given.

Rates (bits per 24-weight block): leech2 = 48 (shells 2..13, < 2^48 points); leech3 = 48 + 25 (second stage on
shells 2..3); leech4 = 48 + 48. Row scales add 16 bits per row; the padding (`padded_width`) is counted.
"""

from __future__ import annotations

import zlib
from functools import cache

import numpy as np

from accel.errors import AccelError
from accel.formats import dtypes
from accel.formats.leech_codec import BLOCK, STREAM_NAMES, ball_levels, max_padding
from accel.formats.tensor import TensorEntry, encode_tensor
from accel.memory import row_passes
from accel.quantize.gptq import damped_inverse_cholesky, error_feedback
from accel.quantize.incoherence import split_size, transform_hessian, transform_weight
from accel.quantize.methods import WeightMethod, WeightSettings, register_weight_method

RATES = {"leech2": (13,), "leech3": (13, 3), "leech4": (13, 13)}
# Blocks searched in one pass without Hessians: each of the stages' float64 arrays is then 6 MiB instead of twice
# the weight's float32 size (the whole encode, with the transforms' whole-matrix copies of before, peaked at 19.75
# times it; docs/architecture.md, "Memory").
BLOCKS_PER_PASS = 1 << 15
_ALPHA_GRID = np.geomspace(0.2, 1.5, 28)


def _search(targets: np.ndarray, alpha: float, max_shell: int):
    from accel.quantize.leech import nearest_point

    return nearest_point(targets, alpha, max_shell)


@cache
def stage_alphas(shells: tuple[int, ...]) -> tuple[float, ...]:
    """Per-stage lattice scales that minimise the MSE on unit Gaussian blocks (seeded sample; cached)."""
    rng = np.random.default_rng(0x1EEC)
    residual = rng.standard_normal((384, BLOCK))
    alphas = []
    for max_shell in shells:
        norm = float(np.sqrt((residual**2).sum(axis=1).mean()))
        best = None
        for factor in _ALPHA_GRID:
            alpha = float(factor * norm / np.sqrt(BLOCK))
            err = float(_search(residual, alpha, max_shell).objective.mean())
            if best is None or err < best[0]:
                best = (err, alpha)
        alpha = float(np.float32(best[1]))  # a short, exactly representable JSON value
        alphas.append(alpha)
        residual = residual - alpha * _search(residual, alpha, max_shell).points
    return tuple(alphas)


def tensor_seeds(name: str, seed: int) -> tuple[int, int]:
    """RHT seeds of one tensor: fixed by the run's seed and the tensor's name."""
    base = zlib.crc32(name.encode()) ^ (seed * 0x9E3779B1 & 0xFFFFFFFF)
    return base & 0xFFFFFFFF, (base * 0x85EBCA6B + 1) & 0xFFFFFFFF


def padded_width(rows: int, cols: int, shells: tuple[int, ...]) -> int:
    """The stored width of a rows x cols weight: the multiple of 24 from cols up to cols + max_padding(cols) whose
    batch-1 matvec reads the fewest bytes, the narrowest of equals.

    A call reads the codes (rows * width / 24 blocks at the stages' index bits) and applies the input transform V of
    that width, whose odd factor m brings an m x m float32 rotation (4 m^2 bytes, derived from the seed, read on
    every call). 4096 columns in whole blocks are 4104 = 8 * 513 (a 1 MB rotation); 4128 = 32 * 129 stores 0.6% more
    codes and reads 66 KB of rotation (measured 377 -> 339 us a call at 4096 rows, docs/kernels.md)."""
    block_bits = sum(int(ball_levels(s) - 1).bit_length() for s in shells)
    first = -(-cols // BLOCK) * BLOCK
    widths = range(first, cols + max_padding(cols) + 1, BLOCK)
    return min(widths, key=lambda w: (rows * (w // BLOCK) * block_bits / 8 + 4 * split_size(w)[0] ** 2, w))


class RowScaleRange(AccelError):
    """A row scale float16 cannot hold (check_row_scales)."""


def check_row_scales(rms: np.ndarray) -> None:
    """The format stores a Leech row's scale (its RMS after the rotations) in float16: a row past float16's range
    would decode to NaN, and one so small that its scale rounds to 0 would decode to zeros. Both refused, naming
    the range (weights of 1e5 or 1e-8 are not an LLM's; rtn stores float32 grids for them)."""
    nonzero = rms[rms > 0]
    if not nonzero.size:
        return
    if nonzero.max() >= 65504.0:
        raise RowScaleRange(f"a row's RMS is {nonzero.max():.3g}, past float16's range (65504), where the Leech format "
                         f"stores row scales; use rtn for this tensor's model")
    if nonzero.min() < 2.0 ** -24:
        raise RowScaleRange(f"a row's RMS is {nonzero.min():.3g}, below float16's smallest value (6e-8), where the "
                         f"Leech format stores row scales; use rtn for this tensor's model")


def quantize_leech(weight: np.ndarray, shells: tuple[int, ...], seed_in: int, seed_out: int,
                   hessian: np.ndarray | None = None) -> tuple[dict[str, np.ndarray], np.ndarray, dict]:
    """Code streams, fp16 row scales and codec params for one 2-D weight."""
    rows, cols = weight.shape
    padded = padded_width(rows, cols, shells)
    wt = transform_weight(_padded(weight, padded), seed_out, seed_in)  # the padded copy lives only in there
    rms = np.sqrt((wt**2).mean(axis=1))
    check_row_scales(rms)
    scale16 = dtypes.to_storage(rms, "float16")
    scale = scale16.astype(np.float64)
    scale[scale == 0] = 1.0  # an all-zero row stores scale 0 (decodes to zeros); search it at scale 1
    alphas = stage_alphas(shells)
    blocks = padded // BLOCK
    codes = [np.zeros((rows, blocks), dtype=np.uint64) for _ in shells]

    def stages(target: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
        """Each stage quantizes what the stages before it left: (indices per stage, the sum of their points)."""
        approx = np.zeros_like(target)
        indices = []
        for max_shell, alpha in zip(shells, alphas, strict=True):
            found = _search(target - approx, alpha, max_shell)
            indices.append(found.indices)
            approx += alpha * found.points
        return indices, approx

    if hessian is None:  # blocks are searched independently: a pass of rows at a time bounds the search's arrays
        for r in row_passes(rows, blocks, BLOCKS_PER_PASS):
            indices, _ = stages((wt[r] / scale[r, None]).reshape(-1, BLOCK))
            for stream, idx in zip(codes, indices, strict=True):
                stream[r] = idx.reshape(-1, blocks)
    else:
        def quantize(a: int, ahead: np.ndarray) -> np.ndarray:
            indices, approx = stages(ahead[:, :BLOCK] / scale[:, None])
            for stream, idx in zip(codes, indices, strict=True):
                stream[:, a // BLOCK] = idx
            return approx * scale[:, None]

        h = np.zeros((padded, padded))
        h[:cols, :cols] = hessian
        u = damped_inverse_cholesky(transform_hessian(h, seed_in))
        error_feedback(wt, u, BLOCK, quantize, lazy=4 * BLOCK)
    params = {"stages": [{"max_shell": m, "alpha": a} for m, a in zip(shells, alphas, strict=True)],
              "cols": padded, "seed_in": seed_in, "seed_out": seed_out, "scale_dtype": "float16"}
    return {STREAM_NAMES[i]: c.reshape(-1) for i, c in enumerate(codes)}, scale16, params


def _padded(weight: np.ndarray, width: int) -> np.ndarray:
    """`weight` in float64 with zero columns up to `width`."""
    w = np.zeros((weight.shape[0], width))
    w[:, : weight.shape[1]] = weight
    return w


def encode_leech(name: str, weight: np.ndarray, shells: tuple[int, ...], settings: WeightSettings
                 ) -> tuple[TensorEntry, dict[str, np.ndarray]]:
    seed_in, seed_out = tensor_seeds(name, settings.seed)
    hessian = settings.hessians.get(name, weight.shape[1]) if settings.hessians is not None else None
    try:
        return encode_tensor(name, weight, "leech", layout=settings.layout, shells=shells, seed_in=seed_in,
                             seed_out=seed_out, hessian=hessian)
    except RowScaleRange as exc:
        raise AccelError(f"tensor '{name}': {exc}") from None


def _method(shells: tuple[int, ...]):
    return lambda name, weight, settings: encode_leech(name, weight, shells, settings)


for _name, _shells in RATES.items():
    register_weight_method(WeightMethod(_name, f"Leech lattice, stages on shells {_shells}", _method(_shells),
                                        uses_calibration=True, parallel=True))
