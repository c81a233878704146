"""`accel export-ane`: trace the ANE-friendly Llama, convert it to MIL, encode its weights with constexpr ops,
and save prefill and decode as the two functions of one stateful multifunction `.mlpackage`.

The pipeline is a list of small named steps (docs/ane.md, "Export pipeline"): coremltools' own passes, chosen
explicitly, then accel's passes (`ACCEL_PASSES`) on the MIL program, then serialization. The package also
carries accel's manifest (shapes, encodings, predicted bytes per token), the placement report and the probe
harness, as items of its own author in the package manifest.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import shutil
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from accel import __version__
from accel.converters.coreml.ane_llama import (
    ANE_MAX_DIM,
    AneLlama,
    LlamaDims,
    build_ane_llama,
    llama_dims,
)
from accel.converters.coreml.encodings import EncodedWeight, encoding_names, get_encoding
from accel.errors import AccelError, FormatError
from accel.formats import jsontext
from accel.progress import SILENT, Progress

PACKAGE_SUFFIX = ".mlpackage"
ACCEL_AUTHOR = "com.github.accel"
MANIFEST_ITEM = "accel-manifest.json"
PLACEMENT_ITEM = "placement.json"
HARNESS_ITEM = "probe_harness.py"
MANIFEST_FORMAT = "accel-ane"
MANIFEST_VERSION = 1
DEFAULT_CONTEXT = 512
DEFAULT_PREFILL = 64
DEFAULT_FUNCTION = "decode"

# coremltools passes, chosen: the defaults also fold, fuse and rewrite in ways that break the ANE layout or the
# 1:1 map from weights to MIL consts, and cost 3x the time on a 135M model.
COREML_PASSES = [
    "common::update_output_dtypes",
    "common::const_elimination",
    "common::noop_elimination",
    "common::dead_code_elimination",
    "common::fuse_transpose_matmul",
    "common::merge_consecutive_reshapes",
    "common::add_fp16_cast",
    "common::cast_optimization",
    "common::const_elimination",
    "common::dead_code_elimination",
    "common::canonicalize_inplace_pattern",
    "common::prefer_state_in_downstream",
    "common::remove_redundant_ops",
    "common::update_output_dtypes",
    "common::dedup_op_and_var_names",
    "common::dead_code_elimination",
]


@dataclass
class ExportSettings:
    encoding: str = "fp16"
    context: int = DEFAULT_CONTEXT
    prefill: int = DEFAULT_PREFILL
    naive: bool = True  # also convert the plain transformers Llama, for the placement comparison

    def check(self) -> None:
        get_encoding(self.encoding)
        if self.context < 1:
            raise AccelError(f"--context must be at least 1, got {self.context}")
        if self.prefill < 1:
            raise AccelError(f"--prefill must be at least 1, got {self.prefill}")


# --------------------------------------------------------------------------------------------- weight sources
class WeightSource:
    """Float weights by Hugging Face name, and, from an accel OUT_DIR, the integer codes behind them."""

    def __init__(self, spec: str | Path):
        from accel.converters import open_model
        from accel.formats import Artifact

        self.spec = str(spec)
        path = Path(spec)
        self.artifact = None
        self.model = None
        if path.is_dir() and (path / "accel.json").is_file():
            self.artifact = Artifact(path)
            config = dict(self.artifact.config or {})
            config.pop("accel", None)
            if not config:
                raise AccelError(f"{path}: the accel OUT_DIR has no config.json")
            self.config = config
            self.kind = "accel-out-dir"
        else:
            self.model = open_model(spec)
            self.config = dict(self.model.config)
            self.kind = "model"

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The model tensors' shapes by Hugging Face name (an OUT_DIR's maps left out)."""
        return self.artifact.model_shapes() if self.artifact is not None else self.model.tensor_shapes()

    def float(self, name: str) -> np.ndarray:
        if self.artifact is not None:
            if name not in self.artifact.owner:
                raise AccelError(f"{self.spec}: no tensor named {name!r}")
            return np.asarray(self.artifact.decode(name), dtype=np.float32)
        return self.model.load_tensor(name)

    def codes(self, name: str) -> tuple[str, dict, np.ndarray, dict[str, np.ndarray]] | None:
        """(codec, params, codes, side parts) of a quantized OUT_DIR tensor; None for float tensors."""
        if self.artifact is None or name not in self.artifact.owner:
            return None
        from accel.formats.codecs import get_codec
        from accel.formats.layouts import get_layout

        entry = self.artifact.entry(name)
        codec = get_codec(entry.codec)
        levels = codec.levels(entry.params)
        if not levels or entry.role != "quantized":
            return None
        file = self.artifact.owner[name]
        for stored in entry.parts.values():
            if not file.checksum_ok(stored):
                raise FormatError(f"{file.path}: tensor '{name}': checksum mismatch in '{stored}'")
        parts = {p: file.read_stored(s) for p, s in entry.parts.items()}
        count = codec.code_count(entry.params, entry.shape)
        codes = get_layout(entry.layout).unpack(parts.pop("codes"), levels, count)
        return entry.codec, dict(entry.params), np.asarray(codes), parts

    def close(self) -> None:
        if self.artifact is not None:
            self.artifact.close()
        if self.model is not None:
            self.model.close()


# ------------------------------------------------------------------------------------------- shape checking
def check_ane_shapes(dims: LlamaDims, context: int, prefill: int) -> None:
    """Refuse a context (or model) whose tensors inside the blocks would exceed the ANE's per-dimension limit."""
    limits = {
        "the KV cache and attention scores (context)": context,
        "the grouped query rows (prefill x query heads per KV head)": prefill * dims.groups,
        "the hidden size": dims.hidden,
        "the MLP width": dims.intermediate,
        "the query projection (heads x head_dim)": dims.heads * dims.head_dim,
    }
    for what, size in limits.items():
        if size > ANE_MAX_DIM:
            hint = f"; use --context {ANE_MAX_DIM} or less" if "(context)" in what else ""
            raise AccelError(f"{what} would be {size} long, over the Neural Engine's limit of {ANE_MAX_DIM} "
                             f"per tensor dimension (rule dim-limit){hint}")
    if context > dims.max_positions:
        raise AccelError(f"--context {context} is longer than the model's max_position_embeddings "
                         f"({dims.max_positions})")
    if dims.rope_switch is not None and context > dims.rope_switch:
        raise AccelError(f"--context {context} is past the model's longrope switch ({dims.rope_switch} positions, "
                         f"original_max_position_embeddings): transformers then changes every position's "
                         f"rotary frequencies with the sequence's length, which a package's fixed tables cannot "
                         f"follow; use --context {dims.rope_switch} or less")


# ---------------------------------------------------------------------------------------------- conversion
@contextlib.contextmanager
def quiet_coremltools() -> Iterator[None]:
    """coremltools' progress bars, import notices and version warnings go nowhere; accel reports its own
    stages. Errors still propagate as exceptions."""
    loggers = [logging.getLogger(name) for name in ("coremltools", "transformers")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def import_coremltools():
    with quiet_coremltools():
        import coremltools

    return coremltools


def convert_function(model: AneLlama, seq: int):
    """Trace `model` for `seq` tokens per call and convert it to a MIL program (fp16, iOS 18, KV states)."""
    import torch

    ct = import_coremltools()
    import accel.converters.coreml.frontend  # noqa: F401  (registers the RMSNorm lowering)

    ids = torch.zeros(1, seq, dtype=torch.int32)
    pos = torch.arange(seq, dtype=torch.int32)[None]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.trace: coremltools' frontend needs it
        traced = torch.jit.trace(model, (ids, pos), check_trace=False)
    model.reset_cache()  # tracing ran forward once and wrote the caches
    states = [ct.StateType(wrapped_type=ct.TensorType(shape=model.cache_shape, dtype=np.float16), name=name)
              for name in model.cache_names]
    with quiet_coremltools():
        return ct.convert(
            traced,
            inputs=[ct.TensorType("input_ids", shape=(1, seq), dtype=np.int32),
                    ct.TensorType("position_ids", shape=(1, seq), dtype=np.int32)],
            outputs=[ct.TensorType(f"logits_{i}") for i in range(len(model.dims.head_pieces))],
            states=states,
            minimum_deployment_target=ct.target.iOS18,
            compute_precision=ct.precision.FLOAT16,
            convert_to="milinternal",
            pass_pipeline=ct.PassPipeline(pass_names=COREML_PASSES, pipeline_name="accel-ane"),
        )


@dataclass
class WeightPlan:
    """What each MIL weight const becomes: module parameter name -> Hugging Face source and encoded arrays."""

    encoded: dict[str, EncodedWeight] = field(default_factory=dict)
    sources: dict[str, tuple[str, tuple[int, int] | None]] = field(default_factory=dict)

    def mil_name(self, pname: str) -> str:
        """The MIL name of a weight's op: short, since names repeat in the program's protobuf (the manifest maps
        each back to its Hugging Face tensor)."""
        return f"w{list(self.sources).index(pname)}"


def plan_weights(model: AneLlama, source: WeightSource, encoding: str,
                 progress: Progress = SILENT) -> WeightPlan:
    """Encode every matrix of the model (projections, head pieces, untied embedding) once, for all functions."""
    enc = get_encoding(encoding)
    d = model.dims
    head = "model.embed_tokens.weight" if d.tied else "lm_head.weight"
    plan = WeightPlan()
    for i, rows in enumerate(d.head_pieces):
        plan.sources[f"head.{i}"] = (head, rows)
    if not d.tied:
        plan.sources["embed"] = ("model.embed_tokens.weight", None)
    for i in range(d.layers):
        for name, hf in model.blocks[i].PROJECTIONS:
            plan.sources[f"blocks.{i}.{name}"] = (f"model.layers.{i}.{hf}.weight", None)
    params = dict(model.named_parameters())
    progress.stage(f"encoding weights ({encoding})", len(plan.sources))
    code_cache: dict[str, Any] = {}
    for pname, (hf, rows) in plan.sources.items():
        w = params[pname].detach().numpy()
        w = w.reshape(w.shape[0], w.shape[1])
        encoded = None
        if hf not in code_cache:
            code_cache[hf] = source.codes(hf)
        codes = code_cache[hf]
        if codes is not None:
            codec, cparams, flat, side = codes
            full = tuple(source.artifact.entry(hf).shape)
            sel = slice(*rows) if rows else slice(None)
            part_codes = flat.reshape(full)[sel]
            part_side = {k: v.reshape(full[0], -1)[sel] for k, v in side.items()}
            encoded = enc.from_codes(codec, cparams, part_codes, part_side, tuple(part_codes.shape))
        plan.encoded[pname] = encoded if encoded is not None else enc.encode(w)
        progress.advance()
    return plan


def _strip_cast_suffix(name: str) -> str:
    return name.removesuffix("_to_fp16")


def encode_weights(prog, plan: WeightPlan | None = None) -> None:
    """accel pass: replace each weight const by its encoded const / constexpr op (shared by all its users)."""
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil.scope import ScopeInfo, ScopeSource

    if plan is None:
        return
    for func in prog.functions.values():
        found = set()
        with func:
            for op in list(func.operations):
                if op.op_type != "const":
                    continue
                pname = _strip_cast_suffix(op.name)
                if pname not in plan.encoded:
                    continue
                found.add(pname)
                old = op.outputs[0]
                # the new ops inherit the const's scopes (coremltools validates that every op has them)
                scopes = [ScopeInfo(source=k, data=list(v)) for k, v in op.scopes.items()
                          if v and k != ScopeSource.COREMLTOOLS_GRAPH_PASS]
                scopes.append(ScopeInfo(source=ScopeSource.COREMLTOOLS_GRAPH_PASS, data=["accel::encode_weights"]))
                with mb.scope(*scopes):
                    new = emit_encoded(mb, plan.encoded[pname], tuple(old.shape),
                                       name=plan.mil_name(pname), before_op=op)
                op.enclosing_block.replace_uses_of_var_after_op(anchor_op=op, old_var=old, new_var=new,
                                                                no_check_var_types=True, force_replace=True)
                op.enclosing_block.remove_ops([op])
        missing = sorted(set(plan.encoded) - found)
        if missing:
            raise AccelError(f"internal error: weight {missing[0]!r} has no const in the converted program")




def emit_encoded(mb, enc: EncodedWeight, shape: tuple[int, ...], name: str, before_op):
    """The MIL op for one encoded weight, reshaped to the const it replaces (a conv weight adds two axes)."""
    from coremltools.converters.mil.mil import types

    extra = (1,) * (len(shape) - 2)
    if enc.kind == "const":
        return mb.const(val=enc.arrays["values"].reshape(shape), name=name, before_op=before_op)
    if enc.kind == "shift_scale":
        data = enc.arrays["data"].reshape(shape)
        if enc.bits == 4:
            data = data.astype(types.np_uint4_dtype)
        kwargs = {"data": data, "scale": enc.arrays["scale"].reshape(enc.arrays["scale"].shape + extra)}
        if "offset" in enc.arrays:
            kwargs["offset"] = enc.arrays["offset"].reshape(enc.arrays["offset"].shape + extra)
        return mb.constexpr_blockwise_shift_scale(**kwargs, name=name, before_op=before_op)
    if enc.kind == "lut":
        dtype = types.nptype_from_builtin(types.string_to_builtin(f"uint{enc.bits}"))
        lut = enc.arrays["lut"]  # (row groups, col groups, palette, 1)
        lut = lut.reshape(lut.shape[:2] + extra + lut.shape[2:])
        return mb.constexpr_lut_to_dense(indices=enc.arrays["indices"].reshape(shape).astype(dtype), lut=lut,
                                         name=name, before_op=before_op)
    raise ValueError(enc.kind)


def drop_full_slice_update(prog, plan: WeightPlan | None = None) -> None:
    """accel pass: `cache[:, :, :, :] = new` traces as a slice_update covering the whole state; it is `new`."""
    for func in prog.functions.values():
        for op in list(func.operations):
            if op.op_type != "slice_update" or op.update.shape != op.x.shape:
                continue
            begin = op.begin.val
            stride = op.stride.val if op.stride is not None else None
            if begin is None or any(int(b) != 0 for b in begin) or (stride is not None and any(stride != 1)):
                continue
            op.enclosing_block.replace_uses_of_var_after_op(anchor_op=op, old_var=op.outputs[0],
                                                            new_var=op.update)
            op.enclosing_block.remove_ops([op])


def check_program(prog, plan: WeightPlan | None = None) -> None:
    """accel pass: fp16 everywhere a tensor flows (integers only as indices and masks in the prologue), and
    every op one the NumPy interpreter knows, so that `accel verify` can run what was saved."""
    from accel.converters.coreml.mil_interp import SUPPORTED_OPS

    for fname, func in prog.functions.items():
        for op in func.operations:
            if op.op_type not in SUPPORTED_OPS:
                raise AccelError(f"internal error: function {fname} emits op {op.op_type!r} ({op.name}), which "
                                 f"the MIL interpreter does not know")
            for out in op.outputs:
                if str(out.dtype).endswith("fp32"):
                    raise AccelError(f"internal error: function {fname}: {op.op_type} {op.name} outputs fp32")


def compact_program(prog, keep: set[str] = frozenset()) -> None:
    """accel pass: shrink the program's protobuf, which is fixed overhead on a 2-bit package (SmolLM2: 1.5 MB of
    a 35 MB package). Equal small constants (shapes, axes, begin/end repeated in every block) become one const,
    and op and value names become short (`v123`); function inputs and outputs and the `keep` names (the encoded
    weights the manifest points to) keep theirs."""
    from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

    dedup = PASS_REGISTRY["common::const_deduplication"]
    old = dedup.const_threshold
    dedup.const_threshold = 0
    try:
        dedup.apply(prog)
    finally:
        dedup.const_threshold = old
    for func in prog.functions.values():
        _dedup_small_consts(func)
        fixed = {v.name for v in func.outputs} | set(func.inputs) | set(keep)
        for n, op in enumerate(func.operations):
            if op.name in fixed or any(v.name in fixed for v in op.outputs):
                continue
            op.name = f"v{n}"
            for k, var in enumerate(op.outputs):
                var.name = op.name if len(op.outputs) == 1 else f"{op.name}_{k}"


def _dedup_small_consts(func, max_size: int = 64) -> None:
    """One const per distinct small value (coremltools' own deduplication skips strings, bools and scalars such
    as every conv's pad_type="valid")."""
    seen: dict[tuple, Any] = {}
    for op in list(func.operations):
        if op.op_type != "const" or op.outputs[0] in func.outputs:
            continue
        value = np.asarray(op.outputs[0].val)
        if value.size > max_size:
            continue
        key = (str(op.outputs[0].sym_type), value.shape, value.dtype.str, value.tobytes())
        if key not in seen:
            seen[key] = op.outputs[0]
            continue
        op.enclosing_block.replace_uses_of_var_after_op(anchor_op=op, old_var=op.outputs[0], new_var=seen[key],
                                                        force_replace=True)
        op.enclosing_block.remove_ops([op])


def compact_with_plan(prog, plan: WeightPlan | None = None) -> None:
    compact_program(prog, {plan.mil_name(p) for p in plan.encoded} if plan else frozenset())


# Each pass is fn(program, weight plan) and edits the program in place.
ACCEL_PASSES: list[tuple[str, Callable]] = [
    ("accel::drop_full_slice_update", drop_full_slice_update),
    ("accel::encode_weights", encode_weights),
    ("accel::compact_program", compact_with_plan),
    ("accel::check_program", check_program),
]


def run_accel_passes(prog, plan: WeightPlan) -> None:
    for _, fn in ACCEL_PASSES:
        fn(prog, plan)


def merge_functions(programs: dict[str, Any], default: str = DEFAULT_FUNCTION):
    """One program whose functions are the given single-function programs; equal consts share one blob."""
    from coremltools.converters.mil.mil import Program
    from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

    merged = Program()
    for name, prog in programs.items():
        merged.add_function(name, prog.functions["main"])
    PASS_REGISTRY["common::const_deduplication"]._deduplicate_const_across_functions(merged)
    merged.default_function_name = default
    merged.export_as_multifunction = True
    merged.skip_all_passes = True
    return merged


def serialize(program) -> Any:
    """The MLModel (not loaded: Linux cannot) of a multifunction MIL program, in a coremltools temp package."""
    ct = import_coremltools()
    from coremltools.converters.mil.converter import mil_convert

    with quiet_coremltools():
        return mil_convert(program, convert_from="milinternal", convert_to="mlprogram",
                           compute_units=ct.ComputeUnit.CPU_ONLY, specification_version=ct.target.iOS18,
                           skip_model_load=True, pass_pipeline=ct.PassPipeline.EMPTY)


# ------------------------------------------------------------------------------------------------- manifest
def predicted_bytes_table(dims: LlamaDims, plan: WeightPlan, decode_seq: int = 1) -> dict[str, int]:
    """Weight bytes one decode token streams, per encoding: every matrix once (the tied head pieces serve both
    the gather and the LM head, so they are read in full once); norms and biases stay fp16; an untied embedding
    table only gives its `decode_seq` gathered rows."""
    table = {}
    norms = 2 * dims.vector_count()
    for name in encoding_names():
        enc = get_encoding(name)
        total = norms
        for pname in plan.sources:
            w = plan.encoded[pname]
            r, c = w.shape
            if pname == "embed":
                total += decode_seq * (enc.predicted_bytes(r, c) // r)
            else:
                total += enc.predicted_bytes(r, c)
        table[name] = int(total)
    return table


def package_weight_bytes(plan: WeightPlan, dims: LlamaDims) -> dict[str, int]:
    norms = 2 * dims.vector_count()  # RMSNorm weights and biases, fp16
    matrices = sum(w.storage_bytes for w in plan.encoded.values())
    streamed = norms + sum(w.storage_bytes for p, w in plan.encoded.items() if p != "embed")
    if "embed" in plan.encoded:
        e = plan.encoded["embed"]
        streamed += e.storage_bytes // e.shape[0]
    return {"matrices": int(matrices), "norms": int(norms), "decode_streamed": int(streamed)}


def kv_bytes_per_token(dims: LlamaDims, context: int) -> int:
    """Each decode call reads and rewrites every fp16 cache state in full (the one-hot write keeps shapes static)."""
    return 2 * 2 * dims.layers * dims.kv_heads * dims.head_dim * context * 2


def build_manifest(source: WeightSource, dims: LlamaDims, settings: ExportSettings, plan: WeightPlan,
                   functions: dict[str, int]) -> dict[str, Any]:
    enc = get_encoding(settings.encoding)
    sizes = package_weight_bytes(plan, dims)
    return {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "producer": f"accel {__version__}",
        "source": source.spec,
        "source_kind": source.kind,
        "architecture": (dims.config.get("architectures") or ["LlamaForCausalLM"])[0],
        "dims": {"vocab": dims.vocab, "hidden": dims.hidden, "intermediate": dims.intermediate,
                 "layers": dims.layers, "heads": dims.heads, "kv_heads": dims.kv_heads, "head_dim": dims.head_dim,
                 "tied": dims.tied, "params": dims.param_count()},
        "config": dims.config,
        "encoding": settings.encoding,
        "nominal_bits": enc.bits,
        "context": settings.context,
        "padding_position": settings.context,
        "functions": {name: {"seq": seq} for name, seq in functions.items()},
        "default_function": DEFAULT_FUNCTION,
        "inputs": {"input_ids": "int32 (1, seq)", "position_ids": "int32 (1, seq)"},
        "outputs": [f"logits_{i}" for i in range(len(dims.head_pieces))],
        "head_pieces": [list(r) for r in dims.head_pieces],
        "states": {"names": [f"{kv}_cache_{i}" for i in range(dims.layers) for kv in ("k", "v")],
                   "shape": [1, dims.kv_heads, dims.head_dim, settings.context], "dtype": "fp16"},
        "weights": {p: {"source": hf, "rows": list(rows) if rows else None, "kind": plan.encoded[p].kind,
                        "mil_name": plan.mil_name(p), "shape": list(plan.encoded[p].shape),
                        "bits": plan.encoded[p].bits, "from": plan.encoded[p].source,
                        "storage_bytes": plan.encoded[p].storage_bytes}
                    for p, (hf, rows) in plan.sources.items()},
        "weight_bytes": sizes,
        "predicted": {
            "weight_bytes_per_token": sizes["decode_streamed"],
            "weight_bytes_per_token_by_encoding": predicted_bytes_table(dims, plan),
            "kv_bytes_per_token": kv_bytes_per_token(dims, settings.context),
        },
    }


def harness_source() -> Path:
    return Path(__file__).parent / "probe" / "harness.py"


def add_package_items(package: Path, items: dict[str, bytes]) -> None:
    """Register accel's files as items of the package (author com.github.accel), beside the Core ML model."""
    from coremltools import libmodelpackage

    pkg = libmodelpackage.ModelPackage(str(package))
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in items.items():
            path = Path(tmp) / name
            path.write_bytes(data)
            pkg.addItem(str(path), name, ACCEL_AUTHOR, f"accel {name}")


# Package item identifiers are UUIDs that libmodelpackage draws at random; accel derives them from the item's
# path in the package instead, so that the same export writes the same Manifest.json.
PACKAGE_ITEM_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://github.com/accel/mlpackage-item")


def package_item_id(path: str) -> str:
    """The identifier of the package item at `path` (relative to Data/, as Manifest.json records it)."""
    return str(uuid.uuid5(PACKAGE_ITEM_NAMESPACE, path))


def canonicalize_package(package: Path) -> None:
    """Make a written package byte-deterministic without changing what it holds (accel's post-save step).

    coremltools writes the model spec with protobuf's default serialization, whose map fields (the program's
    `functions`, every operation's `inputs` and `attributes`) come out in an order that changes from process
    to process (upb's hash seed), and libmodelpackage names each item of Manifest.json with a random UUID. The
    spec is re-serialized canonically (map entries sorted by key; it parses back to an equal message, which is
    checked), and the items are renamed to `package_item_id(path)`, the root model's reference with them."""
    from coremltools.proto import Model_pb2

    package = Path(package)
    manifest_path = package / "Manifest.json"
    doc = json.loads(manifest_path.read_text(encoding="utf-8"))
    entries = doc["itemInfoEntries"]
    ids = {old: package_item_id(entry["path"]) for old, entry in entries.items()}
    if len(set(ids.values())) != len(ids):
        raise AccelError(f"internal error: {package}: two package items share a path")
    root = doc.get("rootModelIdentifier")
    if root is not None:
        spec_path = package / "Data" / entries[root]["path"]
        spec = Model_pb2.Model()
        spec.ParseFromString(spec_path.read_bytes())
        canonical = spec.SerializeToString(deterministic=True)
        check = Model_pb2.Model()
        check.ParseFromString(canonical)
        if check != spec:
            raise AccelError(f"internal error: {spec_path}: the canonical spec does not parse back equal")
        spec_path.write_bytes(canonical)
        doc["rootModelIdentifier"] = ids[root]
    doc["itemInfoEntries"] = {ids[old]: entry for old, entry in entries.items()}
    # libmodelpackage's own layout: 4-space indent, sorted keys, a final newline
    manifest_path.write_text(json.dumps(doc, indent=4, sort_keys=True) + "\n", encoding="utf-8")


def package_item_path(package: Path, name: str) -> Path:
    """Where one accel item of a package lies (found through the package manifest)."""
    package = Path(package)
    manifest_path = package / "Manifest.json"
    try:
        manifest = jsontext.loads(manifest_path.read_text(encoding="utf-8"))
        entries = manifest["itemInfoEntries"]
        for entry in entries.values():
            if entry.get("author") == ACCEL_AUTHOR and entry.get("name") == name:
                path = (package / "Data" / entry["path"]).resolve()
                break
        else:
            raise FormatError(f"{package}: no accel item {name!r} (not a package written by accel export-ane)")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise FormatError(f"{package}: not a Core ML package (unreadable Manifest.json: {exc})") from None
    if package.resolve() not in path.parents:
        raise FormatError(f"{package}: item {name!r} points outside the package")
    return path


def read_package_item(package: Path, name: str) -> bytes:
    """The bytes of one accel item of a package (found through the package manifest)."""
    try:
        return package_item_path(package, name).read_bytes()
    except OSError as exc:
        raise FormatError(f"{package}: item {name!r} is missing ({exc.strerror})") from None


def package_files_sha256(package: Path) -> dict[str, str]:
    """SHA-256 of every file under the package's Data/ but the accel manifest, by path relative to Data/: what the
    manifest's `files` records and `accel verify` checks (the model spec, the weight file, accel's other items).
    Hidden files are left out: macOS adds .DS_Store and ._* files to directories it copies or shows."""
    from accel.formats.filehash import files_sha256

    return files_sha256(Path(package) / "Data", lambda rel: rel.rsplit("/", 1)[-1] != MANIFEST_ITEM
                        and not any(part.startswith(".") for part in rel.split("/")))


def read_manifest(package: Path) -> dict[str, Any]:
    """The package's accel manifest, its fields checked (manifest_problem) before anything reads them."""
    try:
        doc = jsontext.loads(read_package_item(package, MANIFEST_ITEM))
    except ValueError:  # UnicodeDecodeError included
        raise FormatError(f"{package}: {MANIFEST_ITEM} is not valid JSON") from None
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
        raise FormatError(f"{package}: {MANIFEST_ITEM} is not an accel-ane manifest")
    if not isinstance(doc.get("version", 0), int) or doc.get("version", 0) > MANIFEST_VERSION:
        raise FormatError(f"{package}: manifest version {doc.get('version')!r} is newer than this accel reads")
    problem = manifest_problem(doc)
    if problem:
        raise FormatError(f"{package}: {MANIFEST_ITEM} is damaged: {problem}")
    return doc


def manifest_problem(doc: dict[str, Any]) -> str | None:
    """The first field of an accel-ane manifest that is missing or of the wrong type (None when all are right):
    the fields inspect, verify and probe report read."""
    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    def positive(v: Any) -> bool:  # sizes, counts and the denominators of probe report's ratios
        return is_int(v) and 0 < v < 2**53

    def pair(v: Any) -> bool:
        return isinstance(v, list) and len(v) == 2 and all(is_int(x) for x in v)

    for key, ok in [("encoding", lambda v: isinstance(v, str)), ("architecture", lambda v: isinstance(v, str)),
                    ("source", lambda v: isinstance(v, str)), ("context", positive), ("nominal_bits", positive),
                    ("outputs", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)),
                    ("functions", lambda v: isinstance(v, dict) and all(
                        isinstance(v.get(f), dict) and positive(v[f].get("seq")) for f in ("prefill", "decode"))),
                    ("dims", lambda v: isinstance(v, dict) and all(positive(v.get(k)) for k in (
                        "vocab", "hidden", "layers", "heads", "kv_heads", "head_dim", "params"))),
                    ("predicted", lambda v: isinstance(v, dict) and positive(v.get("weight_bytes_per_token"))
                     and is_int(v.get("kv_bytes_per_token")) and v["kv_bytes_per_token"] >= 0),
                    ("weights", lambda v: isinstance(v, dict))]:
        if key not in doc or not ok(doc[key]):
            return f"'{key}' is missing or not what export writes"
    for name, info in doc["weights"].items():
        if not (isinstance(info, dict) and all(isinstance(info.get(k), str) for k in ("mil_name", "source", "from"))
                and info.get("kind") in ("lut", "shift_scale", "const") and pair(info.get("shape"))
                and (info.get("rows") is None or pair(info.get("rows"))) and is_int(info.get("storage_bytes"))):
            return f"weight '{name}' is missing a field or holds one of the wrong type"
    files = doc.get("files", {})
    if not (isinstance(files, dict) and all(isinstance(v, str) for v in files.values())):
        return "'files' is not an object of path to SHA-256"
    return None


# --------------------------------------------------------------------------------------------------- export
def export_ane(model: str | Path, out: Path, settings: ExportSettings, force: bool = False,
               progress: Progress = SILENT) -> dict[str, Any]:
    """Export MODEL (HF dir, GGUF, alias or accel OUT_DIR) as a multifunction ANE package at `out`."""
    from accel.converters.coreml import placement
    from accel.converters.materialize import loading_problem
    from accel.formats.atomic import check_output_dir, output_dir, path_for_report

    started = time.perf_counter()
    settings.check()
    out = Path(out)
    if out.suffix != PACKAGE_SUFFIX:
        raise AccelError(f"--out must name a {PACKAGE_SUFFIX} directory (Core ML packages need the suffix), "
                         f"got {out}")
    source = WeightSource(model)
    try:
        inputs = [Path(model)] if Path(model).exists() else []
        check_output_dir(out, force, inputs)
        problem = loading_problem(source.config, source.shapes())
        if problem:  # an invalid config (llama_dims reads it) or one that does not describe the tensors
            raise AccelError(f"{model}: {problem} (its config does not describe its tensors)")
        dims = llama_dims(source.config)
        prefill = min(settings.prefill, settings.context)
        check_ane_shapes(dims, settings.context, prefill)
        warnings = export_warnings(model, source, settings, prefill)
        functions = {"prefill": prefill, "decode": 1}
        timings: dict[str, float] = {}

        t = time.perf_counter()
        progress.stage("loading weights", 1)
        ane = build_ane_llama(dims, settings.context, source.float)
        progress.advance()
        plan = plan_weights(ane, source, settings.encoding, progress)
        timings["load_and_encode"] = time.perf_counter() - t

        programs = {}
        progress.stage("converting functions", len(functions))
        for name, seq in functions.items():
            t = time.perf_counter()
            prog = convert_function(ane, seq)
            run_accel_passes(prog, plan)
            programs[name] = prog
            timings[f"convert_{name}"] = time.perf_counter() - t
            progress.advance()
        del ane

        t = time.perf_counter()
        report = {name: placement.ane_placement_report(prog.functions["main"]) for name, prog in programs.items()}
        naive = None
        if settings.naive:
            progress.stage("converting the naive baseline", 1)
            naive_prog = placement.convert_naive(source, dims, prefill)
            naive = placement.ane_placement_report(naive_prog.functions["main"])
            del naive_prog
            progress.advance()
        timings["placement"] = time.perf_counter() - t

        t = time.perf_counter()
        progress.stage("writing the package", 1)
        manifest = build_manifest(source, dims, settings, plan, functions)
        placement_doc = {"functions": {k: v.to_json() for k, v in report.items()},
                         "naive": naive.to_json() if naive else None,
                         "naive_conversion": placement.NAIVE_DESCRIPTION if naive else None,
                         "rules": placement.rules_table()}
        mlmodel = serialize(merge_functions(programs))
        del programs
        add_package_items(Path(mlmodel.package_path), {
            MANIFEST_ITEM: (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode(),
            PLACEMENT_ITEM: (json.dumps(placement_doc, sort_keys=True, separators=(",", ":")) + "\n").encode(),
            HARNESS_ITEM: harness_source().read_bytes(),
        })
        with output_dir(out, force, inputs) as tmp:
            shutil.copytree(mlmodel.package_path, tmp, dirs_exist_ok=True)
            canonicalize_package(tmp)
            manifest["files"] = package_files_sha256(tmp)  # the final bytes: after canonicalization
            package_item_path(tmp, MANIFEST_ITEM).write_bytes(
                (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
        shutil.rmtree(mlmodel.package_path, ignore_errors=True)
        progress.advance()
        progress.close()
        timings["write"] = time.perf_counter() - t
    finally:
        source.close()

    decode = report["decode"]
    size = package_size(out)
    params = dims.param_count()
    return {
        "package": path_for_report(out),
        "encoding": settings.encoding,
        "context": settings.context,
        "functions": functions,
        "residency": decode.residency(),
        "residency_prefill": report["prefill"].residency(),
        "naive_residency": naive.residency() if naive else None,
        "predicted_weight_bytes_per_token": manifest["predicted"]["weight_bytes_per_token"],
        "predicted_kv_bytes_per_token": manifest["predicted"]["kv_bytes_per_token"],
        "package_bytes": size,
        "params": params,
        "nominal_bytes": params * get_encoding(settings.encoding).bits // 8,
        "size_ratio": size / (params * get_encoding(settings.encoding).bits / 8),
        "weights_from_codes": sum(1 for w in plan.encoded.values() if w.source == "codes"),
        "seconds": time.perf_counter() - started,
        "timings": {k: round(v, 2) for k, v in timings.items()},
        "warnings": warnings,
    }


def export_warnings(model: str | Path, source: WeightSource, settings: ExportSettings, prefill: int) -> list[str]:
    """What the package will not do that the arguments may have led a user to expect: an OUT_DIR's KV or state
    maps (the package's KV cache is fp16; export-ane encodes weights), a --prefill cut to the context."""
    warnings = []
    if source.artifact is not None:
        for kind in sorted(source.artifact.map_documents()):
            warnings.append(f"{model}'s {kind} map is not exported: the package's cache is fp16 (export-ane encodes "
                            "the weights only)")
    if prefill < settings.prefill:
        warnings.append(f"--prefill {settings.prefill} is longer than --context {settings.context}: the prefill "
                        f"function takes {prefill} tokens")
    return warnings


def package_size(package: Path) -> int:
    """Bytes of the Core ML model inside the package (model spec + weight file), accel's items excluded."""
    root = Path(package) / "Data" / "com.apple.CoreML"
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def is_package(path: Path) -> bool:
    """A Core ML package directory (what `accel inspect` and `accel verify` hand to this module)."""
    path = Path(path)
    return path.suffix == PACKAGE_SUFFIX or (path.is_dir() and (path / "Manifest.json").is_file())


def inspect_package(package: Path) -> dict[str, Any]:
    """The package's manifest and placement report, in the shape of `accel inspect --json` (tensors, bytes,
    bits_per_weight over the encoded matrices) plus the ANE fields."""
    package = Path(package)
    if not package.is_dir():
        raise AccelError(f"{package}: no such package directory")
    manifest = read_manifest(package)
    try:
        placement = jsontext.loads(read_package_item(package, PLACEMENT_ITEM))
    except ValueError:  # UnicodeDecodeError included
        raise FormatError(f"{package}: {PLACEMENT_ITEM} is not valid JSON") from None
    try:
        return _package_summary(package, manifest, placement)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # valid JSON, not the report export wrote
        raise FormatError(f"{package}: {PLACEMENT_ITEM} is damaged ({type(exc).__name__}: {exc})") from None


def _package_summary(package: Path, manifest: dict[str, Any], placement: dict[str, Any]) -> dict[str, Any]:
    from accel.converters.coreml.placement import PlacementReport

    tensors = []
    for pname, info in sorted(manifest["weights"].items()):
        rows = info["rows"]
        count = manifest_weight_count(manifest, pname)
        tensors.append({"name": info["source"] + (f"[{rows[0]}:{rows[1]}]" if rows else ""), "mil": info["mil_name"],
                        "codec": info["kind"], "layout": {"lut": "constexpr_lut_to_dense",
                                                          "shift_scale": "constexpr_blockwise_shift_scale",
                                                          "const": "const"}[info["kind"]],
                        "from": info["from"], "bits_per_weight": 8.0 * info["storage_bytes"] / count,
                        "bytes": info["storage_bytes"]})
    encoded = sum(t["bytes"] for t in tensors)
    weights = sum(manifest_weight_count(manifest, p) for p in manifest["weights"])
    functions = {name: PlacementReport.from_json(doc) for name, doc in placement["functions"].items()}
    naive = PlacementReport.from_json(placement["naive"]) if placement.get("naive") else None
    return {
        "package": str(package), "encoding": manifest["encoding"], "context": manifest["context"],
        "functions": manifest["functions"], "source": manifest["source"], "architecture": manifest["architecture"],
        "bits_per_weight": 8.0 * encoded / weights if weights else None,
        "bytes": package_size(package), "tensors": tensors,
        "residency": {name: r.residency() for name, r in functions.items()},
        "naive_residency": naive.residency() if naive else None,
        "off_ane": {name: r.off_ane() for name, r in functions.items()},
        "naive_off_ane": naive.off_ane() if naive else None,
        "predicted": manifest["predicted"], "rules": placement.get("rules", []),
    }


def manifest_weight_count(manifest: dict[str, Any], pname: str) -> int:
    rows, cols = manifest["weights"][pname]["shape"]
    return int(rows) * int(cols)
