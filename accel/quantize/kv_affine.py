"""Affine KV-cache quantization on a fractional-bit grid (KIVI style), for any number of levels L in 2..256.

- Keys: per-channel groups. A group is one channel over a block of consecutive tokens; its range [lo, hi] is
  stored once (two fp16 numbers) and each token of the block is coded on that range with its own L.
- Values: per-token groups. A group is `group` consecutive channels of one head of one token; its range is stored
  (two fp16 numbers) and the token's L applies to all its groups.

One rule for every group: lo and hi are the group's min and max rounded to fp16; with step = (hi - lo) / (L - 1)
in float32, q = clip(rint((x - lo) / step), 0, L - 1) (q = 0 when step is 0); x̂ = lo + q * step in float32.
Because the range does not depend on L, tokens of one key block may carry different L (a SemKV map) and still
share the block's side data.
"""

from __future__ import annotations

import numpy as np


def _code(x: np.ndarray, lo: np.ndarray, hi: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Codes of x (float32) on [lo, hi] with `levels` (all broadcast against x)."""
    lo32, hi32 = lo.astype(np.float32), hi.astype(np.float32)
    steps = (levels - 1).astype(np.float32)
    step = (hi32 - lo32) / steps
    safe = np.where(step > 0, step, np.float32(1.0))
    q = np.rint((x - lo32) / safe)
    q = np.where(step > 0, q, 0.0)
    return np.clip(q, 0, steps).astype(np.uint8)


def _value(codes: np.ndarray, lo: np.ndarray, hi: np.ndarray, levels: np.ndarray) -> np.ndarray:
    lo32, hi32 = lo.astype(np.float32), hi.astype(np.float32)
    step = (hi32 - lo32) / (levels - 1).astype(np.float32)
    return lo32 + codes.astype(np.float32) * step


def _check_levels(levels: np.ndarray) -> np.ndarray:
    levels = np.asarray(levels, dtype=np.int64)
    if levels.size and (levels.min() < 2 or levels.max() > 256):
        raise ValueError("affine KV quantization takes 2..256 levels")
    return levels


def _groups(x: np.ndarray, group: int) -> tuple[np.ndarray, int]:
    """[..., d] -> [..., n_groups, group], the last group padded with its last value (for the range only)."""
    d = x.shape[-1]
    if group < 1:
        raise ValueError(f"group must be positive, got {group}")
    n = -(-d // group)
    pad = n * group - d
    if pad:
        x = np.concatenate([x, np.repeat(x[..., -1:], pad, axis=-1)], axis=-1)
    return x.reshape(*x.shape[:-1], n, group), pad


def token_group_encode(x: np.ndarray, levels: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-token groups: x [N, H, d] float32, levels [N] -> codes [N, H, d] uint8, lo and hi [N, H, ceil(d/g)] fp16."""
    x = np.asarray(x, dtype=np.float32)
    levels = _check_levels(levels)
    g, _ = _groups(x, group)
    lo = g.min(axis=-1).astype(np.float16)
    hi = g.max(axis=-1).astype(np.float16)
    codes = _code(g, lo[..., None], hi[..., None], levels[:, None, None, None])
    codes = codes.reshape(*x.shape[:-1], -1)[..., : x.shape[-1]]
    return codes, lo, hi


def token_group_decode(codes: np.ndarray, levels: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                       group: int) -> np.ndarray:
    """Inverse of token_group_encode (float32 [N, H, d])."""
    levels = _check_levels(levels)
    d = codes.shape[-1]
    g, _ = _groups(codes, group)
    out = _value(g, lo[..., None], hi[..., None], levels[:, None, None, None])
    return out.reshape(*codes.shape[:-1], -1)[..., :d]


def channel_block_encode(x: np.ndarray, levels: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-channel groups over one block of tokens: x [T, H, d], levels [T] -> codes [T, H, d], lo/hi [H, d] fp16."""
    x = np.asarray(x, dtype=np.float32)
    levels = _check_levels(levels)
    lo = x.min(axis=0).astype(np.float16)
    hi = x.max(axis=0).astype(np.float16)
    return _code(x, lo[None], hi[None], levels[:, None, None]), lo, hi


def channel_block_decode(codes: np.ndarray, levels: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    levels = _check_levels(levels)
    return _value(codes, lo[None], hi[None], levels[:, None, None])


def channel_blocks_fake(x: np.ndarray, levels: np.ndarray, block: int) -> np.ndarray:
    """Keys of a whole sequence [T, H, d] quantized block by block (the last block may be short)."""
    out = np.empty_like(np.asarray(x, dtype=np.float32))
    for start in range(0, x.shape[0], block):
        sl = slice(start, start + block)
        codes, lo, hi = channel_block_encode(x[sl], levels[sl])
        out[sl] = channel_block_decode(codes, levels[sl], lo, hi)
    return out
