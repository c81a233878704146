"""A transformers `Cache` that stores the KV cache as base-L packed codes, at each token's own precision.

A `KVScheme` says how: the base quantizer (`affine`, `turbo`, or `fp16` for plain half precision), the two level
counts (low, high), a per-layer threshold on a write-time score (tokens scoring above it get the high count), the
seeds, the affine grouping and an optional full-precision recent window. `PackedKVCache` applies it token by
token:

- each new token's keys and values are rounded to fp16 (what a half-precision model would hand the cache), its
  level is chosen from its score, and it is held in fp16 until it may be quantized;
- values, and keys of the per-token bases (turbo), are quantized as soon as the token leaves the recent window
  (at once when the window is 0); affine keys are quantized per channel over blocks of `key_block` tokens, when a
  block is complete (KIVI: the open block stays in fp16);
- codes are packed per token with `accel.formats.bitpack.pack_base_levels` at that token's L; side data (fp16
  ranges, fp16 norms) and one flag bit per token (low or high) are stored beside them.

`stored_bytes()` adds up the arrays it really holds. For attention the cache also keeps a float32 copy of what the
stored codes decode to, written once per token from the packed bytes (a fused kernel would decode on the fly);
it is not storage and is not counted. `shadow=False` decodes every read from the packed bytes instead (slow; the
tests check both give the same attention inputs).

`simulate` is the exact parallel equivalent for a whole window: an attention function that quantizes the
window's keys and values with the same code and applies, per query position, the same "quantized yet?" rule.
Calibration sweeps and benchmarks use it to evaluate many windows fast; tests pin it to token-by-token decoding.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import Cache, DynamicLayer

from accel.errors import AccelError
from accel.formats.bitpack import pack_base_levels, unpack_base_levels
from accel.quantize import kv_affine, turboquant

BASES = ("affine", "turbo", "fp16")
RUNTIME_INDICATORS = ("key_norm", "value_norm")  # scores known when a token is written


@dataclass(frozen=True)
class KVScheme:
    base: str
    levels: tuple[int, int]  # (low, high); equal for a uniform scheme
    thresholds: tuple[float, ...] | None = None  # per layer; score > threshold -> high. None: all low
    indicator: str = "key_norm"
    seed: int = 0
    key_block: int = 32  # affine: tokens per per-channel key group
    value_group: int = 64  # affine: channels per per-token value group
    window: int = 0  # recent tokens kept in fp16 (values; and keys of the per-token bases)
    sink: int = 0  # the first `sink` tokens of the sequence stay in fp16 for good (attention sinks)
    # > 0: keys are coded pre-RoPE: un-rotated by their position with this RoPE base (default RoPE, the model's
    # rope_theta and head_dim) before coding, re-rotated on decode. 0: coded as the cache receives them.
    rope_theta: float = 0.0
    # per-layer channel means [layers, H, d] subtracted before per-token coding and added back on decode
    # (calibrated; None: no centering). Affine keys, coded per channel, need none. With rope_theta the key mean
    # is of pre-RoPE keys.
    key_mean: np.ndarray | None = field(default=None, compare=False, repr=False)
    value_mean: np.ndarray | None = field(default=None, compare=False, repr=False)
    # per-layer channel scales [layers, H, d] (> 0) that centered keys are divided by before per-token coding and
    # multiplied by on decode (smoothing, as in VecInfer; calibrated; None: none). Per-token bases only.
    key_scale: np.ndarray | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.base not in BASES:
            raise ValueError(f"unknown KV base quantizer {self.base!r}")
        if self.indicator not in RUNTIME_INDICATORS:
            raise ValueError(f"unknown runtime indicator {self.indicator!r}")
        if self.sink < 0 or self.window < 0:
            raise ValueError("sink and window must be non-negative")
        if self.rope_theta < 0:
            raise ValueError("rope_theta must be positive (or 0: keys coded post-RoPE)")
        if self.key_scale is not None and not self.per_token_keys:
            raise ValueError("key_scale smooths per-token key coding; affine keys are coded per channel")

    @property
    def per_token_keys(self) -> bool:
        return self.base != "affine"

    def layer_seed(self, layer: int, which: int) -> int:
        """The rotation seed of one layer's keys (which=0) or values (which=1)."""
        return (self.seed * 1_000_003 + layer * 2 + which) % (2**63)

    def token_levels(self, layer: int, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Levels of N tokens from their fp16-rounded keys and values [N, H, d]."""
        lo, hi = self.levels
        if self.thresholds is None or lo == hi:
            return np.full(k.shape[0], lo, dtype=np.int64)
        s = token_score(self.indicator, k, v)
        return np.where(s > self.thresholds[layer], hi, lo).astype(np.int64)

    # -- the two quantizers, shared by the cache and the simulation --------------------------------------------
    def keys_in(self, k: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Keys as the cache receives them [N, H, d] -> the space they are coded in (pre-RoPE with rope_theta)."""
        k = np.asarray(k, dtype=np.float32)
        return rope_rotate(k, positions, self.rope_theta, inverse=True) if self.rope_theta else k

    def keys_out(self, k: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Inverse of keys_in: decoded keys back to the space attention reads (RoPE applied again)."""
        return rope_rotate(k, positions, self.rope_theta) if self.rope_theta else k

    def encode_tokens(self, layer: int, which: int, x: np.ndarray, levels: np.ndarray,
                      positions: np.ndarray | None = None) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
        """Per-token coding (values; turbo keys): codes [N, H, d] and side arrays. Keys need their positions."""
        x = np.asarray(x, dtype=np.float32)
        if which == 0:
            x = self.keys_in(x, positions)
        mean = self._mean(layer, which)
        if mean is not None:
            x = x - mean
        if which == 0 and self.key_scale is not None:
            x = x / np.asarray(self.key_scale[layer], dtype=np.float32)
        if self.base == "turbo":
            codes, norms = turboquant.encode(x, levels, self.layer_seed(layer, which))
            return codes, (norms,)
        codes, lo, hi = kv_affine.token_group_encode(x, levels, self.value_group)
        return codes, (lo, hi)

    def decode_tokens(self, layer: int, which: int, codes: np.ndarray, levels: np.ndarray,
                      side: tuple[np.ndarray, ...], positions: np.ndarray | None = None) -> np.ndarray:
        if self.base == "turbo":
            out = turboquant.decode(codes, levels, side[0], self.layer_seed(layer, which))
        else:
            out = kv_affine.token_group_decode(codes, levels, side[0], side[1], self.value_group)
        if which == 0 and self.key_scale is not None:
            out = out * np.asarray(self.key_scale[layer], dtype=np.float32)
        mean = self._mean(layer, which)
        if mean is not None:
            out = out + mean
        return self.keys_out(out, positions) if which == 0 else out

    def key_blocks(self, length: int) -> list[range]:
        """The affine key blocks of a sequence: `key_block` tokens each, starting after the sink tokens."""
        return [range(start, min(start + self.key_block, length))
                for start in range(self.sink, length, self.key_block)]

    def _mean(self, layer: int, which: int) -> np.ndarray | None:
        means = self.value_mean if which else self.key_mean
        return None if means is None else np.asarray(means[layer], dtype=np.float32)

    def fake_quantize(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A whole sequence [T, H, d] (fp16-rounded, positions 0..T-1) -> (keys, values) as their stored codes
        decode (sink tokens: as given), levels."""
        levels = self.token_levels(layer, k, v)
        if self.base == "fp16":
            return k, v, levels
        pos = np.arange(k.shape[0])
        vq = self.decode_tokens(layer, 1, *_split(self.encode_tokens(layer, 1, v, levels), levels))
        if self.per_token_keys:
            codes, side = self.encode_tokens(layer, 0, k, levels, pos)
            kq = self.decode_tokens(layer, 0, codes, levels, side, pos)
        else:
            kq = np.array(k, dtype=np.float32)
            for block in self.key_blocks(k.shape[0]):
                sl = slice(block.start, block.stop)
                codes, lo, hi = kv_affine.channel_block_encode(self.keys_in(k[sl], pos[sl]), levels[sl])
                kq[sl] = self.keys_out(kv_affine.channel_block_decode(codes, levels[sl], lo, hi), pos[sl])
        kq[: self.sink], vq[: self.sink] = k[: self.sink], v[: self.sink]
        return kq, vq, levels

    def quantized_masks(self, length: int) -> tuple[np.ndarray, np.ndarray]:
        """[query t, key s] -> is token s read quantized at step t (keys, values), for a causal window."""
        t = np.arange(length)[:, None]
        s = np.arange(length)[None, :]
        if self.base == "fp16":
            none = np.zeros((length, length), dtype=bool)
            return none, none
        mv = (s <= t - self.window) & (s >= self.sink)
        if self.per_token_keys:
            mk = mv
        else:
            block_end = ((s - self.sink) // self.key_block + 1) * self.key_block + self.sink
            mk = (s >= self.sink) & (block_end <= t + 1)
        return mk, mv


def rope_cos_sin(positions: np.ndarray, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [N, head_dim] float32 of default RoPE, computed as transformers' LlamaRotaryEmbedding does
    (inv_freq = 1 / theta^(2i/d) in float32, freqs = position * inv_freq in float32, halves repeated)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.as_tensor(np.asarray(positions)).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().numpy(), emb.sin().numpy()


def rope_rotate(x: np.ndarray, positions: np.ndarray, theta: float, inverse: bool = False) -> np.ndarray:
    """Apply default RoPE to x [N, H, d] at `positions` [N] (inverse: undo it; the rotation by -angle)."""
    x = np.asarray(x, dtype=np.float32)
    cos, sin = rope_cos_sin(positions, x.shape[-1], theta)
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)  # transformers' rotate_half
    return x * cos - rot * sin if inverse else x * cos + rot * sin


def _split(encoded: tuple[np.ndarray, tuple[np.ndarray, ...]], levels: np.ndarray):
    codes, side = encoded
    return codes, levels, side


def token_score(indicator: str, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Write-time token score [N] from keys/values [N, H, d]: the mean over heads of the vector norm."""
    x = k if indicator == "key_norm" else v
    x = np.asarray(x, dtype=np.float64)
    return np.sqrt((x * x).sum(axis=-1)).mean(axis=-1)


def round_fp16(x: torch.Tensor) -> np.ndarray:
    return x.detach().to(torch.float16).to(torch.float32).cpu().numpy()


# ---------------------------------------------------------------------------------------------------------------
# The cache


@dataclass
class _Row:
    """Storage of one batch row of one layer: exactly what is kept, nothing derived."""

    fp_k: dict[int, np.ndarray] = field(default_factory=dict)  # token -> fp16 [H, d], not yet quantized
    fp_v: dict[int, np.ndarray] = field(default_factory=dict)
    k_codes: dict[int, np.ndarray] = field(default_factory=dict)  # token -> packed base-L bytes
    v_codes: dict[int, np.ndarray] = field(default_factory=dict)
    k_side: dict[int, tuple[np.ndarray, ...]] = field(default_factory=dict)  # token (or affine block) -> arrays
    v_side: dict[int, tuple[np.ndarray, ...]] = field(default_factory=dict)
    flags: bytearray = field(default_factory=bytearray)  # bit t: token t is at the high level
    length: int = 0
    closed_blocks: int = 0

    def level(self, scheme: KVScheme, t: int) -> int:
        if scheme.levels[0] == scheme.levels[1]:
            return scheme.levels[0]
        return scheme.levels[(self.flags[t >> 3] >> (t & 7)) & 1]

    def set_flag(self, t: int, high: bool) -> None:
        if t >> 3 >= len(self.flags):
            self.flags.append(0)
        if high:
            self.flags[t >> 3] |= 1 << (t & 7)

    def nbytes(self) -> dict[str, int]:
        side = sum(a.nbytes for d in (self.k_side, self.v_side) for arrs in d.values() for a in arrs)
        return {"codes": sum(a.nbytes for d in (self.k_codes, self.v_codes) for a in d.values()),
                "side": side + len(self.flags),
                "fp16": sum(a.nbytes for d in (self.fp_k, self.fp_v) for a in d.values())}


class PackedKVLayer(DynamicLayer):
    """One layer of a PackedKVCache. `keys`/`values` hold the decoded float32 view for attention."""

    is_croppable = False

    def __init__(self, scheme: KVScheme, layer_idx: int, shadow: bool = True):
        super().__init__()
        self.scheme, self.layer_idx, self.shadow = scheme, layer_idx, shadow
        self.rows: list[_Row] = []
        self._kbuf = self._vbuf = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        b, h, _, d = key_states.shape
        self.rows = [_Row() for _ in range(b)]
        self._kbuf = torch.zeros(b, h, 64, d, dtype=self.dtype)
        self._vbuf = torch.zeros(b, h, 64, d, dtype=self.dtype)
        self.is_initialized = True

    def _grow(self, length: int) -> None:
        cap = self._kbuf.shape[2]
        if length <= cap:
            return
        new = max(length, 2 * cap)
        for name in ("_kbuf", "_vbuf"):
            old = getattr(self, name)
            buf = torch.zeros(old.shape[0], old.shape[1], new, old.shape[3], dtype=old.dtype)
            buf[:, :, :cap] = old
            setattr(self, name, buf)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        k16, v16 = round_fp16(key_states), round_fp16(value_states)
        start = self.rows[0].length
        self._grow(start + k16.shape[2])
        for s in range(k16.shape[2]):
            for b, row in enumerate(self.rows):
                self._append(b, row, k16[b, :, s], v16[b, :, s])
        length = self.rows[0].length
        if self.shadow:
            self.keys, self.values = self._kbuf[:, :, :length], self._vbuf[:, :, :length]
        else:
            self.keys, self.values = self.materialize()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.rows[0].length if self.rows else 0

    # -- storage ---------------------------------------------------------------------------------------------
    def _append(self, b: int, row: _Row, k: np.ndarray, v: np.ndarray) -> None:
        sc, layer = self.scheme, self.layer_idx
        t = row.length
        level = int(sc.token_levels(layer, k[None], v[None])[0])
        if sc.levels[0] != sc.levels[1]:  # a uniform scheme stores no flags
            row.set_flag(t, level != sc.levels[0])
        row.fp_k[t], row.fp_v[t] = k.astype(np.float16), v.astype(np.float16)
        self._kbuf[b, :, t] = torch.from_numpy(k)
        self._vbuf[b, :, t] = torch.from_numpy(v)
        row.length = t + 1
        if sc.base == "fp16":
            return
        ready = t - sc.window  # the token that leaves the recent window now; sink tokens stay fp16
        if ready >= sc.sink:
            self._quantize_token(b, row, 1, ready)
            if sc.per_token_keys:
                self._quantize_token(b, row, 0, ready)
        after_sink = row.length - sc.sink
        if not sc.per_token_keys and after_sink > 0 and after_sink % sc.key_block == 0:
            self._close_key_block(b, row, after_sink // sc.key_block - 1)

    def _quantize_token(self, b: int, row: _Row, which: int, t: int) -> None:
        sc = self.scheme
        fp = row.fp_v if which else row.fp_k
        x = fp.pop(t).astype(np.float32)
        level = row.level(sc, t)
        codes, side = sc.encode_tokens(self.layer_idx, which, x[None], np.array([level]), np.array([t]))
        store_codes, store_side = (row.v_codes, row.v_side) if which else (row.k_codes, row.k_side)
        store_codes[t] = pack_base_levels(codes, level)
        store_side[t] = tuple(a[0] for a in side)
        if self.shadow:
            buf = self._vbuf if which else self._kbuf
            buf[b, :, t] = torch.from_numpy(self._decode_token(row, which, t))

    def _decode_token(self, row: _Row, which: int, t: int) -> np.ndarray:
        sc = self.scheme
        level = row.level(sc, t)
        h, d = self._kbuf.shape[1], self._kbuf.shape[3]
        stored = (row.v_codes if which else row.k_codes)[t]
        codes = unpack_base_levels(stored, level, h * d).reshape(1, h, d)
        side = tuple(a[None] for a in (row.v_side if which else row.k_side)[t])
        return sc.decode_tokens(self.layer_idx, which, codes, np.array([level]), side, np.array([t]))[0]

    def _close_key_block(self, b: int, row: _Row, block: int) -> None:
        sc = self.scheme
        tokens = self._block_tokens(block)
        x = np.stack([row.fp_k.pop(t) for t in tokens]).astype(np.float32)
        levels = np.array([row.level(sc, t) for t in tokens])
        codes, lo, hi = kv_affine.channel_block_encode(sc.keys_in(x, np.array(tokens)), levels)
        for i, t in enumerate(tokens):
            row.k_codes[t] = pack_base_levels(codes[i], int(levels[i]))
        row.k_side[block] = (lo, hi)
        row.closed_blocks = block + 1
        if self.shadow:
            self._kbuf[b, :, tokens.start:tokens.stop] = torch.from_numpy(
                self._decode_key_block(row, block).transpose(1, 0, 2))

    def _block_tokens(self, block: int) -> range:
        sc = self.scheme
        start = sc.sink + block * sc.key_block
        return range(start, start + sc.key_block)

    def _decode_key_block(self, row: _Row, block: int) -> np.ndarray:
        sc = self.scheme
        h, d = self._kbuf.shape[1], self._kbuf.shape[3]
        tokens = self._block_tokens(block)
        levels = np.array([row.level(sc, t) for t in tokens])
        codes = np.stack([unpack_base_levels(row.k_codes[t], int(levels[i]), h * d).reshape(h, d)
                          for i, t in enumerate(tokens)])
        lo, hi = row.k_side[block]
        return sc.keys_out(kv_affine.channel_block_decode(codes, levels, lo, hi), np.array(tokens))

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, H, T, d] decoded from the stored bytes alone."""
        sc = self.scheme
        h, d = self._kbuf.shape[1], self._kbuf.shape[3]
        keys = np.zeros((len(self.rows), h, self.rows[0].length, d), dtype=np.float32)
        values = np.zeros_like(keys)
        for b, row in enumerate(self.rows):
            for t in range(row.length):
                values[b, :, t] = row.fp_v[t] if t in row.fp_v else self._decode_token(row, 1, t)
                if t in row.fp_k:
                    keys[b, :, t] = row.fp_k[t]
                elif sc.per_token_keys:
                    keys[b, :, t] = self._decode_token(row, 0, t)
            for block in range(row.closed_blocks if not sc.per_token_keys else 0):
                tokens = self._block_tokens(block)
                keys[b, :, tokens.start:tokens.stop] = self._decode_key_block(row, block).transpose(1, 0, 2)
        return torch.from_numpy(keys).to(self.dtype), torch.from_numpy(values).to(self.dtype)

    def stored_bytes(self) -> dict[str, int]:
        total = {"codes": 0, "side": 0, "fp16": 0}
        for row in self.rows:
            for key, n in row.nbytes().items():
                total[key] += n
        return total

    def high_tokens(self) -> int:
        return sum(byte.bit_count() for row in self.rows for byte in row.flags)


class PackedKVCache(Cache):
    """The whole model's KV cache under one scheme (one PackedKVLayer per attention layer)."""

    def __init__(self, scheme: KVScheme, num_layers: int, shadow: bool = True):
        super().__init__(layers=[PackedKVLayer(scheme, i, shadow) for i in range(num_layers)])
        self.scheme = scheme

    def stored_bytes(self) -> dict[str, int]:
        total = {"codes": 0, "side": 0, "fp16": 0}
        for layer in self.layers:
            for key, n in layer.stored_bytes().items():
                total[key] += n
        total["total"] = sum(total.values())
        return total

    def tokens(self) -> int:
        """Token positions stored (batch rows times sequence length)."""
        layer = self.layers[0]
        return len(layer.rows) * layer.get_seq_length() if layer.is_initialized else 0

    def high_fraction(self) -> float:
        cells = self.tokens() * len(self.layers)
        return sum(layer.high_tokens() for layer in self.layers) / cells if cells else 0.0


def fp16_bytes_per_token(config: Any) -> int:
    """K and V of every layer at 2 bytes a value."""
    cfg = config if isinstance(config, dict) else config.to_dict()
    layers, kv_heads, head_dim = model_kv_shape(cfg)
    return 2 * 2 * layers * kv_heads * head_dim


def rope_theta_of(config: Any) -> float | None:
    """The RoPE base of a decoder config when it uses plain (default) RoPE on the whole head; None otherwise
    (scaled or partial RoPE: pre-RoPE key coding is not offered there)."""
    cfg = config if isinstance(config, dict) else config.to_dict()
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default" or float(cfg.get("partial_rotary_factor", 1.0) or 1.0) != 1.0:
        return None
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def model_kv_shape(config: dict[str, Any]) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a decoder config whose every layer is full attention (AccelError for a
    hybrid with linear-attention layers: the KV cache and maps here index every layer as an attention layer)."""
    from accel.runtime.state_shapes import GDN_TYPES, KDA_TYPES, state_shape

    if config.get("model_type") in (*GDN_TYPES, *KDA_TYPES):
        linear = state_shape(config).layers
        if linear:
            raise AccelError(f"KV maps and KV caches need a model whose every layer is full attention; this "
                             f"{config.get('model_type')} model has {len(linear)} linear-attention layers of "
                             f"{config.get('num_hidden_layers')} (their recurrent state takes a --state map)")
    layers = int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    return layers, kv_heads, head_dim


# ---------------------------------------------------------------------------------------------------------------
# The parallel equivalent


_SIM_NAME = "accel_kv_sim"
_ACTIVE: list[Any] = []  # the simulation in progress (a stack of one)


@dataclass
class SimRecord:
    """What a simulation saw: per layer, tokens and tokens at the high level."""

    tokens: np.ndarray
    high: np.ndarray


def _sim_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    scheme, record, observer = _ACTIVE[-1]
    layer = module.layer_idx
    bsz, kv_heads, length, dim = key.shape
    groups = query.shape[1] // kv_heads
    scale = scaling if scaling is not None else dim ** -0.5
    k16, v16 = round_fp16(key), round_fp16(value)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    outs = []
    for b in range(bsz):
        kb, vb = k16[b].transpose(1, 0, 2), v16[b].transpose(1, 0, 2)  # [T, H, d]
        q = query[b].float()  # [Hq, T, d]
        if observer is not None:
            observer(layer, q, torch.from_numpy(kb), torch.from_numpy(vb), scale)
        if scheme is None:
            kq, vq, mk, mv = kb, vb, np.zeros((length, length), bool), np.zeros((length, length), bool)
        else:
            kq, vq, levels = scheme.fake_quantize(layer, kb, vb)
            record.tokens[layer] += length
            if scheme.levels[0] != scheme.levels[1]:
                record.high[layer] += int((levels == scheme.levels[1]).sum())
            mk, mv = scheme.quantized_masks(length)

        def heads(x):  # [T, H, d] numpy -> [Hq, T, d]
            return torch.from_numpy(np.ascontiguousarray(x.transpose(1, 0, 2))).repeat_interleave(groups, 0)

        mk_t, mv_t = torch.from_numpy(mk), torch.from_numpy(mv)
        scores = q @ heads(kq).transpose(1, 2)
        if not bool(mk_t[causal].all()):
            scores = torch.where(mk_t, scores, q @ heads(kb).transpose(1, 2))
        scores = (scores * scale).masked_fill(~causal, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        out = (probs * mv_t) @ heads(vq)
        if not bool(mv_t[causal].all()):
            out = out + (probs * ~mv_t) @ heads(vb)
        outs.append(out)
    out = torch.stack(outs).to(query.dtype)  # [B, Hq, T, d]
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def simulate(model: torch.nn.Module, scheme: KVScheme | None, observer=None):
    """Within the block, a full forward of `model` reads K/V exactly as a PackedKVCache would serve them.

    scheme None: full precision (fp16-rounded K/V), e.g. to let `observer(layer, q, k, v, scale)` see the
    attention inputs of every layer. Yields a SimRecord.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(_SIM_NAME, _sim_attention)
    config = model.config
    layers = int(config.num_hidden_layers)
    record = SimRecord(np.zeros(layers, dtype=np.int64), np.zeros(layers, dtype=np.int64))
    previous = config._attn_implementation
    _ACTIVE.append((scheme, record, observer))
    config._attn_implementation = _SIM_NAME
    try:
        yield record
    finally:
        config._attn_implementation = previous
        _ACTIVE.pop()
