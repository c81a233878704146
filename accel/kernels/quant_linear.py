"""QuantLinear: a drop-in torch.nn.Linear (inference only) that keeps its weight in accel's stored form.

Up to MATVEC_ROWS input rows (a decode step, a short prefill) run the fused decode + matvec kernel, once per row.
More rows (a long prefill, evaluation windows) decode the weight one tile of rows at a time into a reused float32
buffer and multiply the tile with torch (so the dense matrix never exists whole); for Leech weights the tiles are
of the transformed weight T and the inputs and outputs go through the seeded transforms: Y = U^T (T (V X)).
"""

from __future__ import annotations

import torch

from accel.kernels.weights import KernelWeight, LeechWeight, ptr

TILE_FLOATS = 1 << 18  # a decoded tile holds at most this many floats (1 MiB)
# Up to this many input rows run the fused matvec once per row; more rows decode tiles and multiply them with torch.
# Measured on SmolLM2's shapes and 4096x4096 (2 threads): one matvec per row was faster at every shape up to 32 rows
# (at 8 rows 4x-10x, at 32 rows 1.2x-3.2x), the tiles at 128 rows except 4096x4096 (docs/kernels.md, QuantLinear).
MATVEC_ROWS = 32


class QuantLinear(torch.nn.Module):
    def __init__(self, weight: KernelWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.kernel = weight
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().float(), requires_grad=False)
        self.tile_rows = max(1, min(self.out_features, TILE_FLOATS // max(weight.inner, 1)))
        self.matvec_rows = MATVEC_ROWS

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel.kind}, "
                f"bias={self.bias is not None}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():  # inference only; the decode loop already runs without autograd
            with torch.no_grad():
                return self._forward(x)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"QuantLinear expects {self.in_features} input features, got {x.shape[-1]}")
        lead = x.shape[:-1]
        if x.numel() == self.in_features and x.dtype == torch.float32 and x.is_contiguous() and not x.is_cuda:
            # one float32 row, the decode step: straight into the fused kernel, no copies (with the kept kernel
            # arguments, a 16x576 forward went from 21.4 to 8.9 us: docs/kernels.md, QuantLinear)
            out = torch.empty(*lead, self.out_features, dtype=torch.float32)
            self.kernel.matvec_ptr(x.data_ptr(), out.data_ptr())
            if self.bias is not None:
                out += self.bias
            return out
        flat = x.reshape(-1, self.in_features).to(device="cpu", dtype=torch.float32).contiguous()
        if flat.shape[0] <= self.matvec_rows:
            out = torch.empty(flat.shape[0], self.out_features, dtype=torch.float32)
            for row_in, row_out in zip(flat, out, strict=True):
                self.kernel.matvec_ptr(ptr(row_in), ptr(row_out))
        else:
            out = self._tiled(flat)
        if self.bias is not None:
            out += self.bias
        return out.reshape(*lead, self.out_features).to(x.dtype)

    def _tiled(self, flat: torch.Tensor) -> torch.Tensor:
        k = self.kernel
        n = flat.shape[0]
        if isinstance(k, LeechWeight):
            z = torch.zeros(n, k.cols, dtype=torch.float32)
            z[:, : self.in_features] = flat
            k.rht_ptr(ptr(z), n, "in")
            flat = z
        out = torch.empty(n, self.out_features, dtype=torch.float32)
        tile = torch.empty(self.tile_rows, k.inner, dtype=torch.float32)
        for r0 in range(0, self.out_features, self.tile_rows):
            r1 = min(r0 + self.tile_rows, self.out_features)
            k.decode_rows_ptr(r0, r1, ptr(tile))
            out[:, r0:r1] = flat @ tile[: r1 - r0].T
        if isinstance(k, LeechWeight):
            k.rht_ptr(ptr(out), n, "out")
        return out
