"""The DAMP state-update step as a Triton kernel, for a CUDA GPU (guarded: importing needs no GPU or Triton).

Same storage and arithmetic as the C kernel (state_update.c): one program per (batch, head) holds the head's
d_k × d_v state in registers, decoded from float16 rows and int8 rows with float16 scales, decays it (per head for
GDN, per channel for KDA), applies the delta rule, writes o, and encodes the rows back in place
(scale = absmax / 127 in float16, codes = round-half-even(x · (1 / scale)) clamped to ±127). `step_f32_triton`
is the same step on a float32 state, the fused baseline that `bench/gpu.py` times the DAMP kernel against.
`available()` is False without Triton, or with neither a CUDA GPU nor Triton's interpreter (TRITON_INTERPRET=1,
which runs the kernel on CPU tensors: how it was checked here, where no GPU was available); tests marked `gpu`
compare it to the float64 reference.
"""

from __future__ import annotations

from typing import Any

from accel.kernels.triton_kernels import _device

try:  # pragma: no cover - exercised only where Triton exists
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None


def device() -> str | None:
    """"cuda" with a GPU, "cpu" under TRITON_INTERPRET=1, else None (the rule of accel.kernels.triton_kernels)."""
    return _device()


def available() -> bool:
    return device() is not None


if triton is not None:  # pragma: no cover

    @triton.jit
    def _round_even(x):
        # round half to even for |x| < 2^22: adding and removing 1.5 * 2^23 rounds in IEEE float32 arithmetic
        magic = 12582912.0
        return (x + magic) - magic

    @triton.jit
    def _step(s, bh, r, j, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, DK: tl.constexpr, DV: tl.constexpr,
              KDA: tl.constexpr):
        # decay, delta rule and output of head bh's state tile s [DK, DV]: writes o, returns the new state
        if KDA:
            s = s * tl.exp(tl.load(g_ptr + bh * DK + r))[:, None]
        else:
            s = s * tl.exp(tl.load(g_ptr + bh))
        k = tl.load(k_ptr + bh * DK + r)
        q = tl.load(q_ptr + bh * DK + r)
        v = tl.load(v_ptr + bh * DV + j)
        beta = tl.load(beta_ptr + bh)
        mem = tl.sum(s * k[:, None], axis=0)
        delta = beta * (v - mem)
        s = s + k[:, None] * delta[None, :]
        tl.store(o_ptr + bh * DV + j, tl.sum(s * q[:, None], axis=0))
        return s

    @triton.jit
    def _slot_rows(slot_ptr, b, h, r, n_hi, n_lo, DK: tl.constexpr):
        # where head h's rows r live: (is_hi, the row of hi [B, n_hi, DV] or of lo [B, n_lo, DV])
        sl = tl.load(slot_ptr + h * DK + r)
        is_hi = sl >= 0
        return is_hi, tl.where(is_hi, b * n_hi + sl, b * n_lo - sl - 1)

    @triton.jit
    def _damp_step_kernel(slot_ptr, hi_ptr, lo_ptr, scale_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr,
                          H, n_hi, n_lo, DK: tl.constexpr, DV: tl.constexpr, KDA: tl.constexpr):
        bh = tl.program_id(0)
        b = bh // H
        h = bh % H
        r = tl.arange(0, DK)
        j = tl.arange(0, DV)
        is_hi, row = _slot_rows(slot_ptr, b, h, r, n_hi, n_lo, DK)
        off = row[:, None] * DV + j[None, :]
        hi_vals = tl.load(hi_ptr + off, mask=is_hi[:, None], other=0.0).to(tl.float32)
        codes = tl.load(lo_ptr + off, mask=(~is_hi)[:, None], other=0).to(tl.float32)
        sc = tl.load(scale_ptr + row, mask=~is_hi, other=0.0).to(tl.float32)
        s = tl.where(is_hi[:, None], hi_vals, codes * sc[:, None])
        s = _step(s, bh, r, j, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, DK, DV, KDA)
        amax = tl.max(tl.abs(s), axis=1)
        scale16 = tl.maximum(amax / 127.0, 5.960464477539063e-08).to(tl.float16)
        inv = 1.0 / scale16.to(tl.float32)
        x = _round_even(s * inv[:, None])
        x = tl.minimum(tl.maximum(x, -127.0), 127.0)
        # the rows again, from a second load of the slots: kept from above, the [DK, DV] offsets would stay live
        # across the reductions (ptxas for sm_90 spilled 1.1-1.3 KB a thread at 128 x 128; reloaded: 24-32 bytes)
        is_hi, row = _slot_rows(slot_ptr, b, h, r, n_hi, n_lo, DK)
        off = row[:, None] * DV + j[None, :]
        tl.store(hi_ptr + off, s.to(tl.float16), mask=is_hi[:, None])
        tl.store(lo_ptr + off, x.to(tl.int8), mask=(~is_hi)[:, None])
        tl.store(scale_ptr + row, scale16, mask=~is_hi)

    @triton.jit
    def _f32_step_kernel(s_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr,
                         DK: tl.constexpr, DV: tl.constexpr, KDA: tl.constexpr):
        # the same step on a float32 state [B, H, DK, DV], in place: the baseline the DAMP kernel is timed against
        bh = tl.program_id(0)
        r = tl.arange(0, DK)
        j = tl.arange(0, DV)
        s = tl.load(s_ptr + bh * DK * DV + r[:, None] * DV + j[None, :])
        s = _step(s, bh, r, j, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, DK, DV, KDA)
        # the same addresses written another way, so the compiler rebuilds them here instead of keeping the load's
        # [DK, DV] pointers live across the step (sm_90, 128 x 128: 224-2400 bytes a thread spilled; this way none)
        tl.store(s_ptr + bh * DK * DV + (j[None, :] + r[:, None] * DV), s)


def _check_dims(dk: int, dv: int) -> None:
    if dk & (dk - 1) or dv & (dv - 1):
        raise ValueError(f"d_k and d_v must be powers of two for the Triton kernel, got {dk} and {dv}")


def step_f32_triton(state: Any, q: Any, k: Any, v: Any, g: Any, beta: Any) -> Any:  # pragma: no cover
    """One step in place on a float32 device state [B, H, d_k, d_v] (a fused kernel, the GPU baseline for
    `step_mixed_triton`); returns o [B, H, d_v] float32."""
    import torch

    if not available():
        raise RuntimeError("the Triton state-update kernel needs Triton and a CUDA GPU (or TRITON_INTERPRET=1)")
    b, h, dk, dv = state.shape
    _check_dims(dk, dv)
    o = torch.empty((b, h, dv), dtype=torch.float32, device=state.device)
    _f32_step_kernel[(b * h,)](state, q.float().contiguous(), k.float().contiguous(), v.float().contiguous(),
                               g.float().contiguous(), beta.float().contiguous(), o, DK=dk, DV=dv, KDA=g.dim() == 3,
                               num_warps=8 if dk * dv >= 8192 else 4)
    return o


def step_mixed_triton(slot: Any, hi: Any, lo: Any, lo_scale: Any, q: Any, k: Any, v: Any, g: Any, beta: Any
                      ) -> Any:  # pragma: no cover - needs a GPU
    """One step in place on device tensors (see `device()`) in MixedState's layout (hi float16 [B, n_hi, d_v], lo int8
    [B, n_lo, d_v], lo_scale float16 [B, n_lo], slot int32 [H * d_k]); returns o [B, H, d_v] float32."""
    import torch

    if not available():
        raise RuntimeError("the Triton state-update kernel needs Triton and a CUDA GPU (or TRITON_INTERPRET=1)")
    b, h, dk = q.shape
    dv = v.shape[-1]
    _check_dims(dk, dv)
    o = torch.empty((b, h, dv), dtype=torch.float32, device=q.device)
    _damp_step_kernel[(b * h,)](slot, hi, lo, lo_scale, q.float().contiguous(), k.float().contiguous(),
                                v.float().contiguous(), g.float().contiguous(), beta.float().contiguous(), o,
                                h, hi.shape[1], lo.shape[1], DK=dk, DV=dv, KDA=g.dim() == 3,
                                num_warps=8 if dk * dv >= 8192 else 4)
    return o
