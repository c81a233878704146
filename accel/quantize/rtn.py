"""Round-to-nearest baseline `rtn2`..`rtn8`: asymmetric affine grid per group of the input axis."""

from __future__ import annotations

import numpy as np

from accel.formats.tensor import encode_tensor
from accel.quantize.methods import WeightMethod, WeightSettings, register_weight_method


def _rtn(bits: int):
    def encode(name: str, weight: np.ndarray, settings: WeightSettings):
        return encode_tensor(name, weight, "affine", layout=settings.layout, levels=1 << bits,
                             group=settings.group, symmetric=False)

    return encode


for _bits in range(2, 9):
    register_weight_method(WeightMethod(f"rtn{_bits}", f"round-to-nearest, {_bits}-bit asymmetric affine per group",
                                        _rtn(_bits)))
