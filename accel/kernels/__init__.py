"""Fused decode + matrix-vector kernels over accel's stored weight layouts (docs/kernels.md).

- `reference`: float64 reference decode + matvec from the format library alone.
- `weights`: `kernel_weight(entry, parts)` binds the C kernels (built with gcc on first use, `_build`) to the stored
  parts of one tensor: affine `packed` (8/4/2 bits fast, any width 1..8) and `base`, leech `planes` and `onehot`.
- `quant_linear.QuantLinear`: a drop-in nn.Linear over a kernel weight; `loading.build_kernel_model` builds a
  transformers model from an OUT_DIR with them.
- `triton_kernels`: GPU versions, importable only where Triton and a CUDA device exist.
"""

from accel.kernels._build import KernelUnavailable, available
from accel.kernels.weights import KernelWeight, Unsupported, kernel_weight, set_threads

__all__ = ["KernelUnavailable", "KernelWeight", "Unsupported", "available", "kernel_weight", "set_threads"]
