"""Triton GPU versions of the fused decode + matvec kernels (UNVERIFIED: no GPU was available when they were written).

Importing this module never fails: `available()` says whether Triton and a CUDA device are both present, and
`gpu_weight(kernel_weight)` moves a CPU `KernelWeight`'s stored parts to the device and returns an object whose
`matvec(x)` runs the Triton kernel. Each program computes BLOCK_R rows, walking the columns in BLOCK_C chunks and
decoding codes in registers (bytes in, float32 accumulation); the dense matrix is never formed. The Leech path
applies V and U^T with torch on the device (`rht_torch`) around the code matvec, like the CPU kernel.
"""

from __future__ import annotations

import os

import numpy as np

try:  # Triton is optional: without it (or without a GPU) nothing here runs and the tests skip
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None
    tl = None


def _device() -> str | None:
    """cuda when a GPU is present; cpu under Triton's interpreter (TRITON_INTERPRET=1), which is how these kernels
    were checked without one; else None."""
    if triton is None:
        return None
    try:
        import torch
    except ImportError:
        return None
    if torch.cuda.is_available():
        return "cuda"
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else None


def available() -> bool:
    return _device() is not None


if triton is not None:

    @triton.jit
    def _affine_kernel(codes, nbytes, scale, offset, x, y, rows, cols, ngroups, group, levels, base_g, base_b,
                       BITS: tl.constexpr, SYMMETRIC: tl.constexpr, BASE: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_C: tl.constexpr):
        pid = tl.program_id(0)
        r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = r < rows
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for c0 in range(0, cols, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            cmask = c < cols
            m = rmask[:, None] & cmask[None, :]
            k = r[:, None].to(tl.int64) * cols + c[None, :]  # code index
            if BASE:  # group value of base_b <= 24 bits (four bytes hold it), digit d = (value // L^d) % L
                grp = k // base_g
                digit = k - grp * base_g
                bit = grp * base_b
                byte = bit >> 3
                word = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.int64)
                for i in tl.static_range(4):
                    word |= tl.load(codes + byte + i, mask=m & (byte + i < nbytes), other=0).to(tl.int64) << (8 * i)
                q = (word >> (bit & 7)) & ((1 << base_b) - 1)
                for d in range(base_g):
                    q = tl.where(digit > d, q // levels, q)
                q = (q % levels).to(tl.float32)
            else:
                bit = k * BITS
                byte = bit >> 3
                lo = tl.load(codes + byte, mask=m, other=0).to(tl.int32)
                hi = tl.load(codes + byte + 1, mask=m & (((bit & 7) + BITS) > 8), other=0).to(tl.int32)
                q = (((lo | (hi << 8)) >> (bit & 7).to(tl.int32)) & ((1 << BITS) - 1)).to(tl.float32)
            g = r[:, None] * ngroups + c[None, :] // group
            s = tl.load(scale + g, mask=m, other=0.0).to(tl.float32)
            if SYMMETRIC:
                w = (q - (levels - 1) * 0.5) * s
            else:
                w = q * s + tl.load(offset + g, mask=m, other=0.0).to(tl.float32)
            xv = tl.load(x + c, mask=cmask, other=0.0)
            acc += tl.sum(tl.where(m, w * xv[None, :], 0.0), axis=1)
        tl.store(y + r, acc, mask=rmask)

    @triton.jit
    def _leech_kernel(stream, z, t, rows, cols, nblk, plane, alpha, ONEHOT: tl.constexpr, PARAM: tl.constexpr,
                      NPLANES: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        """t[r] += alpha * <x[r], z> for one stage (x: the lattice point coordinates of row r's blocks)."""
        pid = tl.program_id(0)
        r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = r < rows
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for c0 in range(0, cols, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            cmask = c < cols
            m = rmask[:, None] & cmask[None, :]
            byte = r[:, None].to(tl.int64) * (3 * nblk) + (c[None, :] >> 3)
            sh = (c[None, :] & 7).to(tl.int32)
            blk = r[:, None].to(tl.int64) * nblk + c[None, :] // 24
            par = (tl.load(stream + NPLANES * plane + (blk >> 3), mask=m, other=0).to(tl.int32)
                   >> (blk & 7).to(tl.int32)) & 1
            if ONEHOT:
                mag = par
                for k in tl.static_range(PARAM):
                    bitk = (tl.load(stream + k * plane + byte, mask=m, other=0).to(tl.int32) >> sh) & 1
                    mag += bitk * (2 * (k + 1))
                neg = (tl.load(stream + PARAM * plane + byte, mask=m, other=0).to(tl.int32) >> sh) & 1
                xq = tl.where(neg == 1, -mag, mag)
            else:
                v = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.int32)
                for j in tl.static_range(PARAM):
                    v |= ((tl.load(stream + j * plane + byte, mask=m, other=0).to(tl.int32) >> sh) & 1) << j
                v = tl.where(v >= (1 << (PARAM - 1)), v - (1 << PARAM), v)
                xq = 2 * v + par
            zv = tl.load(z + c, mask=cmask, other=0.0)
            acc += tl.sum(tl.where(m, xq.to(tl.float32) * zv[None, :], 0.0), axis=1)
        old = tl.load(t + r, mask=rmask, other=0.0)
        tl.store(t + r, old + alpha * acc, mask=rmask)


def _hadamard(p: int, like):
    """The normalized p x p Walsh-Hadamard matrix (Sylvester order, p a power of two) in `like`'s dtype and device."""
    import torch

    h = torch.ones((1, 1), dtype=torch.float64)
    while h.shape[0] < p:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / p**0.5).to(dtype=like.dtype, device=like.device)


def hadamard_factors(power: int, like) -> tuple:
    """(H_a, H_b) with a * b = power, a <= b, a the largest power of two not above sqrt(power): H_power = H_a ⊗ H_b."""
    a = 1 << ((power.bit_length() - 1) // 2)
    return _hadamard(a, like), _hadamard(power // a, like)


def rht_torch(x, signs, mat, odd: int, inverse: bool, hadamard=None):
    """The seeded transform on the last axis with torch ops (device-agnostic): forward Q x, or Q^T x when inverse
    (mat is R for forward, R^T for inverse, as the CPU kernels take them).

    The Walsh-Hadamard factor H_P (P = n / odd) is applied as H_a ⊗ H_b with a·b = P, a ≤ b (Sylvester's H_P is
    that Kronecker product): two small matrix products on the vector viewed as [odd, a, b], so the whole transform
    is four device operations (signs, two Hadamard factors, R) whatever P is. `hadamard` = (H_a, H_b) if the caller
    keeps them (GpuWeight does); else they are built here."""
    n = x.shape[-1]
    power = n // odd
    ha, hb = hadamard if hadamard is not None else hadamard_factors(power, x)
    a, b = ha.shape[0], hb.shape[0]
    lead = x.shape[:-1]

    def fwht(y):  # [N, odd, P] -> H_P applied to each length-P piece
        return (ha @ y.reshape(-1, odd, a, b) @ hb).reshape(-1, odd, power)

    y = x.reshape(-1, n)
    if not inverse:
        y = fwht((y * signs).reshape(-1, odd, power))
        return (mat @ y).reshape(*lead, n)
    y = fwht(mat @ y.reshape(-1, odd, power))
    return (y.reshape(-1, n) * signs).reshape(*lead, n)


class GpuWeight:
    """A KernelWeight's stored parts on the GPU, with `matvec(x)` for a float32 vector on that device."""

    BLOCK_R = 16
    BLOCK_C = 128

    def __init__(self, weight):
        import torch

        from accel.kernels.weights import AffineWeight, LeechWeight

        device = _device()
        if device is None:
            raise RuntimeError("Triton kernels need triton and a CUDA device")
        self.cpu = weight
        self.shape = weight.shape

        def dev(a):
            return torch.from_numpy(np.ascontiguousarray(a)).to(device)

        if isinstance(weight, AffineWeight):
            if weight.base_b > 24:
                raise TypeError(f"the Triton base-L kernel reads group values of at most 24 bits, not {weight.base_b}")
            self.kind = "affine"
            stored = weight.stored()  # the stored layout, not the CPU kernels' tile copy
            self.codes = dev(stored["codes"])
            self.scale = dev(stored["scale"].reshape(self.shape[0], -1).astype(np.float32))
            self.offset = (dev(stored["offset"].reshape(self.shape[0], -1).astype(np.float32)) if "offset" in stored
                           else self.scale)
        elif isinstance(weight, LeechWeight):
            self.kind = "leech"
            self.streams = [dev(s) for s in weight.streams]
            self.scale = dev(weight.scale.view(np.float16).astype(np.float32))
            self.factors = {k: (dev(s), dev(m), odd) for k, (s, m, odd) in weight.factors.items()}
            self.hadamard = {side: hadamard_factors(signs.numel() // odd, signs)
                             for side, (signs, _, odd) in self.factors.items()}
        else:
            raise TypeError(f"no GPU kernel for {type(weight).__name__}")

    def matvec(self, x):
        import torch

        rows, cols = self.shape
        grid = (triton.cdiv(rows, self.BLOCK_R),)
        w = self.cpu
        if self.kind == "affine":
            y = torch.empty(rows, dtype=torch.float32, device=x.device)
            _affine_kernel[grid](self.codes, self.codes.numel(), self.scale, self.offset, x, y, rows, cols,
                                 self.scale.shape[1],
                                 w.group, w.levels, max(w.base_g, 1), max(w.base_b, 1), BITS=w.bits,
                                 SYMMETRIC=w.symmetric, BASE=w.base_g > 0, BLOCK_R=self.BLOCK_R,
                                 BLOCK_C=self.BLOCK_C)
            return y
        z = torch.zeros(w.cols, dtype=torch.float32, device=x.device)
        z[:cols] = x
        signs, mat, odd = self.factors["in"]
        z = rht_torch(z, signs, mat, odd, inverse=False, hadamard=self.hadamard["in"]).contiguous()
        t = torch.zeros(rows, dtype=torch.float32, device=x.device)
        nblk = w.cols // 24
        plane = 3 * rows * nblk
        onehot = int(w.kind == "leech-onehot")
        for i, stream in enumerate(self.streams):
            _leech_kernel[grid](stream, z, t, rows, w.cols, nblk, plane, float(w._alphas[i]),
                                ONEHOT=onehot, PARAM=int(w._params[i]), NPLANES=int(w._params[i]) + onehot,
                                BLOCK_R=self.BLOCK_R, BLOCK_C=self.BLOCK_C)
        t *= self.scale
        signs, mat, odd = self.factors["out"]
        return rht_torch(t, signs, mat, odd, inverse=True, hadamard=self.hadamard["out"])


def gpu_weight(weight) -> GpuWeight:
    return GpuWeight(weight)
