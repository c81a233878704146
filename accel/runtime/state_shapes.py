"""Where a hybrid model keeps recurrent state: which layers, how many heads, and the d_k × d_v shape of each.

Gated DeltaNet (transformers' Qwen3-Next and Qwen3.5) decays each head's state by one scalar per step; Kimi Delta
Attention (Kimi-Linear) decays each d_k channel (row of the state) separately. Both keep a float32 state of
[batch, heads, d_k, d_v] per linear-attention layer in transformers' cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from accel.errors import AccelError

GDN_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe")
KDA_TYPES = ("kimi_linear",)


@dataclass(frozen=True)
class StateShape:
    arch: str  # "gdn" or "kda"
    layers: tuple[int, ...]  # indices of the linear-attention layers
    heads: int  # state heads per layer (GDN: value heads)
    d_k: int  # rows of a head's state: the channels a map ranks
    d_v: int  # values per channel

    @property
    def channels(self) -> int:
        return len(self.layers) * self.heads * self.d_k

    @property
    def values(self) -> int:
        """State values per sequence, all layers."""
        return self.channels * self.d_v

    def describe(self) -> str:
        return (f"{len(self.layers)} linear-attention layers x {self.heads} heads x {self.d_k} channels "
                f"(d_v {self.d_v})")

    def to_json(self) -> dict[str, Any]:
        return {"arch": self.arch, "layers": list(self.layers), "heads": self.heads, "d_k": self.d_k,
                "d_v": self.d_v}


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) and config.get("model_type") in ("qwen3_5", "qwen3_5_moe") else config


def _linear_layers(cfg: dict[str, Any], default_interval: int) -> tuple[int, ...]:
    types = cfg.get("layer_types")
    n = int(cfg.get("num_hidden_layers", 0))
    if not isinstance(types, list):
        interval = int(cfg.get("full_attention_interval", default_interval))
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    return tuple(i for i, t in enumerate(types) if t == "linear_attention")


def state_shape(config: Any) -> StateShape:
    """The recurrent-state shape of a model, from its config (a dict or a transformers config)."""
    if not isinstance(config, dict):
        config = config.to_dict()
    model_type = config.get("model_type")
    if model_type in GDN_TYPES:
        cfg = _text_config(config)
        k_heads, v_heads = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
        if v_heads % k_heads:
            raise AccelError(f"{model_type}: {v_heads} value heads are not a multiple of {k_heads} key heads")
        return StateShape("gdn", _linear_layers(cfg, 4), v_heads, int(cfg["linear_key_head_dim"]),
                          int(cfg["linear_value_head_dim"]))
    if model_type in KDA_TYPES:
        lin = config.get("linear_attn_config") or {}
        types = config.get("layer_types")
        if isinstance(types, list):
            layers = tuple(i for i, t in enumerate(types) if t == "linear_attention")
        elif "kda_layers" in lin:
            layers = tuple(sorted(int(i) - 1 for i in lin["kda_layers"]))
        else:
            n = int(config.get("num_hidden_layers", 0))
            layers = tuple(i for i in range(n) if not (i and i % 4 == 0))
        dim = int(lin.get("head_dim", config.get("linear_head_dim", 128)))
        heads = int(lin.get("num_heads", config.get("linear_num_heads", 32)))
        return StateShape("kda", layers, heads, dim, dim)
    raise AccelError(f"model type {model_type!r} has no recurrent state (DAMP handles Gated DeltaNet models: "
                     f"{', '.join(GDN_TYPES)}; and Kimi Delta Attention models: {', '.join(KDA_TYPES)})")
