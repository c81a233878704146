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
    """HQQ's optimized per-group (scale, offset) as fp16 arrays of shape (rows, cols // group)."""
    try:
        import torch
        from hqq.core.quantize import Quantizer
    except ImportError:
        raise AccelError("--weights hqqN needs the hqq package: pip install hqq") from None
    rows, cols = weight.shape
    if cols % group:
        raise AccelError(f"hqq needs the row length {cols} to be a multiple of --group {group}")
    _, meta = Quantizer.quantize(torch.from_numpy(np.ascontiguousarray(weight, dtype=np.float32)), nbits=bits,
                                 group_size=group, optimize=True, axis=1, bitpack=False, device="cpu",
                                 compute_dtype=torch.float32)
    scale = meta["scale"].double().numpy().reshape(rows, cols // group)
    zero = meta["zero"].double().numpy().reshape(rows, cols // group)
    return scale.astype(np.float16), (-zero * scale).astype(np.float16)


def _hqq(bits: int):
    def encode(name: str, weight: np.ndarray, settings: WeightSettings):
        scale, offset = hqq_grid(weight, bits, settings.group)
        return encode_tensor(name, weight, "affine", layout=settings.layout, levels=1 << bits, group=settings.group,
                             symmetric=False, scale=scale, offset=offset)

    return encode


for _bits in (2, 3, 4):
    register_weight_method(WeightMethod(f"hqq{_bits}", f"HQQ (hqq package), {_bits}-bit, optimized zero/scale per group",
                                        _hqq(_bits)))
