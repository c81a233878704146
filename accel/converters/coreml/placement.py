"""Predicted Neural Engine placement of every MIL op, from explicit rules (op, condition, reason).

Linux cannot ask Core ML where an op runs, so accel predicts it: the first rule of `RULES` whose condition holds
decides the op's device, and the report keeps the rule and its reason. Residency is the share of ops, of FLOPs
and of weight bytes predicted on the ANE, overall and inside the decoder blocks. The rules are what public
sources and the probe's MLComputePlan captures support; `accel export-ane sweep` exists to check them on a Mac.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

ANE_MAX_DIM = 16384
ANE_MAX_RANK = 5
ANE, CPU, GPU_OR_CPU = "ANE", "CPU", "GPU/CPU"

# Ops that are storage, not computation: their bytes are charged to the ops that read them.
STORAGE_OPS = {"const", "constexpr_lut_to_dense", "constexpr_blockwise_shift_scale", "constexpr_affine_dequantize",
               "constexpr_sparse_to_dense", "constexpr_cast", "constexpr_lut_to_sparse",
               "constexpr_sparse_blockwise_shift_scale"}
GATHER_OPS = {"gather", "gather_nd", "gather_along_axis", "scatter", "scatter_nd", "scatter_along_axis"}
# Op kinds with a Neural Engine kernel (fp16, static shapes).
ANE_OPS = {
    "conv", "linear", "matmul", "add", "sub", "mul", "real_div", "maximum", "minimum", "pow", "sqrt", "rsqrt",
    "exp", "tanh", "sigmoid", "silu", "relu", "gelu", "softmax", "layer_norm", "batch_norm", "instance_norm",
    "reduce_mean", "reduce_sum", "reduce_max", "reduce_min", "reshape", "transpose", "concat", "split",
    "slice_by_index", "slice_by_size", "expand_dims", "squeeze", "tile", "pad", "clip", "select", "identity",
    "read_state", "coreml_update_state",
}
# Ops that move data but compute nothing.
MOVE_OPS = {"reshape", "transpose", "concat", "split", "slice_by_index", "slice_by_size", "expand_dims", "squeeze",
            "tile", "pad", "identity", "read_state", "coreml_update_state", "slice_update", "cast"} | GATHER_OPS
FLOPS_PER_ELEMENT = {"softmax": 5, "layer_norm": 8, "instance_norm": 8, "batch_norm": 2, "silu": 4, "gelu": 8,
                     "sigmoid": 4, "tanh": 4, "exp": 2, "rsqrt": 2, "sqrt": 2, "pow": 2}
# Torch module types whose ops are "inside a decoder block": accel's ANE model, and transformers' decoder layers
# (LlamaDecoderLayer, Qwen3DecoderLayer, ...).
BLOCK_MODULE_TYPE = "AneBlock"
BLOCK_MODULE_SUFFIX = "DecoderLayer"
NAIVE_DESCRIPTION = ("the model's transformers causal LM, e.g. LlamaForCausalLM (eager attention, use_cache=False), "
                     "traced with torch.jit.trace "
                     "for one fixed sequence length and converted by coremltools.convert with its defaults "
                     "(mlprogram, fp16, default pass pipeline)")


@dataclass(frozen=True)
class TensorFacts:
    dtype: str
    shape: tuple[Any, ...]
    const: bool

    @property
    def static(self) -> bool:
        return all(isinstance(d, (int, np.integer)) for d in self.shape)


@dataclass(frozen=True)
class OpFacts:
    """What the rules look at: the op's kind and its data tensors (parameters such as axes are left out)."""

    op_type: str
    name: str
    inputs: tuple[TensorFacts, ...]
    outputs: tuple[TensorFacts, ...]
    pattern: str | None = None  # a multi-op pattern the op is part of (see find_patterns)

    def tensors(self, include_const: bool = False) -> list[TensorFacts]:
        return [t for t in self.inputs if include_const or not t.const] + list(self.outputs)


@dataclass(frozen=True)
class Rule:
    name: str
    device: str
    condition: Callable[[OpFacts], bool]
    reason: str
    basis: str


def _non_fp16(f: OpFacts) -> bool:
    return any(t.dtype != "fp16" for t in f.tensors())


def _dynamic(f: OpFacts) -> bool:
    return any(not t.static for t in f.tensors())


def _too_long(f: OpFacts) -> bool:
    weights = f.op_type in ("conv", "linear", "matmul")
    return any(t.static and max(t.shape, default=0) > ANE_MAX_DIM for t in f.tensors(include_const=weights))


def _too_deep(f: OpFacts) -> bool:
    return any(len(t.shape) > ANE_MAX_RANK for t in f.tensors())


RULES: tuple[Rule, ...] = (
    Rule("gather", CPU, lambda f: f.op_type in GATHER_OPS,
         "index lookups (gather/scatter) have no Neural Engine kernel; they run on the CPU",
         "Apple, Deploying Transformers on the ANE (embeddings stay outside the ANE graph); MLComputePlan reports"),
    Rule("dtype", CPU, _non_fp16,
         "the Neural Engine computes in fp16 only; int, bool and fp32 tensors run on the CPU",
         "Core ML documentation: ANE precision is fp16; integer ops fall back"),
    Rule("dynamic-shape", GPU_OR_CPU, _dynamic,
         "the Neural Engine compiles static or enumerated shapes only",
         "Core ML flexible-shape documentation: range shapes are not ANE-eligible"),
    Rule("dim-limit", GPU_OR_CPU, _too_long,
         f"a tensor dimension exceeds the Neural Engine's limit of {ANE_MAX_DIM}",
         "design.md §5 (LM head split at 16,384); community reports for vocab-sized heads"),
    Rule("rank-limit", CPU, _too_deep,
         f"tensors of rank above {ANE_MAX_RANK} do not map onto the Neural Engine's layout",
         "ANE tensors are at most 5-D (N, C, D?, H, W)"),
    Rule("decomposed-norm", CPU, lambda f: f.pattern == "decomposed_rmsnorm",
         "a decomposed RMSNorm (pow -> reduce_mean -> add -> rsqrt -> mul) runs on the CPU as a chain; the same "
         "norm as one layer_norm over [x, -x] is ANE-eligible",
         "papers.md (ANE abstract): measured, fused RMSNorm fully ANE-eligible, its decomposition CPU-only"),
    Rule("op-kind", CPU, lambda f: f.op_type not in ANE_OPS,
         "no Neural Engine kernel for this op kind",
         "op list from public ANE op-support tables; to be confirmed by the sweep's MLComputePlan capture"),
    Rule("ane", ANE, lambda f: True,
         "fp16, static shapes within the ANE limits, op kind with an ANE kernel",
         "default"),
)


def rules_table() -> list[dict[str, str]]:
    return [{"rule": r.name, "device": r.device, "reason": r.reason, "basis": r.basis} for r in RULES]


def predict(facts: OpFacts) -> Rule:
    for rule in RULES:
        if rule.condition(facts):
            return rule
    raise AssertionError("the last rule always applies")


# ------------------------------------------------------------------------------------------------- the report
OP_COLUMNS = ("name", "op", "device", "rule", "flops", "weight_bytes", "in_block", "output")


@dataclass
class OpPlacement:
    name: str
    op_type: str
    device: str
    rule: str
    reason: str
    flops: int
    weight_bytes: int
    in_block: bool
    output: str = ""  # the first output's name: what MLComputePlan captures identify ops by

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "op": self.op_type, "device": self.device, "rule": self.rule,
                "flops": self.flops, "weight_bytes": self.weight_bytes, "in_block": self.in_block,
                "output": self.output}


@dataclass
class PlacementReport:
    ops: list[OpPlacement] = field(default_factory=list)

    def residency(self) -> dict[str, float]:
        """Shares predicted on the ANE: of ops, of ops inside decoder blocks, of FLOPs, of weight bytes."""
        def share(items: list[OpPlacement], weight: Callable[[OpPlacement], float]) -> float:
            total = sum(weight(o) for o in items)
            ane = sum(weight(o) for o in items if o.device == ANE)
            return round(ane / total, 6) if total else 1.0

        block = [o for o in self.ops if o.in_block]
        return {"ops": share(self.ops, lambda o: 1), "block_ops": share(block, lambda o: 1),
                "flops": share(self.ops, lambda o: o.flops), "weight_bytes": share(self.ops, lambda o: o.weight_bytes)}

    def off_ane(self) -> list[dict[str, Any]]:
        """Ops predicted off the ANE, grouped by (op kind, rule), with counts."""
        groups = Counter((o.op_type, o.rule, o.device, o.in_block) for o in self.ops if o.device != ANE)
        reasons = {r.name: r.reason for r in RULES}
        return [{"op": op, "rule": rule, "device": dev, "in_block": blk, "count": n, "reason": reasons[rule]}
                for (op, rule, dev, blk), n in sorted(groups.items())]

    def to_json(self) -> dict[str, Any]:
        return {"residency": self.residency(), "op_count": len(self.ops),
                "block_op_count": sum(o.in_block for o in self.ops),
                "flops": sum(o.flops for o in self.ops), "weight_bytes": sum(o.weight_bytes for o in self.ops),
                "op_kinds": dict(sorted(Counter(o.op_type for o in self.ops).items())),
                "off_ane": self.off_ane(),
                # one row per op (a table, not objects: SmolLM2's report has ~5,000 of them)
                "ops": {"columns": list(OP_COLUMNS), "rows": [[o.to_json()[c] for c in OP_COLUMNS] for o in self.ops]}}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> PlacementReport:
        reasons = {r.name: r.reason for r in RULES}
        ops = doc.get("ops", {})
        rows = [dict(zip(ops["columns"], row, strict=True)) for row in ops["rows"]] if isinstance(ops, dict) else ops
        return cls([OpPlacement(name=o["name"], op_type=o["op"], device=o["device"], rule=o["rule"],
                                reason=reasons.get(o["rule"], ""), flops=int(o["flops"]),
                                weight_bytes=int(o["weight_bytes"]), in_block=bool(o["in_block"]),
                                output=str(o.get("output", "")))
                    for o in rows])

    def op_rows(self) -> list[dict[str, Any]]:
        return [o.to_json() for o in self.ops]


def ane_placement_report(function) -> PlacementReport:
    """Predict every op of one MIL function (a pymil Function)."""
    report = PlacementReport()
    patterns = find_patterns(function)
    for op in function.operations:
        if op.op_type in STORAGE_OPS:
            continue
        facts = op_facts(op, patterns.get(id(op)))
        rule = predict(facts)
        report.ops.append(OpPlacement(name=op.name, op_type=op.op_type, device=rule.device, rule=rule.name,
                                      reason=rule.reason, flops=op_flops(op), weight_bytes=op_weight_bytes(op),
                                      in_block=in_block(op), output=op.outputs[0].name if op.outputs else ""))
    return report


# ------------------------------------------------------------------------------------------ facts from pymil
def _dtype_name(var) -> str:
    from coremltools.converters.mil.mil import types

    dtype = var.dtype
    return types.builtin_to_string(dtype) if dtype is not None else "unknown"


def _is_storage(var) -> bool:
    return var.op is not None and var.op.op_type in STORAGE_OPS


def _data_inputs(op) -> list:
    """The op's tensor inputs that carry data: runtime tensors, and constant tensors of float type (weights).
    Integer/bool constants are parameters (axes, shapes, begin/end) and are left out."""
    out = []
    for var in _flat_inputs(op):
        if var.op is not None and var.op.op_type == "const" and not str(_dtype_name(var)).startswith("fp"):
            continue
        if _is_storage(var) and var.rank == 0:
            continue
        out.append(var)
    return out


def _flat_inputs(op) -> list:
    flat = []
    for value in op.inputs.values():
        if isinstance(value, (list, tuple)):
            flat.extend(value)
        else:
            flat.append(value)
    return flat


def find_patterns(function) -> dict[int, str]:
    """Multi-op patterns rules look at, by op id. "decomposed_rmsnorm": x -> pow(x, 2) | mul(x, x) ->
    reduce_mean -> add(eps) -> rsqrt -> mul(x, .), the chain a plain trace of LlamaRMSNorm produces."""
    found: dict[int, str] = {}
    for op in function.operations:
        if op.op_type != "rsqrt":
            continue
        add = op.x.op
        mean = add.x.op if add is not None and add.op_type == "add" else None
        square = mean.x.op if mean is not None and mean.op_type == "reduce_mean" else None
        if square is None or not (square.op_type == "pow" or (square.op_type == "mul" and square.x is square.y)):
            continue
        source = square.x
        scale = [c for c in op.outputs[0].child_ops if c.op_type == "mul" and source in (c.x, c.y)]
        if add.y.op is None or add.y.op.op_type != "const" or not scale:
            continue
        for member in (square, mean, add, op, *scale):
            found[id(member)] = "decomposed_rmsnorm"
    return found


def op_facts(op, pattern: str | None = None) -> OpFacts:
    def facts(var) -> TensorFacts:
        shape = tuple(var.shape) if hasattr(var, "shape") and var.shape is not None else ()
        return TensorFacts(dtype=_dtype_name(var), shape=shape, const=_is_storage(var))

    inputs = tuple(facts(v) for v in _data_inputs(op) if not _is_state(v))
    outputs = tuple(facts(v) for v in op.outputs)
    return OpFacts(op_type=op.op_type, name=op.name, inputs=inputs, outputs=outputs, pattern=pattern)


def _is_state(var) -> bool:
    from coremltools.converters.mil.mil import types

    return types.is_state(var.sym_type)


def _numel(var) -> int:
    shape = tuple(var.shape) if var.shape is not None else ()
    return int(np.prod([d if isinstance(d, (int, np.integer)) else 1 for d in shape], dtype=np.int64))


def op_flops(op) -> int:
    """Multiply-adds count 2; elementwise ops one per output element (more for the transcendental ones)."""
    kind = op.op_type
    if kind in MOVE_OPS or kind in STORAGE_OPS:
        return 0
    out = _numel(op.outputs[0])
    if kind == "conv":
        w = op.weight.shape
        return 2 * out * int(np.prod(w[1:]))
    if kind == "linear":
        return 2 * out * int(op.weight.shape[-1])
    if kind == "matmul":
        x = op.x.shape
        k = x[-2] if (op.transpose_x is not None and op.transpose_x.val) else x[-1]
        return 2 * out * int(k)
    if kind.startswith("reduce_"):
        return _numel(op.x)
    return FLOPS_PER_ELEMENT.get(kind, 1) * out


def storage_bytes(var) -> int:
    """Bytes a const or constexpr output occupies in the weight file (sub-byte types packed)."""
    from coremltools.converters.mil.mil import types

    op = var.op
    if op is None:
        return 0
    if op.op_type == "const":
        dtype = var.dtype
        if types.is_tensor(var.sym_type):
            dtype = var.sym_type.get_primitive()
        bits = dtype.get_bitwidth() if hasattr(dtype, "get_bitwidth") else 8 * np.dtype(types.nptype_from_builtin(
            dtype)).itemsize
        return math.ceil(_numel(var) * bits / 8)
    if op.op_type in STORAGE_OPS:
        return sum(storage_bytes(v) for v in _flat_inputs(op) if v.op is not None and v.rank > 0)
    return 0


def op_weight_bytes(op) -> int:
    """Constant float data the op reads per call; a gather reads only the rows it looks up."""
    total = 0
    for var in _data_inputs(op):
        if not _is_storage(var) or var.rank == 0 or _numel(var) <= 1:
            continue
        size = storage_bytes(var)
        if op.op_type in GATHER_OPS and var is op.x:
            rows = var.shape[0] if var.shape else 1
            size = math.ceil(size * _numel(op.indices) / max(int(rows), 1))
        total += size
    return total


def in_block(op) -> bool:
    from coremltools.converters.mil.mil.scope import ScopeSource

    types_ = op.scopes.get(ScopeSource.TORCHSCRIPT_MODULE_TYPE, []) if hasattr(op, "scopes") else []
    return any(t == BLOCK_MODULE_TYPE or t.endswith(BLOCK_MODULE_SUFFIX) for t in types_)


# -------------------------------------------------------------------------------------------- naive baseline
def convert_naive(source, dims, seq: int):
    """The naive conversion of the same weights: the plain transformers model, traced, coremltools defaults."""
    import torch

    from accel.converters import build_transformers_model
    from accel.converters.coreml.export import import_coremltools, quiet_coremltools

    ct = import_coremltools()
    import accel.converters.coreml.frontend  # noqa: F401  (torch 2.13 scalar-cast fix)

    names = _hf_names(dims)
    with quiet_coremltools():  # transformers' and torch's tracing chatter
        model = build_transformers_model(dims.config, {n: source.float(n) for n in names},
                                         attn_implementation="eager")
        plain = plain_llama(model, seq).eval()
        with torch.no_grad():
            traced = torch.jit.trace(plain, torch.zeros(1, seq, dtype=torch.int64), check_trace=False)
        del model, plain
        return ct.convert(traced, inputs=[ct.TensorType("input_ids", shape=(1, seq), dtype=np.int32)],
                          convert_to="milinternal")


def plain_llama(model, seq: int):
    """input_ids -> logits of a transformers causal LM, with the causal mask and positions of a fixed length
    and no cache: what a user tracing the model for Core ML without further thought would write."""
    import torch

    class PlainLlama(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            mask = torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1)[None, None]
            return self.inner(input_ids=input_ids, attention_mask=mask, position_ids=torch.arange(seq)[None],
                              use_cache=False).logits

    return PlainLlama(model)


def _hf_names(dims) -> list[str]:
    """Every tensor the ANE model reads, by Hugging Face name."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not dims.tied:
        names.append("lm_head.weight")
    from accel.converters.coreml.ane_llama import AneBlock

    for i in range(dims.layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + hf + ".weight" for _, hf in AneBlock.PROJECTIONS]
        names += [p + hf + ".bias" for short, hf in AneBlock.PROJECTIONS if short in dims.biases]
        if dims.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
    return names
