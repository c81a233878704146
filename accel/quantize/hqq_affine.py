"""HQQ baseline `hqq2`..`hqq4` through the `hqq` package (half-quadratic optimized zero/scale per group).

HQQ's grid (q - zero) * scale is stored with the affine codec as q * scale + offset, offset = -zero * scale, in
fp16 like HQQ's own metadata, so every baseline is read back by the same decoder.
"""

from __future__ import annotations

import numpy as np

from accel.errors import AccelError
from accel.formats.tensor import encode_tensor
from accel.quantize.methods import WeightMethod, WeightSettings, register_weight_method


def hqq_grid(weight: np.ndarray, bits: int, group: int) -> tuple[np.ndarray, np.ndarray]:
    """HQQ's optimized per-group (scale, offset) as fp16 arrays of shape (rows, ceil(cols / group)).

    The hqq package wants whole groups; a row whose length is not a multiple of `group` (an MLA projection 32 wide,
    say) has its last, shorter group optimized on its own, as the affine codec stores it (a partial last group)."""
    try:
        import torch
        from hqq.core.quantize import Quantizer
    except ImportError:
        raise AccelError("--weights hqqN needs the hqq package: pip install hqq") from None
    rows, cols = weight.shape
    whole = cols - cols % group
    pieces = [(0, whole, group)] if whole else []
    if cols % group:
        pieces.append((whole, cols, cols % group))
    scales, offsets = [], []
    for c0, c1, size in pieces:
        part = np.ascontiguousarray(weight[:, c0:c1], dtype=np.float32)
        _, meta = Quantizer.quantize(torch.from_numpy(part), nbits=bits, group_size=size, optimize=True, axis=1,
                                     bitpack=False, device="cpu", compute_dtype=torch.float32)
        scale = meta["scale"].double().numpy().reshape(rows, (c1 - c0) // size)
        zero = meta["zero"].double().numpy().reshape(rows, (c1 - c0) // size)
        scales.append(scale)
        offsets.append(-zero * scale)
    return np.concatenate(scales, axis=1).astype(np.float16), np.concatenate(offsets, axis=1).astype(np.float16)


def _hqq(bits: int):
    def encode(name: str, weight: np.ndarray, settings: WeightSettings):
        scale, offset = hqq_grid(weight, bits, settings.group)
        return encode_tensor(name, weight, "affine", layout=settings.layout, levels=1 << bits, group=settings.group,
                             symmetric=False, scale=scale, offset=offset)

    return encode


for _bits in (2, 3, 4):
    register_weight_method(WeightMethod(f"hqq{_bits}", f"HQQ (hqq package), {_bits}-bit, optimized zero/scale per group",
                                        _hqq(_bits)))
