"""The ANE-friendly Llama that accel owns: (B, C, 1, S) activations, 1x1 convolutions, fp16 KV-cache states.

It serves the Llama family: Llama, Mistral, Qwen2 and Qwen3 decoders differ only in projection biases, a per-head
RMSNorm of queries and keys (Qwen3) and sliding-window layers, which `llama_dims` reads from transformers' own
model for the config, so that the ANE model and the reference agree by construction.

One definition serves as the PyTorch reference (float32) and as what coremltools traces (fp16). Every choice
here is about how the Neural Engine wants a computation expressed (docs/ane.md, "The model definition"):
- activations are (1, C, 1, S): channels on axis 1, sequence on the last axis; projections are 1x1 convolutions;
- RMSNorm is one `layer_norm` over [x, -x] (a custom op, so the trace keeps it as one op);
- the KV cache is one fp16 state per layer and per K/V, shaped (1, kv_heads, head_dim, context), written with a
  one-hot placement matmul instead of a dynamic-index scatter, so the blocks hold no gathers and no int tensors;
- the LM head is split into pieces of at most 16,384 rows; for tied embeddings the same pieces are the
  embedding table, so the package stores the matrix once.
Positions, masks and rotary tables are computed once in the prologue, outside the blocks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from accel.errors import AccelError

# The largest size of any one tensor dimension the Neural Engine takes (see placement.py, rule "dim-limit").
ANE_MAX_DIM = 16384

SUPPORTED_ARCHITECTURES = {"llama": ("LlamaForCausalLM",), "mistral": ("MistralForCausalLM",),
                           "qwen2": ("Qwen2ForCausalLM",), "qwen3": ("Qwen3ForCausalLM",)}
MASK_NEG = -1.0e4  # additive mask: exp(-1e4) is 0 in fp16, and -1e4 stays finite in fp16 arithmetic


@dataclass(frozen=True)
class LlamaDims:
    """The shape of a Llama-family decoder, read from its Hugging Face config."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    tied: bool
    max_positions: int
    config: dict[str, Any]
    biases: tuple[str, ...] = ()          # the projections (AneBlock.PROJECTIONS short names) that have a bias
    qk_norm: bool = False                 # a per-head RMSNorm of queries and keys before RoPE (Qwen3)
    windows: tuple[int | None, ...] = ()  # per layer: the sliding window (keys p - w < k <= p), None for full
    rope_switch: int | None = None  # longrope: past this sequence length transformers moves every position to its
    #                                 long factors, which no fixed table can follow (check_ane_shapes)

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads

    @property
    def head_pieces(self) -> list[tuple[int, int]]:
        """Row ranges [start, end) of the LM head pieces: as few as the 16,384 limit allows, equal sizes."""
        count = -(-self.vocab // ANE_MAX_DIM)
        size = -(-self.vocab // count)
        return [(s, min(s + size, self.vocab)) for s in range(0, self.vocab, size)]

    def window(self, layer: int) -> int | None:
        return self.windows[layer] if self.windows else None

    def vector_count(self) -> int:
        """Values of the model's vectors (RMSNorm weights, biases): what the package stores as plain fp16."""
        widths = {"q": self.heads * self.head_dim, "k": self.kv_heads * self.head_dim,
                  "v": self.kv_heads * self.head_dim, "o": self.hidden, "gate": self.intermediate,
                  "up": self.intermediate, "down": self.hidden}
        per_layer = 2 * self.hidden + sum(widths[b] for b in self.biases) + (2 * self.head_dim if self.qk_norm else 0)
        return self.layers * per_layer + self.hidden

    def param_count(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * (attn + mlp) + embed + self.vector_count()


def llama_dims(config: dict[str, Any]) -> LlamaDims:
    """Validate that `config` is a Llama-family model this exporter handles; refuse anything else by name.

    Biases, query/key norms and sliding windows are read from transformers' own (empty) model for the config,
    not from config keys, whose meaning differs between architectures."""
    from accel.converters.materialize import empty_model

    model_type = config.get("model_type")
    archs = config.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise AccelError(f"the model config's architectures {archs!r} is not a list of class names")
    arch = archs[0] if archs else model_type
    if model_type not in SUPPORTED_ARCHITECTURES or (archs and arch not in SUPPORTED_ARCHITECTURES[model_type]):
        supported = ", ".join(a for v in SUPPORTED_ARCHITECTURES.values() for a in v)
        raise AccelError(f"unsupported architecture {arch!r} (model_type {model_type!r}): export-ane handles "
                         f"Llama-family decoders ({supported})")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise AccelError(f"unsupported architecture {arch!r} with hidden_act={act!r}: export-ane emits silu")
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    if heads % kv_heads:
        raise AccelError(f"{arch}: {heads} attention heads is not a multiple of {kv_heads} KV heads")
    model = empty_model(config)
    features = [_layer_features(layer, model.config) for layer in model.model.layers]
    biases, qk_norm, _ = features[0]
    if any(f[:2] != (biases, qk_norm) for f in features):
        raise AccelError(f"unsupported architecture {arch!r}: its layers differ in biases or norms")
    windows = tuple(f[2] for f in features)
    if any(w is not None and w < 1 for w in windows):
        raise AccelError(f"{arch}: sliding_window {min(w for w in windows if w is not None)} must be at least 1 "
                         f"(a window of none masks every key)")
    rope = getattr(model.config, "rope_parameters", None) or {}
    switch = rope.get("original_max_position_embeddings") if rope.get("rope_type") == "longrope" else None
    return LlamaDims(vocab=int(config["vocab_size"]), hidden=hidden, intermediate=int(config["intermediate_size"]),
                     layers=int(config["num_hidden_layers"]), heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                     eps=float(config.get("rms_norm_eps", 1e-6)), tied=bool(config.get("tie_word_embeddings")),
                     max_positions=int(config.get("max_position_embeddings", 2048)), config=dict(config),
                     biases=biases, qk_norm=qk_norm, windows=windows,
                     rope_switch=None if switch is None else int(switch))


def _layer_features(layer: nn.Module, config: Any) -> tuple[tuple[str, ...], bool, int | None]:
    """(projections with a bias, per-head q/k norm, sliding window) of one transformers decoder layer. Mistral
    keeps its window in the config for every layer; Qwen2/Qwen3 set it per layer (None on full-attention ones)."""
    biases = tuple(name for name, hf in AneBlock.PROJECTIONS if layer.get_submodule(hf).bias is not None)
    attn = layer.self_attn
    window = attn.sliding_window if hasattr(attn, "sliding_window") else getattr(config, "sliding_window", None)
    return biases, hasattr(attn, "q_norm"), None if window is None else int(window)


def rotary_tables(dims: LlamaDims, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin, (positions, head_dim) float32, exactly as the model's own transformers rotary embedding
    computes them for a sequence of `positions` tokens (rope scaling included). One call for all rows: dynamic and
    longrope scalings pick their frequencies by that sequence length, so a table for more positions than the
    model will see (the padding row) would change every row."""
    from accel.converters.materialize import empty_model

    rope = empty_model(dims.config).model.rotary_emb
    pos = torch.arange(positions, dtype=torch.int64)[None]
    with torch.no_grad():
        cos, sin = rope(torch.zeros(1, dtype=torch.float32), pos)
    return cos[0].numpy().astype(np.float32), sin[0].numpy().astype(np.float32)


# RMSNorm as one layer_norm over [x, -x] along the channel axis: the mean of [x, -x] is 0 and its variance is
# mean(x^2), so layer_norm returns x / sqrt(mean(x^2) + eps) in the first half. The custom op keeps the trace to
# one node, which accel's converter lowers to concat -> layer_norm -> slice (see export.py).
@torch.library.custom_op("accel::rms_norm_ane", mutates_args=())
def rms_norm_ane(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=1, keepdim=True) + eps)


@rms_norm_ane.register_fake
def _rms_norm_ane_fake(x: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x)


def conv1x1(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.conv2d(x, weight, bias)


def head_norm(x: torch.Tensor, weight: torch.Tensor, heads: int, head_dim: int, eps: float) -> torch.Tensor:
    """Qwen3's per-head RMSNorm of a projection's output (1, heads * head_dim, 1, S): the heads become the batch
    axis, so that the norm is the same channel-axis layer_norm as every other (a reshape, no transpose)."""
    x = x.reshape(heads, head_dim, 1, -1)
    return (rms_norm_ane(x, eps) * weight).reshape(1, heads, head_dim, -1)


class AneBlock(nn.Module):
    """One decoder layer; its own module so that traced ops carry an "AneBlock" scope (placement block_ops)."""

    PROJECTIONS = (("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"),
                   ("o", "self_attn.o_proj"), ("gate", "mlp.gate_proj"), ("up", "mlp.up_proj"),
                   ("down", "mlp.down_proj"))

    def __init__(self, dims: LlamaDims, layer: int, weight: Callable[[str], np.ndarray]):
        super().__init__()
        self.dims = dims
        prefix = f"model.layers.{layer}."
        for name, hf in self.PROJECTIONS:
            setattr(self, name, conv_param(weight(prefix + hf + ".weight")))
            bias = nn.Parameter(_tensor(weight(prefix + hf + ".bias")), requires_grad=False) \
                if name in dims.biases else None
            setattr(self, name + "_bias", bias)
        self.attn_norm = norm_param(weight(prefix + "input_layernorm.weight"))
        self.mlp_norm = norm_param(weight(prefix + "post_attention_layernorm.weight"))
        self.q_norm = norm_param(weight(prefix + "self_attn.q_norm.weight")) if dims.qk_norm else None
        self.k_norm = norm_param(weight(prefix + "self_attn.k_norm.weight")) if dims.qk_norm else None

    def project(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return conv1x1(x, getattr(self, name), getattr(self, name + "_bias"))

    def forward(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                rotary: tuple[torch.Tensor, ...], mask: torch.Tensor, write: torch.Tensor,
                keep: torch.Tensor) -> torch.Tensor:
        d = self.dims
        q_cos, q_sin, cos, sin = rotary
        h = rms_norm_ane(x, d.eps) * self.attn_norm
        q, k = self.project("q", h), self.project("k", h)
        if d.qk_norm:
            q = head_norm(q, self.q_norm, d.heads, d.head_dim, d.eps)
            k = head_norm(k, self.k_norm, d.kv_heads, d.head_dim, d.eps)
        q = rope(q.reshape(1, d.heads, d.head_dim, -1), q_cos, q_sin, d.head_dim // 2)
        k = rope(k.reshape(1, d.kv_heads, d.head_dim, -1), cos, sin, d.head_dim // 2)
        v = self.project("v", h).reshape(1, d.kv_heads, d.head_dim, -1)
        k_all = k_cache * keep + torch.matmul(k, write)                              # (1, kvh, hd, ctx)
        v_all = v_cache * keep + torch.matmul(v, write)
        k_cache[:, :, :, :] = k_all                                                 # the state writes
        v_cache[:, :, :, :] = v_all
        # The query heads of one KV head become rows (s, g): one batched matmul per KV head, K never repeated.
        # (1/sqrt(head_dim) is already in the query's rotary tables.)
        q = q.reshape(1, d.kv_heads, d.groups * d.head_dim, -1).transpose(2, 3)
        q = q.reshape(1, d.kv_heads, -1, d.head_dim)
        p = torch.softmax(torch.matmul(q, k_all) + mask, dim=-1)                    # (1, kvh, S*g, ctx)
        o = torch.matmul(p, v_all.transpose(2, 3))                                  # (1, kvh, S*g, hd)
        o = o.reshape(1, d.kv_heads, -1, d.groups * d.head_dim).transpose(2, 3)
        x = x + self.project("o", o.reshape(1, d.heads * d.head_dim, 1, -1))
        h = rms_norm_ane(x, d.eps) * self.mlp_norm
        return x + self.project("down", F.silu(self.project("gate", h)) * self.project("up", h))


class AneLlama(nn.Module):
    """Llama decoder on (1, C, 1, S) activations with a per-layer fp16 KV-cache state of `context` positions.

    forward(input_ids (1, S) int32, position_ids (1, S) int32) -> one logits piece per head piece, each
    (1, piece_rows, 1, S). A row whose position id is `context` is padding: it writes nothing to the cache.
    No shape is ever read from a tensor (a trace would record it as integer ops): sizes come from dims or are -1.
    """

    def __init__(self, dims: LlamaDims, context: int, weight: Callable[[str], np.ndarray]):
        super().__init__()
        self.dims, self.context = dims, context
        head_name = "model.embed_tokens.weight" if dims.tied else "lm_head.weight"
        head = weight(head_name)
        self.head = nn.ParameterList([conv_param(head[a:b]) for a, b in dims.head_pieces])
        self.embed = None if dims.tied else nn.Parameter(_tensor(weight("model.embed_tokens.weight")),
                                                         requires_grad=False)
        self.blocks = nn.ModuleList([AneBlock(dims, i, weight) for i in range(dims.layers)])
        self.final_norm = norm_param(weight("model.norm.weight"))
        # Rotate-half tables repeat their first half; only that half is stored. The padding row (position
        # `context`) writes nothing and its logits are not read: it repeats the last row.
        cos, sin = (np.concatenate([t, t[-1:]]) for t in rotary_tables(dims, context))
        half = dims.head_dim // 2
        self.register_buffer("rope_cos", torch.from_numpy(np.ascontiguousarray(cos[:, :half])), persistent=False)
        self.register_buffer("rope_sin", torch.from_numpy(np.ascontiguousarray(sin[:, :half])), persistent=False)
        for name in self.cache_names:
            self.register_buffer(name, torch.zeros(self.cache_shape), persistent=False)

    @property
    def cache_shape(self) -> tuple[int, int, int, int]:
        return (1, self.dims.kv_heads, self.dims.head_dim, self.context)

    @property
    def cache_names(self) -> list[str]:
        return [f"{kv}_cache_{i}" for i in range(self.dims.layers) for kv in ("k", "v")]

    def reset_cache(self) -> None:
        for name in self.cache_names:
            getattr(self, name).zero_()

    def attention_mask(self, keys: torch.Tensor, pos: torch.Tensor, window: int | None,
                       dtype: torch.dtype) -> torch.Tensor:
        """The additive mask (0 or -1e4), rows (s, g): causal, and with a sliding window only the last `window`
        positions (transformers' sliding_window_overlay: p - window < k <= p)."""
        visible = keys[None, :] <= pos[:, None]                                     # (S, ctx)
        if window is not None and window < self.context:
            visible = visible & (keys[None, :] > pos[:, None] - window)
        mask = (visible.to(dtype) - 1.0) * -MASK_NEG                             # 0 or -1e4
        return mask[:, None, :].repeat(1, self.dims.groups, 1).reshape(-1, self.context)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """(S,) ids -> (1, hidden, 1, S); with tied weights, a masked gather from each head piece."""
        if self.embed is not None:
            rows = self.embed[ids]
        else:
            rows = None
            for (start, end), piece in zip(self.dims.head_pieces, self.head, strict=True):
                local = torch.clamp(ids - start, 0, end - start - 1)
                inside = ((ids >= start) & (ids < end)).to(piece.dtype)
                part = piece[local][:, :, 0, 0] * inside[:, None]
                rows = part if rows is None else rows + part
        return rows.transpose(0, 1).reshape(1, self.dims.hidden, 1, -1)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        d = self.dims
        # Prologue: every gather and integer op of the model is here, computed once for all blocks.
        ids, pos = input_ids[0], position_ids[0]
        x = self.embed_tokens(ids)
        c, s = self.rope_cos[pos], self.rope_sin[pos]                               # (S, head_dim / 2)
        cos = torch.cat([c, c], dim=1).transpose(0, 1).reshape(1, 1, d.head_dim, -1)
        sin = torch.cat([-s, s], dim=1).transpose(0, 1).reshape(1, 1, d.head_dim, -1)  # rotate-half's sign
        scale = 1.0 / math.sqrt(d.head_dim)                                         # attention's, on q only
        rotary = (cos * scale, sin * scale, cos, sin)
        keys = torch.arange(self.context, dtype=pos.dtype)
        masks = {w: self.attention_mask(keys, pos, w, x.dtype) for w in dict.fromkeys(map(d.window, range(d.layers)))}
        write = (keys[None, :] == pos[:, None]).to(x.dtype)                         # one-hot (S, ctx)
        keep = (1.0 - write.sum(dim=0)).reshape(1, 1, 1, self.context)
        for i, block in enumerate(self.blocks):
            x = block(x, getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}"), rotary, masks[d.window(i)],
                      write, keep)
        h = rms_norm_ane(x, d.eps) * self.final_norm
        return tuple(conv1x1(h, piece) for piece in self.head)


def _tensor(w: np.ndarray) -> torch.Tensor:
    a = np.ascontiguousarray(w, dtype=np.float32)
    return torch.from_numpy(a if a.flags.writeable else a.copy())


def conv_param(w: np.ndarray) -> nn.Parameter:
    """A (out, in) matrix as a 1x1 conv weight (out, in, 1, 1)."""
    return nn.Parameter(_tensor(w)[:, :, None, None], requires_grad=False)


def norm_param(w: np.ndarray) -> nn.Parameter:
    return nn.Parameter(_tensor(w)[None, :, None, None], requires_grad=False)


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, half: int) -> torch.Tensor:
    """Rotary embedding on (1, heads, head_dim, S), rotate-half convention (as transformers' Llama); the sign of
    rotate_half is in `signed_sin` = [-sin, sin], so the swap needs no negation."""
    swapped = torch.cat([x[:, :, half:], x[:, :, :half]], dim=2)
    return x * cos + swapped * signed_sin


def logits_from_pieces(pieces: tuple[torch.Tensor, ...] | list[np.ndarray]) -> np.ndarray:
    """The (S, vocab) logits from the head pieces (each (1, rows, 1, S))."""
    arrays = [p.detach().float().numpy() if isinstance(p, torch.Tensor) else np.asarray(p, np.float32)
              for p in pieces]
    return np.concatenate([a[0, :, 0, :] for a in arrays], axis=0).T


def build_ane_llama(dims: LlamaDims, context: int, weight: Callable[[str], np.ndarray]) -> AneLlama:
    return AneLlama(dims, context, weight).eval()
