"""HQQ baseline `hqq2`..`hqq4` through the `hqq` package (half-quadratic optimized zero/scale per group).

HQQ's grid (q - zero) * scale is stored with the affine codec as q * scale + offset, offset = -zero * scale, in
fp16 like HQQ's own metadata, so every baseline is read back by the same decoder.
"""

from __future__ import annotations

import numpy as np

from accel.errors import AccelError
from accel.formats.codecs import grid_dtype
from accel.formats.tensor import encode_tensor
from accel.quantize.methods import WeightMethod, WeightSettings, register_weight_method


def hqq_grid(weight: np.ndarray, bits: int, group: int) -> tuple[np.ndarray, np.ndarray]:
    """HQQ's optimized per-group (scale, offset) of shape (rows, ceil(cols / group)), as fp16 arrays (float32 where
    an fp16 grid would miss its group: grid_dtype).

    The hqq package wants whole groups; a row whose length is not a multiple of `group` (an MLA projection 32 wide,
    say) has its last, shorter group optimized on its own, as the affine codec stores it (a partial last group)."""
    try:
        import torch
        from hqq.core.quantize import Quantizer
    except ImportError:
        raise AccelError("--weights hqqN needs the hqq package: pip install hqq") from None
    rows, cols = weight.shape
    # HQQ's fixed thresholds (a group whose range is under 1e-4 gets scale 1, so weights around 1e-6 decoded to
    # nothing) are made for weights of ordinary size: a tensor whose largest magnitude is under 2^-6 is scaled by a
    # power of two to one near 1 and its grid scaled back, exactly. Larger tensors (every one of SmolLM2's) go to
    # HQQ as they are: its shrinkage is not scale-equivariant, and the baseline is the package's own behaviour
    peak = float(np.max(np.abs(weight))) if weight.size else 0.0
    unit = 2.0 ** -np.round(np.log2(peak)) if 0 < peak < 2.0 ** -6 else 1.0
    whole = cols - cols % group
    pieces = [(0, whole, group)] if whole else []
    if cols % group:
        pieces.append((whole, cols, cols % group))
    scales, offsets = [], []
    for c0, c1, size in pieces:
        part = np.ascontiguousarray(weight[:, c0:c1] * unit, dtype=np.float32)
        _, meta = Quantizer.quantize(torch.from_numpy(part), nbits=bits, group_size=size, optimize=True, axis=1,
                                     bitpack=False, device="cpu", compute_dtype=torch.float32)
        scale = meta["scale"].double().numpy().reshape(rows, (c1 - c0) // size) / unit
        zero = meta["zero"].double().numpy().reshape(rows, (c1 - c0) // size)
        scales.append(scale)
        offsets.append(-zero * scale)
    scale, offset = np.concatenate(scales, axis=1), np.concatenate(offsets, axis=1)
    dtype = np.float16 if grid_dtype(scale, (1 << bits) - 1, offset) == "float16" else np.float32
    return scale.astype(dtype), offset.astype(dtype)


def _hqq(bits: int):
    def encode(name: str, weight: np.ndarray, settings: WeightSettings):
        scale, offset = hqq_grid(weight, bits, settings.group)
        return encode_tensor(name, weight, "affine", layout=settings.layout, levels=1 << bits, group=settings.group,
                             symmetric=False, scale=scale, offset=offset)

    return encode


for _bits in (2, 3, 4):
    register_weight_method(WeightMethod(f"hqq{_bits}", f"HQQ (hqq package), {_bits}-bit, optimized zero/scale per group",
                                        _hqq(_bits)))
