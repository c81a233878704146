"""The ANE-friendly Llama that accel owns: (B, C, 1, S) activations, 1x1 convolutions, fp16 KV-cache states.

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

SUPPORTED_ARCHITECTURES = {"llama": ("LlamaForCausalLM",)}
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

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads

    @property
    def head_pieces(self) -> list[tuple[int, int]]:
        """Row ranges [start, end) of the LM head pieces: as few as the 16,384 limit allows, equal sizes."""
        count = -(-self.vocab // ANE_MAX_DIM)
        size = -(-self.vocab // count)
        return [(s, min(s + size, self.vocab)) for s in range(0, self.vocab, size)]

    def param_count(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        per_layer = attn + mlp + 2 * self.hidden
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * per_layer + embed + self.hidden


def llama_dims(config: dict[str, Any]) -> LlamaDims:
    """Validate that `config` is a Llama-family model this exporter handles; refuse anything else by name."""
    model_type = config.get("model_type")
    archs = config.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise AccelError(f"the model config's architectures {archs!r} is not a list of class names")
    arch = archs[0] if archs else model_type
    if model_type not in SUPPORTED_ARCHITECTURES or (archs and arch not in SUPPORTED_ARCHITECTURES[model_type]):
        supported = ", ".join(a for v in SUPPORTED_ARCHITECTURES.values() for a in v)
        raise AccelError(f"unsupported architecture {arch!r} (model_type {model_type!r}): export-ane handles "
                         f"Llama-family decoders ({supported})")
    refusals = {
        "attention_bias": config.get("attention_bias", False),
        "mlp_bias": config.get("mlp_bias", False),
    }
    for key, value in refusals.items():
        if value:
            raise AccelError(f"unsupported architecture {arch!r} with {key}=true: export-ane emits bias-free convs")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise AccelError(f"unsupported architecture {arch!r} with hidden_act={act!r}: export-ane emits silu")
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    if heads % kv_heads:
        raise AccelError(f"{arch}: {heads} attention heads is not a multiple of {kv_heads} KV heads")
    return LlamaDims(vocab=int(config["vocab_size"]), hidden=hidden, intermediate=int(config["intermediate_size"]),
                     layers=int(config["num_hidden_layers"]), heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                     eps=float(config.get("rms_norm_eps", 1e-6)), tied=bool(config.get("tie_word_embeddings")),
                     max_positions=int(config.get("max_position_embeddings", 2048)), config=dict(config))


def rotary_tables(dims: LlamaDims, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin, (positions, head_dim) float32, exactly as transformers computes them (rope scaling included)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from accel.converters.materialize import NOT_MODEL_KEYS

    keep = {k: v for k, v in dims.config.items() if k not in NOT_MODEL_KEYS + ("architectures",)}
    rope = LlamaRotaryEmbedding(LlamaConfig(**keep))
    pos = torch.arange(positions, dtype=torch.int64)[None]
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


def conv1x1(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.conv2d(x, weight)


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
        self.attn_norm = norm_param(weight(prefix + "input_layernorm.weight"))
        self.mlp_norm = norm_param(weight(prefix + "post_attention_layernorm.weight"))

    def forward(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                rotary: tuple[torch.Tensor, ...], mask: torch.Tensor, write: torch.Tensor,
                keep: torch.Tensor) -> torch.Tensor:
        d = self.dims
        q_cos, q_sin, cos, sin = rotary
        h = rms_norm_ane(x, d.eps) * self.attn_norm
        q = rope(conv1x1(h, self.q).reshape(1, d.heads, d.head_dim, -1), q_cos, q_sin, d.head_dim // 2)
        k = rope(conv1x1(h, self.k).reshape(1, d.kv_heads, d.head_dim, -1), cos, sin, d.head_dim // 2)
        v = conv1x1(h, self.v).reshape(1, d.kv_heads, d.head_dim, -1)
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
        x = x + conv1x1(o.reshape(1, d.heads * d.head_dim, 1, -1), self.o)
        h = rms_norm_ane(x, d.eps) * self.mlp_norm
        return x + conv1x1(F.silu(conv1x1(h, self.gate)) * conv1x1(h, self.up), self.down)


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
        # Rotate-half tables repeat their first half; only that half is stored.
        cos, sin = rotary_tables(dims, context + 1)
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
        visible = (keys[None, :] <= pos[:, None]).to(x.dtype)                       # (S, ctx)
        mask = (visible - 1.0) * -MASK_NEG                                          # 0 or -1e4
        mask = mask[:, None, :].repeat(1, d.groups, 1).reshape(-1, self.context)     # rows (s, g)
        write = (keys[None, :] == pos[:, None]).to(x.dtype)                         # one-hot (S, ctx)
        keep = (1.0 - write.sum(dim=0)).reshape(1, 1, 1, self.context)
        for i, block in enumerate(self.blocks):
            x = block(x, getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}"), rotary, mask, write, keep)
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
