"""`accel export-ane sweep --out DIR`: a matrix of small packages that compute the same thing expressed
differently (linear vs 1x1 conv, RMSNorm fused vs decomposed, softmax forms, layouts, cache writes, encodings),
each with accel's placement prediction, plus a macOS runner that records MLComputePlan's device per op.

Comparing the runner's capture with `sweep.json` is how the placement rules of placement.py get checked.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from accel.converters.coreml.encodings import get_encoding
from accel.errors import AccelError
from accel.progress import SILENT, Progress

CHANNELS = 256
TOKENS = 8
HEADS = 4
CONTEXT = 64
SWEEP_FILE = "sweep.json"
RUNNER_FILE = "run_compute_plan.py"


@dataclass(frozen=True)
class Variant:
    name: str
    primitive: str
    description: str
    build: Callable[[], Any]            # -> (torch module, example inputs {name: tensor}, states {name: shape})
    encoding: str = "fp16"


def _modules():
    """The variant modules; defined inside a function so torch is imported only when the sweep runs."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from accel.converters.coreml.ane_llama import rms_norm_ane

    g = torch.Generator().manual_seed(0)

    def weight(*shape: int) -> nn.Parameter:
        return nn.Parameter(torch.randn(*shape, generator=g) / math.sqrt(shape[1]), requires_grad=False)

    class Linear(nn.Module):
        def __init__(self, out: int = CHANNELS):
            super().__init__()
            self.w = weight(out, CHANNELS)

        def forward(self, x):           # x: (1, S, C)
            return F.linear(x, self.w)

    class Conv(nn.Module):
        def __init__(self, out: int = CHANNELS):
            super().__init__()
            self.w = weight(out, CHANNELS)

        def forward(self, x):           # x: (1, C, 1, S)
            return F.conv2d(x, self.w[:, :, None, None])

    class ConvPieces(nn.Module):
        def __init__(self, out: int, piece: int):
            super().__init__()
            self.w = nn.ParameterList([weight(min(piece, out - s), CHANNELS) for s in range(0, out, piece)])

        def forward(self, x):
            return tuple(F.conv2d(x, w[:, :, None, None]) for w in self.w)

    class Matmul(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = weight(CHANNELS, CHANNELS)

        def forward(self, x):           # x: (1, S, C)
            return torch.matmul(x, self.w.t())

    class NormFused(nn.Module):
        def forward(self, x):           # (1, C, 1, S)
            return rms_norm_ane(x, 1e-5)

    class NormDecomposed(nn.Module):
        def forward(self, x):           # (1, S, C): the chain a plain trace of LlamaRMSNorm gives
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)

    class SoftmaxLast(nn.Module):
        def forward(self, x):
            return torch.softmax(x, dim=-1)

    class SoftmaxChannels(nn.Module):
        def forward(self, x):
            return torch.softmax(x, dim=1)

    class SoftmaxDecomposed(nn.Module):
        def forward(self, x):
            e = torch.exp(x - x.amax(dim=-1, keepdim=True))
            return e / e.sum(dim=-1, keepdim=True)

    class AttentionHeadsFirst(nn.Module):
        """(1, S, C) -> (1, H, S, D) with transposes: the layout of transformers' attention."""

        def forward(self, q, k):
            d = CHANNELS // HEADS
            qh = q.reshape(1, TOKENS, HEADS, d).transpose(1, 2)
            kh = k.reshape(1, TOKENS, HEADS, d).transpose(1, 2)
            return torch.softmax(torch.matmul(qh, kh.transpose(2, 3)), dim=-1)

    class AttentionChannelsFirst(nn.Module):
        """(1, C, 1, S) -> (1, H, D, S): heads split on channels, no transpose of the activations."""

        def forward(self, q, k):
            d = CHANNELS // HEADS
            qh = q.reshape(1, HEADS, d, TOKENS)
            kh = k.reshape(1, HEADS, d, TOKENS)
            return torch.softmax(torch.matmul(qh.transpose(2, 3), kh), dim=-1)

    class CacheOneHot(nn.Module):
        """Write S new keys into a (1, C, ctx) state with a one-hot matmul (accel's choice)."""

        def __init__(self):
            super().__init__()
            self.register_buffer("cache", torch.zeros(1, CHANNELS, CONTEXT))

        def forward(self, k, position_ids):   # k: (1, C, S); position_ids: (1, S) int32
            keys = torch.arange(CONTEXT, dtype=position_ids.dtype)
            write = (keys[None, :] == position_ids[0][:, None]).to(k.dtype)
            new = self.cache * (1.0 - write.sum(0)) + torch.matmul(k, write)
            self.cache[:, :, :] = new
            return new

    class CacheSliceUpdate(nn.Module):
        """Write S new keys at a dynamic offset with slice assignment (a dynamic-index slice_update)."""

        def __init__(self):
            super().__init__()
            self.register_buffer("cache", torch.zeros(1, CHANNELS, CONTEXT))

        def forward(self, k, start):          # start: (1,) int32
            s = start[0]
            self.cache[:, :, s:s + TOKENS] = k
            return self.cache * 1.0

    class EmbedGather(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = weight(1024, CHANNELS)

        def forward(self, ids):
            return self.table[ids[0]]

    class EmbedOneHot(nn.Module):
        """The lookup as a matmul of fp16 one-hot rows (the ids arrive as a one-hot fp16 input)."""

        def __init__(self):
            super().__init__()
            self.table = weight(1024, CHANNELS)

        def forward(self, onehot):            # (1, S, 1024) fp16 one-hot
            return torch.matmul(onehot, self.table)

    return locals()


def variants() -> list[Variant]:
    import torch

    m = _modules()
    r = lambda *shape: torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    seq_c = {"x": r(1, TOKENS, CHANNELS)}
    c_seq = {"x": r(1, CHANNELS, 1, TOKENS)}
    out = [
        Variant("proj_linear", "projection", "F.linear on (1, S, C)", lambda: (m["Linear"](), seq_c, {})),
        Variant("proj_conv1x1", "projection", "1x1 conv on (1, C, 1, S)", lambda: (m["Conv"](), c_seq, {})),
        Variant("proj_matmul", "projection", "matmul with a constant (C, C) matrix", lambda: (m["Matmul"](), seq_c, {})),
        Variant("head_20000_single", "head split", "one 1x1 conv with 20,000 output channels",
                lambda: (m["Conv"](20000), c_seq, {})),
        Variant("head_20000_pieces", "head split", "the same as two convs of at most 16,384 channels",
                lambda: (m["ConvPieces"](20000, 10000), c_seq, {})),
        Variant("rmsnorm_fused", "rmsnorm", "layer_norm over [x, -x] on the channel axis",
                lambda: (m["NormFused"](), c_seq, {})),
        Variant("rmsnorm_decomposed", "rmsnorm", "pow, mean, add, rsqrt, mul on the last axis",
                lambda: (m["NormDecomposed"](), seq_c, {})),
        Variant("softmax_last", "softmax", "softmax on the last axis", lambda: (m["SoftmaxLast"](), c_seq, {})),
        Variant("softmax_channels", "softmax", "softmax on the channel axis",
                lambda: (m["SoftmaxChannels"](), c_seq, {})),
        Variant("softmax_decomposed", "softmax", "exp(x - max) / sum", lambda: (m["SoftmaxDecomposed"](), c_seq, {})),
        Variant("attn_heads_first", "layout", "(1, H, S, D) via reshape + transpose",
                lambda: (m["AttentionHeadsFirst"](), {"q": r(1, TOKENS, CHANNELS), "k": r(1, TOKENS, CHANNELS)}, {})),
        Variant("attn_channels_first", "layout", "(1, H, D, S) straight from (1, C, 1, S)",
                lambda: (m["AttentionChannelsFirst"](), {"q": r(1, CHANNELS, 1, TOKENS),
                                                         "k": r(1, CHANNELS, 1, TOKENS)}, {})),
        Variant("cache_onehot_write", "kv write", "one-hot matmul into an fp16 state",
                lambda: (m["CacheOneHot"](), {"k": r(1, CHANNELS, TOKENS),
                                              "position_ids": torch.arange(TOKENS, dtype=torch.int32)[None]},
                         {"cache": (1, CHANNELS, CONTEXT)})),
        Variant("cache_slice_update", "kv write", "slice assignment at a dynamic offset into an fp16 state",
                lambda: (m["CacheSliceUpdate"](), {"k": r(1, CHANNELS, TOKENS),
                                                   "start": torch.tensor([3], dtype=torch.int32)},
                         {"cache": (1, CHANNELS, CONTEXT)})),
        Variant("embed_gather", "embedding", "gather rows by int32 ids",
                lambda: (m["EmbedGather"](), {"ids": torch.tensor([[1, 5, 9, 2, 7, 3, 8, 4]], dtype=torch.int32)},
                         {})),
        Variant("embed_onehot_matmul", "embedding", "fp16 one-hot rows times the table",
                lambda: (m["EmbedOneHot"](), {"onehot": torch.nn.functional.one_hot(
                    torch.tensor([[1, 5, 9, 2, 7, 3, 8, 4]]), 1024).float()}, {})),
    ]
    for enc in ("int8", "lut4", "lut2", "ternary"):
        out.append(Variant(f"proj_conv1x1_{enc}", "encoding", f"1x1 conv with {enc} weights",
                           lambda: (m["Conv"](), c_seq, {}), encoding=enc))
    return out


def convert_variant(variant: Variant):
    """Trace, convert (fp16, iOS 18), encode the conv/linear weights; returns (program, module, inputs)."""
    import torch

    from accel.converters.coreml.export import (
        COREML_PASSES,
        emit_encoded,
        import_coremltools,
        quiet_coremltools,
    )

    ct = import_coremltools()
    import accel.converters.coreml.frontend  # noqa: F401

    module, inputs, states = variant.build()
    module.eval()
    with torch.no_grad(), quiet_coremltools():
        traced = torch.jit.trace(module, tuple(inputs.values()), check_trace=False)
    for name in states:
        getattr(module, name).zero_()
    with quiet_coremltools():
        prog = ct.convert(
            traced,
            inputs=[ct.TensorType(k, shape=tuple(v.shape),
                                  dtype=np.int32 if v.dtype == torch.int32 else np.float16)
                    for k, v in inputs.items()],
            states=[ct.StateType(wrapped_type=ct.TensorType(shape=s, dtype=np.float16), name=n)
                    for n, s in states.items()],
            minimum_deployment_target=ct.target.iOS18, compute_precision=ct.precision.FLOAT16,
            convert_to="milinternal",
            pass_pipeline=ct.PassPipeline(pass_names=COREML_PASSES, pipeline_name="accel-sweep"))
    if variant.encoding != "fp16":
        _encode_conv_weights(prog, variant.encoding, emit_encoded)
    from accel.converters.coreml.export import drop_full_slice_update

    drop_full_slice_update(prog)
    return prog, module, inputs


def _encode_conv_weights(prog, encoding: str, emit) -> None:
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil.scope import ScopeInfo, ScopeSource

    enc = get_encoding(encoding)
    func = prog.functions["main"]
    with func:
        for op in list(func.operations):
            if op.op_type != "conv" or op.weight.op.op_type != "const":
                continue
            const = op.weight.op
            w = const.outputs[0].val.astype(np.float32)
            encoded = enc.encode(w.reshape(w.shape[0], -1))
            scopes = [ScopeInfo(source=k, data=list(v)) for k, v in const.scopes.items()
                      if v and k != ScopeSource.COREMLTOOLS_GRAPH_PASS]
            with mb.scope(*scopes):
                new = emit(mb, encoded, tuple(w.shape), name=f"{const.name}_{encoding}", before_op=op)
            op.enclosing_block.replace_uses_of_var_after_op(anchor_op=const, old_var=const.outputs[0], new_var=new,
                                                            no_check_var_types=True, force_replace=True)
            op.enclosing_block.remove_ops([const])


def interpreter_error(prog, module, inputs) -> float:
    """max |interpreter - torch| / max |torch| of the variant's (first) output, fp32 torch vs fp16 program."""
    import torch

    from accel.converters.coreml.mil_interp import Interpreter

    interp = Interpreter(prog)
    feed = {k: v.numpy() for k, v in inputs.items()}
    got = interp.run("main", feed)
    with torch.no_grad():
        want = module(*inputs.values())
    want = want[0] if isinstance(want, tuple) else want
    first = next(iter(got.values()))
    if first.shape != tuple(want.shape):
        return float("nan")
    want = want.float().numpy()
    return float(np.abs(first.astype(np.float32) - want).max() / max(np.abs(want).max(), 1e-6))


def run_sweep(out: Path, force: bool = False, progress: Progress = SILENT,
              only: list[str] | None = None) -> dict[str, Any]:
    """Write every variant package, `sweep.json` (predictions) and the macOS runner into `out`."""
    from accel.converters.coreml.export import canonicalize_package, import_coremltools, quiet_coremltools
    from accel.converters.coreml.placement import ane_placement_report, rules_table
    from accel.formats.atomic import output_dir

    ct = import_coremltools()
    chosen = [v for v in variants() if only is None or v.name in only]
    if only and len(chosen) != len(set(only)):
        unknown = sorted(set(only) - {v.name for v in chosen})
        raise AccelError(f"unknown sweep variant {unknown[0]!r}")
    results = []
    progress.stage("sweep variants", len(chosen))
    with output_dir(Path(out), force) as tmp:
        for variant in chosen:
            prog, module, inputs = convert_variant(variant)
            report = ane_placement_report(prog.functions["main"])
            error = interpreter_error(prog, module, inputs)
            with quiet_coremltools():
                model = ct.convert(prog, minimum_deployment_target=ct.target.iOS18,
                                   pass_pipeline=ct.PassPipeline.EMPTY, skip_model_load=True)
            package = f"{variant.name}.mlpackage"
            shutil.copytree(model.package_path, tmp / package)
            canonicalize_package(tmp / package)  # the same bytes from every run, as export-ane's
            shutil.rmtree(model.package_path, ignore_errors=True)
            doc = report.to_json()
            results.append({"name": variant.name, "primitive": variant.primitive, "description": variant.description,
                            "encoding": variant.encoding, "package": package, "ops": doc["op_count"],
                            "residency": doc["residency"], "off_ane": doc["off_ane"],
                            "predicted_ops": [{k: o[k] for k in ("op", "output", "device", "rule")}
                                              for o in report.op_rows()],
                            "interpreter_rel_error": error})
            progress.advance()
        summary = {"format": "accel-ane-sweep", "version": 1, "variants": results, "rules": rules_table(),
                   "runner": RUNNER_FILE}
        (tmp / SWEEP_FILE).write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
        (tmp / RUNNER_FILE).write_text(RUNNER_SOURCE)
    progress.close()
    return {**summary, "out": str(out)}


RUNNER_SOURCE = '''"""Record MLComputePlan's device for every op of every sweep package (macOS 14.4+, coremltools 8+).

    python3 run_compute_plan.py [SWEEP_DIR] --out sweep_capture.json

Then compare with sweep.json (accel's predictions): each op is matched by its first output name.
"""

import argparse
import json
import sys
from pathlib import Path


def device_name(device):
    name = type(device).__name__
    return "ANE" if "NeuralEngine" in name else "GPU" if "GPU" in name else "CPU" if "CPU" in name else name


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("sweep", type=Path, nargs="?", default=Path(__file__).resolve().parent)
    parser.add_argument("--out", type=Path, default=Path("sweep_capture.json"))
    args = parser.parse_args()
    import coremltools as ct
    from coremltools.models.compute_plan import MLComputePlan

    sweep = json.loads((args.sweep / "sweep.json").read_text())
    capture = {"format": "accel-ane-sweep-capture", "version": 1, "variants": {}}
    for variant in sweep["variants"]:
        path = args.sweep / variant["package"]
        try:
            compiled = ct.models.utils.compile_model(str(path))
            plan = MLComputePlan.load_from_path(path=compiled, compute_units=ct.ComputeUnit.CPU_AND_NE)
            ops = []
            for op in plan.model_structure.program.functions["main"].block.operations:
                usage = plan.get_compute_device_usage_for_mlprogram_operation(op)
                ops.append({"op": op.operator_name, "outputs": [o.name for o in op.outputs],
                            "device": device_name(usage.preferred_compute_device) if usage else None,
                            "supported": sorted({device_name(d) for d in usage.supported_compute_devices})
                            if usage else []})
            capture["variants"][variant["name"]] = {"ops": ops}
        except Exception as exc:
            capture["variants"][variant["name"]] = {"error": f"{type(exc).__name__}: {exc}"}
    args.out.write_text(json.dumps(capture, indent=1, sort_keys=True) + "\\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''
