"""The weight-quantization method registry: `--weights NAME` resolves here, never through string branches."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from accel.errors import AccelError
from accel.formats.tensor import TensorEntry

Encoded = tuple[TensorEntry, dict[str, np.ndarray]]


@dataclass(frozen=True)
class WeightSettings:
    """Settings every weight method receives (JSON-able; recorded in accel.json)."""

    group: int = 64
    layout: str | None = None
    seed: int = 0
    hessians: Any = None  # accel.calibrate.hessians.HessianStore when --calib is given
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WeightMethod:
    name: str
    description: str
    encode: Callable[[str, np.ndarray, WeightSettings], Encoded]
    needs_calibration: bool = False
    uses_calibration: bool = False  # Hessians from --calib drive error feedback (optional unless needs_calibration)
    parallel: bool = False  # heavy numpy-only work: worth a process pool


WEIGHT_METHODS: dict[str, WeightMethod] = {}
# methods of design.md §3 whose issue is still open: name -> issue number
PLANNED_WEIGHT_METHODS: dict[str, int] = {}


def register_weight_method(method: WeightMethod) -> WeightMethod:
    WEIGHT_METHODS[method.name] = method
    return method


def get_weight_method(name: str) -> WeightMethod:
    import accel.quantize.gptq_affine
    import accel.quantize.hqq_affine
    import accel.quantize.leech_weights
    import accel.quantize.rtn  # noqa: F401  (each module registers its methods)

    if name not in WEIGHT_METHODS and name in PLANNED_WEIGHT_METHODS:
        raise AccelError(f"--weights {name} is not available yet (tracked in issue #{PLANNED_WEIGHT_METHODS[name]})")
    if name not in WEIGHT_METHODS:
        raise AccelError(f"unknown --weights {name!r} (available: {', '.join(sorted(WEIGHT_METHODS))})")
    return WEIGHT_METHODS[name]


_BLOCK_WEIGHT = re.compile(r"(^|\.)layers\.\d+\.")
# a mixture-of-experts layer's router (Mixtral's block_sparse_moe.gate, Qwen-MoE's mlp.gate and shared_expert_gate,
# PhiMoE's router): a few thousand weights a layer that decide which experts run, kept as llama.cpp keeps its
# ffn_gate_inp; transformers runs them as F.linear on a parameter, not as nn.Linear, so no Hessian is recorded either
_ROUTER_WEIGHT = re.compile(r"\.(gate|router|shared_expert_gate)\.weight$")


def is_quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Linear-layer weights inside the decoder blocks; embeddings, the LM head, norms and MoE routers stay as they
    are."""
    return len(shape) == 2 and name.endswith(".weight") and bool(_BLOCK_WEIGHT.search(name)) and "norm" not in name \
        and not _ROUTER_WEIGHT.search(name)
