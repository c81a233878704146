"""The recurrent-state update step on DAMP storage: C/OpenMP kernel, float32 kernel, float64 reference.

One decode step of the gated delta rule for a layer (see state_update.c): decay (per head for GDN, per channel for
KDA), delta-rule write, output. `step_mixed` reads and writes a `MixedState` — float16 rows for the kept channels,
int8 rows with float16 scales for the rest, exactly the runtime's storage (accel.runtime.state_cache) — without
materialising a float32 copy of the state. `step_water` does the same on a `WaterState`, the storage of an
`alloc=water` map: every channel its own INT-K width (K = 2..16), K-bit codes in bit streams. `step_f32` is the
same loop on a float32 state (the baseline); `reference_step` is the float64 reference they are tested against.

The C source is compiled with gcc on first use (`accel.kernels._build`'s compiler, cache directory and CPU key)
and called through ctypes. Inputs: q, k [B, H, d_k] (already L2-normalised, q scaled by d_k^-0.5, GQA heads
expanded), v [B, H, d_v], g log-decay [B, H] (GDN) or [B, H, d_k] (KDA), beta [B, H].
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import numpy as np
import torch

from accel.kernels import _build
from accel.runtime.state_cache import decode_rows, encode_rows

SOURCE = Path(__file__).with_name("state_update.c")


_i32, _ptr = ctypes.c_int, ctypes.c_void_p


@cache
def library() -> ctypes.CDLL:
    """The compiled kernels (KernelUnavailable, an AccelError, without a working gcc)."""
    lib = ctypes.CDLL(str(_build.library_path(SOURCE, "state_update")))
    lib.accel_state_step_f32.argtypes = [_i32] * 5 + [_ptr] * 7 + [_i32]
    lib.accel_state_step_mixed.argtypes = [_i32] * 5 + [_ptr, _i32, _i32] + [_ptr] * 9 + [_i32]
    lib.accel_state_step_water.argtypes = [_i32] * 5 + [_ptr] * 5 + [_ptr] * 6 + [_i32]
    lib.accel_state_water_vector_path.argtypes = [_i32]
    lib.accel_state_encode_int_rows.argtypes = [_ptr, ctypes.c_long, _i32, _i32, _ptr, _ptr, _i32]
    lib.accel_state_decode_int_rows.argtypes = [_ptr, _ptr, ctypes.c_long, _i32, _i32, _ptr, _i32]
    lib.accel_state_encode_int_rows.restype = lib.accel_state_decode_int_rows.restype = _i32
    lib.accel_state_step_f32.restype = lib.accel_state_step_mixed.restype = _i32
    lib.accel_state_step_water.restype = lib.accel_state_water_vector_path.restype = _i32
    return lib


def available() -> bool:
    try:
        library()
    except _build.KernelUnavailable:
        return False
    return True


@dataclass
class MixedState:
    """A layer's state in DAMP storage: `slot` maps each (head, channel) to a float16 row or an int8 row."""

    batch: int
    heads: int
    d_k: int
    d_v: int
    slot: np.ndarray  # int32 [heads * d_k]
    hi: np.ndarray  # uint16 (float16 bits) [batch, n_hi, d_v]
    lo: np.ndarray  # int8 [batch, n_lo, d_v]
    lo_scale: np.ndarray  # uint16 (float16 bits) [batch, n_lo]

    @classmethod
    def from_float(cls, state: np.ndarray | torch.Tensor, high: np.ndarray) -> MixedState:
        """Encode [B, H, d_k, d_v] with the channels where `high` ([H, d_k] 0/1) is set kept in float16."""
        s = torch.as_tensor(np.asarray(state), dtype=torch.float32)
        b, h, dk, dv = s.shape
        flat = np.asarray(high).reshape(-1) != 0
        hi_idx, lo_idx = np.nonzero(flat)[0], np.nonzero(~flat)[0]
        slot = np.empty(h * dk, dtype=np.int32)
        slot[hi_idx] = np.arange(hi_idx.size, dtype=np.int32)
        slot[lo_idx] = -np.arange(lo_idx.size, dtype=np.int32) - 1
        rows = s.reshape(b, h * dk, dv)
        hi = encode_rows(rows[:, hi_idx].reshape(-1, dv), "fp16")["values"]
        lo_parts = encode_rows(rows[:, lo_idx].reshape(-1, dv), "int8")
        return cls(b, h, dk, dv, slot, hi.view(torch.int16).numpy().view(np.uint16).reshape(b, -1, dv).copy(),
                   lo_parts["codes"].numpy().reshape(b, -1, dv).copy(),
                   lo_parts["scales"].view(torch.int16).numpy().view(np.uint16).reshape(b, -1).copy())

    def to_float(self) -> np.ndarray:
        b, h, dk, dv = self.batch, self.heads, self.d_k, self.d_v
        out = np.empty((b, h * dk, dv), dtype=np.float32)
        hi_idx, lo_idx = np.nonzero(self.slot >= 0)[0], np.nonzero(self.slot < 0)[0]
        out[:, hi_idx] = self.hi.view(np.float16).astype(np.float32)[:, self.slot[hi_idx]]
        lo = decode_rows({"codes": torch.from_numpy(self.lo.reshape(-1, dv)),
                          "scales": torch.from_numpy(self.lo_scale.reshape(-1).view(np.float16))},
                         "int8", self.lo.shape[0] * self.lo.shape[1], dv).numpy().reshape(b, -1, dv)
        out[:, lo_idx] = lo[:, -self.slot[lo_idx] - 1]
        return out.reshape(b, h, dk, dv)

    @property
    def nbytes(self) -> int:
        return self.hi.nbytes + self.lo.nbytes + self.lo_scale.nbytes

    @property
    def bits_per_value(self) -> float:
        return 8.0 * self.nbytes / (self.batch * self.heads * self.d_k * self.d_v)


@dataclass
class WaterState:
    """A layer's state in the storage of a water-filled DAMP map: row (head, channel) has its own width K.

    Per width K, the rows of that width (batch-major, then in channel order) are one little-endian bit stream of
    K-bit codes, d_v * K / 8 bytes a row, and one float16 scale a row: what `StateScheme(row_formats=...)` stores
    for the layer (`accel.runtime.state_cache.encode_rows`), byte for byte. `width` and `slot` are fixed when
    the state is made (read-only arrays): the kernel indexes the streams by them."""

    batch: int
    heads: int
    d_k: int
    d_v: int
    width: np.ndarray  # uint8 [heads * d_k], K of each row
    slot: np.ndarray  # int32 [heads * d_k], the row's index among the rows of its width
    codes: dict[int, np.ndarray]  # K -> uint8 stream [batch * rows of width K * d_v * K / 8]
    scales: dict[int, np.ndarray]  # K -> uint16 (float16 bits) [batch * rows of width K]
    _tables: tuple | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def from_float(cls, state: np.ndarray | torch.Tensor, widths: np.ndarray) -> WaterState:
        """Encode [B, H, d_k, d_v] with row (h, r) in INT-widths[h, r]."""
        s = torch.as_tensor(np.asarray(state), dtype=torch.float32)
        b, h, dk, dv = s.shape
        width = np.asarray(widths).reshape(-1).astype(np.uint8)
        if width.size != h * dk or width.min() < 2 or width.max() > 16 or dv % 8:
            raise ValueError(f"widths must be [{h}, {dk}] in 2..16 and d_v a multiple of 8 (d_v {dv})")
        slot = np.zeros(h * dk, dtype=np.int32)
        codes, scales = {}, {}
        rows = s.reshape(b, h * dk, dv)
        for k in np.unique(width).tolist():
            idx = np.nonzero(width == k)[0]
            slot[idx] = np.arange(idx.size, dtype=np.int32)
            parts = encode_rows(rows[:, idx].reshape(-1, dv), f"int{k}")
            codes[k] = parts["codes"].contiguous().view(torch.uint8).numpy().reshape(-1).copy()
            scales[k] = parts["scales"].view(torch.int16).numpy().view(np.uint16).reshape(-1).copy()
        width.setflags(write=False)
        slot.setflags(write=False)
        return cls(b, h, dk, dv, width, slot, codes, scales)

    def to_float(self) -> np.ndarray:
        b, h, dk, dv = self.batch, self.heads, self.d_k, self.d_v
        out = np.empty((b, h * dk, dv), dtype=np.float32)
        for k, stream in self.codes.items():
            idx = np.nonzero(self.width == k)[0]
            parts = {"codes": torch.from_numpy(stream.view(np.int8).reshape(-1, dv) if k == 8 else stream),
                     "scales": torch.from_numpy(self.scales[k].view(np.float16))}
            out[:, idx] = decode_rows(parts, f"int{k}", b * idx.size, dv).numpy().reshape(b, idx.size, dv)
        return out.reshape(b, h, dk, dv)

    def kernel_tables(self) -> tuple[np.ndarray, ctypes.Array, ctypes.Array]:
        """(rows per width [17], the streams' and the scales' addresses by width): what step_water passes the
        kernel, checked against the arrays' sizes and made once (they are rewritten in place, never replaced)."""
        if self._tables is None:
            n_rows = np.zeros(17, dtype=np.int32)
            codes, scales = (ctypes.c_void_p * 17)(), (ctypes.c_void_p * 17)()
            for k in range(2, 17):
                rows = np.nonzero(self.width == k)[0]
                n_rows[k] = rows.size
                if not rows.size:
                    continue
                stream, scale = self.codes.get(k), self.scales.get(k)
                if (stream is None or scale is None or stream.dtype != np.uint8 or scale.dtype != np.uint16
                        or stream.size != self.batch * rows.size * self.d_v * k // 8
                        or scale.size != self.batch * rows.size
                        or sorted(self.slot[rows].tolist()) != list(range(rows.size))):
                    raise ValueError(f"WaterState: the width-{k} rows do not match their stream, scales or slots")
                codes[k], scales[k] = _p(stream), _p(scale)
            self._tables = (n_rows, codes, scales)
        return self._tables

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.codes.values()) + sum(c.nbytes for c in self.scales.values())

    @property
    def bits_per_value(self) -> float:
        return 8.0 * self.nbytes / (self.batch * self.heads * self.d_k * self.d_v)


def _f32(x) -> np.ndarray:
    if isinstance(x, np.ndarray) and x.dtype == np.float32 and x.flags.c_contiguous:
        return x
    return np.ascontiguousarray(np.asarray(x, dtype=np.float32))


def _p(a: np.ndarray) -> int:
    # __array_interface__, not a.ctypes: the ctypes helper object costs tens of microseconds a call and makes
    # reference cycles that set off the garbage collector, which at one call per layer and token dominated the step
    return a.__array_interface__["data"][0]


def _inputs(q, k, v, g, beta, b: int, h: int, dk: int, dv: int) -> tuple[np.ndarray, ...]:
    q, k, v, g, beta = (_f32(x) for x in (q, k, v, g, beta))
    if q.shape != (b, h, dk) or k.shape != (b, h, dk) or v.shape != (b, h, dv) or beta.shape != (b, h):
        raise ValueError(f"q, k, v, beta shapes {q.shape}, {k.shape}, {v.shape}, {beta.shape} do not fit "
                         f"a state of {b}x{h}x{dk}x{dv}")
    if g.shape not in ((b, h), (b, h, dk)):
        raise ValueError(f"g must be [B, H] (GDN) or [B, H, d_k] (KDA), got {g.shape}")
    return q, k, v, g, beta


def step_f32(state: np.ndarray, q, k, v, g, beta, threads: int = 0) -> np.ndarray:
    """One step on a float32 C-contiguous state [B, H, d_k, d_v], in place; returns o [B, H, d_v]."""
    if state.dtype != np.float32 or not state.flags.c_contiguous:
        raise ValueError("step_f32 updates a C-contiguous float32 state in place")
    b, h, dk, dv = state.shape
    q, k, v, g, beta = _inputs(q, k, v, g, beta, b, h, dk, dv)
    o = np.empty((b, h, dv), dtype=np.float32)
    rc = library().accel_state_step_f32(b, h, dk, dv, int(g.ndim == 3), _p(state), _p(q), _p(k), _p(v), _p(g),
                                        _p(beta), _p(o), threads)
    if rc:
        raise MemoryError("the state-update kernel could not allocate its scratch")
    return o


def step_mixed(state: MixedState, q, k, v, g, beta, threads: int = 0) -> np.ndarray:
    """One step on DAMP storage, in place (codes, scales and float16 rows rewritten); returns o [B, H, d_v]."""
    b, h, dk, dv = state.batch, state.heads, state.d_k, state.d_v
    q, k, v, g, beta = _inputs(q, k, v, g, beta, b, h, dk, dv)
    o = np.empty((b, h, dv), dtype=np.float32)
    rc = library().accel_state_step_mixed(
        b, h, dk, dv, int(g.ndim == 3), _p(state.slot), state.hi.shape[1], state.lo.shape[1], _p(state.hi),
        _p(state.lo), _p(state.lo_scale), _p(q), _p(k), _p(v), _p(g), _p(beta), _p(o), threads)
    if rc:
        raise MemoryError("the state-update kernel could not allocate its scratch")
    return o


def step_water(state: WaterState, q, k, v, g, beta, threads: int = 0) -> np.ndarray:
    """One step on water-map storage, in place (codes and scales rewritten); returns o [B, H, d_v]."""
    b, h, dk, dv = state.batch, state.heads, state.d_k, state.d_v
    q, k, v, g, beta = _inputs(q, k, v, g, beta, b, h, dk, dv)
    o = np.empty((b, h, dv), dtype=np.float32)
    n_rows, codes, scales = state.kernel_tables()
    rc = library().accel_state_step_water(
        b, h, dk, dv, int(g.ndim == 3), _p(state.slot), _p(state.width), _p(n_rows), ctypes.addressof(codes),
        ctypes.addressof(scales), _p(q), _p(k), _p(v), _p(g), _p(beta), _p(o), threads)
    if rc == -2:
        raise ValueError(f"step_water needs widths in 2..16 and d_v a multiple of 8 (d_v {dv})")
    if rc:
        raise MemoryError("the state-update kernel could not allocate its scratch")
    return o


def encode_int_rows(rows: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """`state_cache.encode_rows(rows, f"int{k}")` for K = 2..16, K != 8, in C: the same parts, bit for bit."""
    rows = rows.detach().to(torch.float32).contiguous()
    n, dv = rows.shape
    codes = torch.empty(n * dv * k // 8, dtype=torch.uint8)
    scales = torch.empty(n, dtype=torch.float16)
    rc = library().accel_state_encode_int_rows(rows.data_ptr(), n, dv, k, codes.data_ptr(), scales.data_ptr(),
                                               torch.get_num_threads())
    if rc:
        raise ValueError(f"INT-{k} rows of {dv} values: K must be 2..16 (not 8) and d_v * K a multiple of 8")
    return {"codes": codes, "scales": scales}


def decode_int_rows(parts: dict[str, torch.Tensor], k: int, n: int, dv: int) -> torch.Tensor:
    """`state_cache.decode_rows(parts, f"int{k}", n, dv)` in C (the inverse of encode_int_rows)."""
    codes, scales = parts["codes"].contiguous(), parts["scales"].contiguous()
    if codes.dtype != torch.uint8 or codes.numel() != n * dv * k // 8 or scales.numel() != n \
            or scales.dtype != torch.float16:
        raise ValueError(f"INT-{k} parts do not hold {n} rows of {dv} values")
    out = torch.empty(n, dv, dtype=torch.float32)
    rc = library().accel_state_decode_int_rows(codes.data_ptr(), scales.data_ptr(), n, dv, k, out.data_ptr(),
                                               torch.get_num_threads())
    if rc:
        raise ValueError(f"INT-{k} rows of {dv} values: K must be 2..16 (not 8) and d_v * K a multiple of 8")
    return out


def water_vector_path(d_v: int) -> bool:
    """Whether step_water takes the vector path at this d_v here (AVX-512 VBMI, d_v = 16..128 in steps of 16)."""
    return bool(library().accel_state_water_vector_path(d_v))


def reference_step(state: np.ndarray, q, k, v, g, beta) -> tuple[np.ndarray, np.ndarray]:
    """Float64: (o [B, H, d_v], new state [B, H, d_k, d_v])."""
    s = np.asarray(state, dtype=np.float64)
    q, k, v, g, beta = (np.asarray(x, dtype=np.float64) for x in (q, k, v, g, beta))
    alpha = np.exp(g)[..., None, None] if g.ndim == 2 else np.exp(g)[..., None]
    s = s * alpha
    mem = np.einsum("bhkv,bhk->bhv", s, k)
    delta = beta[..., None] * (v - mem)
    s = s + k[..., :, None] * delta[..., None, :]
    return np.einsum("bhkv,bhk->bhv", s, q), s


def step_torch(state: torch.Tensor, q, k, v, g, beta) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 update as transformers' recurrent GDN / KDA decode path computes it (PyTorch ops)."""
    alpha = g.exp()[..., None, None] if g.dim() == 2 else g.exp()[..., None]
    state = state * alpha
    mem = (state * k[..., None]).sum(dim=-2)
    delta = (v - mem) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(dim=-2), state
