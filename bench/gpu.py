"""The GPU checks of issues #4 and #6 in one short run, for a session that is lent a CUDA machine.

1. Triton matvec kernels (accel.kernels.triton_kernels): each layout's relative error against the float64
   reference (at 1536x576), then at each timed shape the time of torch's fp16 and fp32 `mv` and of every kernel,
   its stored bytes, GB/s and speedup over fp16. Issue #4's goal: leech-planes >= 2x the fp16 matvec at 4096x4096.
2. The Triton DAMP state update (accel.kernels.state_update_triton): its error against the float64 reference at a
   small shape, then the time of one decode step of 36 Qwen3-Next layers (32 heads of 128x128 each) at batch 1, 4
   and 16 against transformers' float32 update in torch ops and against the same Triton kernel on a float32 state
   (`step_f32_triton`, the fused baseline), on the same GPU. Issue #6's goal: >= 1.5x the float32 update.

Weights are random codes in each stored format (bench/gemv.py's `make_weight`); states are random, 22.5% of
channels float16 and the rest INT8 (9.9 bits a value at d_v 128), with bench/state_update.py's inputs. Times are medians
of CUDA-event timed rounds after a warm-up (Triton compiles on the first call), each arm timed twice: launched from
Python as a caller would (`us`, `*_ms`), and replayed as a CUDA graph (`us_graph`, `graph_ms`), which leaves out
the per-launch cost of Python and Triton's launcher (several microseconds a kernel, more than a 4096x4096 fp16
matvec's whole time on a large GPU; the Leech path launches a handful of kernels, the state update one per layer).
Goals are reported both ways. A kernel that fails to compile or run is reported (`error`, its goal null) and the
rest of the run goes on. The last line printed is one JSON object.

    python bench/gpu.py [--shapes 4096x4096,...] [--rounds N] [--parts matvec,state]
    python bench/gpu.py --interpret      # tiny shapes on the CPU under Triton's interpreter: checks this script

Without Triton or a CUDA GPU (and without --interpret) it says so and exits 0: CI never has a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench.benchargs import positive, run_main

KERNELS = ["int8", "int4", "int2", "base3", "leech-planes", "leech-onehot"]
SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]
STATE_BATCHES = (1, 4, 16)


def timer(device: str):
    """(seconds of `fn` per call, median over rounds): CUDA events on a GPU, wall time on the CPU."""
    import torch

    def measure(fn, calls: int, rounds: int) -> float:
        fn()  # warm-up (and Triton's compilation)
        times = []
        for _ in range(rounds):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(calls):
                    fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3 / calls)
            else:
                t = time.perf_counter()
                for _ in range(calls):
                    fn()
                times.append((time.perf_counter() - t) / calls)
        return statistics.median(times)

    return measure


def graphed(fn, calls: int):
    """`calls` back-to-back calls of fn captured in one CUDA graph (after a warm-up on a side stream, as torch's
    docs prescribe): returns the graph's replay. Timing a replay measures what the GPU spends on the kernels
    without Python's per-launch cost, which for a few-microsecond kernel is larger than the kernel (CUDA graphs are
    how decode loops are served)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay


def graph_times(arms: dict, calls: int, rounds: int, device: str) -> dict:
    """name -> seconds per call with each arm's `calls` calls replayed as one CUDA graph (None off a GPU, or where
    capture fails: the error is printed and the eager figures still stand)."""
    if device != "cuda":
        return {name: None for name in arms}
    measure = timer(device)
    return {name: attempt(f"graph of {name}", lambda fn=fn: measure(graphed(fn, calls), 1, rounds) / calls)[0]
            for name, fn in arms.items()}


def _ratio(num, den):
    return None if num is None or den is None else num / den


def _x(ratio) -> str:
    return "  n/a" if ratio is None else f"{ratio:5.2f}x"


def attempt(label: str, fn):
    """(fn(), None), or (None, "Type: message") with the error printed: one kernel that fails to compile or run on a
    real GPU must not cost the rest of a short device session."""
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - reported in the output, the run goes on
        error = f"{type(exc).__name__}: {exc}"
        print(f"{label} failed: {error}", file=sys.stderr)
        return None, error


def cycled(fns: list):
    """One callable that calls fns in turn: each call reads another copy of the weight."""
    turn = [0]

    def call():
        fns[turn[0] % len(fns)]()
        turn[0] += 1

    return call


def copies_for(nbytes: int, footprint: int) -> int:
    return max(1, min(64, -(-footprint // max(nbytes, 1))))


def matvec_checks(check_shape, shapes, device, rounds, rng, nibble_configs=(), footprint=0):
    """The Triton matvec kernels against float64 at check_shape, then timed at each shape. At the first shape the
    Leech planes weight is also timed with its stage kernels alone (`leech-planes:stages`, no transforms) and with
    each nibble-kernel launch in nibble_configs ((words an iteration, pipeline stages, warps): `leech-planes[w32 s1
    x4]`, ...), so that one run on a GPU says which launch to keep. Every arm cycles through copies of its weight
    filling at least `footprint` bytes (as bench/gemv.py does on the CPU), so that with a footprint above the L2
    cache (50 MB on an H100) the weights stream from device memory as in a model's decode step."""
    import copy

    import torch
    from gemv import make_weight

    from accel.kernels import kernel_weight, triton_kernels
    from accel.kernels.reference import reference_matvec

    measure = timer(device)
    errors = []
    shape = f"{check_shape[0]}x{check_shape[1]}"
    for kind in KERNELS:
        entry, parts = make_weight(kind, *check_shape, rng)
        x = rng.standard_normal(check_shape[1]).astype(np.float32)
        y, error = attempt(f"check {kind}", lambda e=entry, p=parts, x=x: triton_kernels.gpu_weight(
            kernel_weight(e, p)).matvec(torch.from_numpy(x).to(device)).cpu().double().numpy())
        if error is not None:
            errors.append({"shape": shape, "kernel": kind, "rel_error": None, "ok": False, "error": error})
            continue
        ref = reference_matvec(entry, parts, x)
        err = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
        errors.append({"shape": shape, "kernel": kind, "rel_error": err, "ok": err < 1e-5})
        print(f"check {kind:13s} {shape}: relative error {err:.2e}", file=sys.stderr)
    rows = []
    for r, c in shapes:
        x = torch.from_numpy(rng.standard_normal(c).astype(np.float32)).to(device)
        dense = torch.from_numpy(rng.standard_normal((r, c)).astype(np.float32)).to(device)
        arms = {}
        for name, dtype, size in (("torch-fp16", torch.float16, 2), ("torch-fp32", torch.float32, 4)):
            mats = [dense.to(dtype, copy=True) for _ in range(copies_for(r * c * size, footprint))]
            arms[name] = (cycled([lambda w=w, v=x.to(dtype): torch.mv(w, v) for w in mats]), r * c * size)
        del dense
        for kind in KERNELS:
            entry, parts = make_weight(kind, r, c, rng)
            gpu, error = attempt(f"{r}x{c} {kind}", lambda e=entry, p=parts: triton_kernels.gpu_weight(
                kernel_weight(e, p)))
            if gpu is None:
                rows.append({"shape": f"{r}x{c}", "kernel": kind, "error": error})
            else:
                nbytes = sum(int(p.nbytes) for p in parts.values())
                gpus = [gpu] + [gpu.clone() for _ in range(copies_for(nbytes, footprint) - 1)]
                arms[kind] = (cycled([lambda g=g, v=x: g.matvec(v) for g in gpus]), nbytes)
                if kind == "leech-planes" and (r, c) == shapes[0]:
                    for g in gpus:
                        g.matvec(x)  # z holds a transformed input for the stages-only arm
                    arms[f"{kind}:stages"] = (cycled([g.run_stages for g in gpus]), nbytes)
                    for block_w, stages, warps in nibble_configs:
                        tuned = [copy.copy(g) for g in gpus]  # the same device arrays; own partial sums
                        for g in tuned:
                            g.tune(block_w, stages, warps)
                        arms[f"{kind}[w{block_w} s{stages} x{warps}]"] = (
                            cycled([lambda g=g, v=x: g.matvec(v) for g in tuned]), nbytes)
                del gpus
        calls = 20 if device == "cuda" else 1
        timed = {}
        for name, (fn, _) in list(arms.items()):
            timed[name], error = attempt(f"{r}x{c} {name}", lambda fn=fn, calls=calls: measure(fn, calls, rounds))
            if error is not None:
                rows.append({"shape": f"{r}x{c}", "kernel": name, "error": error})
                del arms[name], timed[name]
        graph = graph_times({name: fn for name, (fn, _) in arms.items()}, calls, rounds, device)
        for name, (_, nbytes) in arms.items():
            nbytes += (r + c) * 4
            g = graph[name]
            row = {"shape": f"{r}x{c}", "kernel": name, "us": timed[name] * 1e6, "bytes": nbytes,
                   "gbps": nbytes / timed[name] / 1e9, "speedup_vs_fp16": _ratio(timed.get("torch-fp16"), timed[name]),
                   "us_graph": None if g is None else g * 1e6,
                   "speedup_vs_fp16_graph": _ratio(graph.get("torch-fp16"), g)}
            rows.append(row)
            print(f"{r}x{c} {name:13s} {timed[name] * 1e6:10.1f} us {row['gbps']:8.1f} GB/s  "
                  f"{_x(row['speedup_vs_fp16'])} fp16"
                  + ("" if g is None else f"  graph {g * 1e6:8.1f} us {_x(row['speedup_vs_fp16_graph'])} fp16"),
                  file=sys.stderr)
        del arms
        if device == "cuda":
            torch.cuda.empty_cache()
    return errors, rows


def _high(rng, h, dk, dv):
    """[h, dk] 0/1: random channels in float16, as many as 9.9 bits a value allow (bench/state_update.py's rule)."""
    from state_update import high_fraction

    high = np.zeros(h * dk, dtype=np.uint8)
    high[rng.permutation(h * dk)[: int(high_fraction(dv) * h * dk)]] = 1
    return high.reshape(h, dk)


def _on_device(state, device):
    import torch

    return [torch.from_numpy(np.ascontiguousarray(a)).to(device)
            for a in (state.slot, state.hi.view(np.float16), state.lo, state.lo_scale.view(np.float16))]


def _time_state(layers, batch, heads, dk, dv, device, rounds, rng) -> dict:
    """One decode step of `layers` layers, each with its own state: the float32 update in torch ops and as a fused
    Triton kernel, against Triton on DAMP storage."""
    import torch
    from state_update import inputs

    from accel.kernels.state_update import MixedState, step_torch
    from accel.kernels.state_update_triton import step_f32_triton, step_mixed_triton

    high = _high(rng, heads, dk, dv)
    f32 = [torch.from_numpy((rng.normal(size=(batch, heads, dk, dv)) * 0.05).astype(np.float32)).to(device)
           for _ in range(layers)]
    damp = [_on_device(MixedState.from_float(s.cpu().numpy(), high), device) for s in f32]
    fused = [s.clone() for s in f32]
    inputs = [tuple(torch.from_numpy(x).to(device) for x in inputs(rng, batch, heads, dk, dv, False))
              for _ in range(layers)]

    def run_torch():
        for i in range(layers):
            _, f32[i] = step_torch(f32[i], *inputs[i])

    def run_fused():
        for i in range(layers):
            step_f32_triton(fused[i], *inputs[i])

    def run_damp():
        for i in range(layers):
            step_mixed_triton(*damp[i], *inputs[i])

    measure = timer(device)
    arms = {"torch": run_torch, "fused": run_fused, "damp": run_damp}
    t, errors = {}, {}
    for name, fn in list(arms.items()):
        t[name], error = attempt(f"state update batch {batch} {name}", lambda fn=fn: measure(fn, 1, rounds))
        if error is not None:
            errors[name] = error
            del arms[name]
    g = graph_times(arms, 1, rounds, device)
    ms = {k: None if v is None else v * 1e3 for k, v in t.items()}
    row = {"shape": f"{layers} layers x batch {batch}, {heads}x{dk}x{dv}", "torch_f32_ms": ms["torch"],
           "triton_f32_ms": ms["fused"], "triton_damp_ms": ms["damp"],
           "f32_state_bytes": sum(s.numel() * 4 for s in f32),
           "damp_state_bytes": sum(sum(x.numel() * x.element_size() for x in d[1:]) for d in damp),
           "speedup_vs_torch_f32": _ratio(t["torch"], t["damp"]),
           "speedup_vs_triton_f32": _ratio(t["fused"], t["damp"]),
           "graph_ms": {k: None if v is None else v * 1e3 for k, v in g.items()},
           "speedup_vs_torch_f32_graph": _ratio(g.get("torch"), g.get("damp")),
           "speedup_vs_triton_f32_graph": _ratio(g.get("fused"), g.get("damp")), "errors": errors}

    def fmt(v):
        return "     n/a" if v is None else f"{v:8.3f}"

    print(f"state update {row['shape']}: torch f32 {fmt(ms['torch'])} ms  Triton f32 {fmt(ms['fused'])} ms  "
          f"Triton DAMP {fmt(ms['damp'])} ms  {_x(row['speedup_vs_torch_f32'])} / {_x(row['speedup_vs_triton_f32'])}",
          file=sys.stderr)
    if g.get("damp") is not None:
        print(f"  as CUDA graphs: {_x(row['speedup_vs_torch_f32_graph'])} / {_x(row['speedup_vs_triton_f32_graph'])}",
              file=sys.stderr)
    return row


def state_checks(check, layers, heads, dk, dv, batches, device, rounds, rng) -> tuple[dict, list[dict]]:
    import torch
    from state_update import inputs

    from accel.kernels.state_update import MixedState, reference_step
    from accel.kernels.state_update_triton import step_mixed_triton

    b, h, cdk, cdv = check
    state = MixedState.from_float(rng.normal(size=check) * 0.3, _high(rng, h, cdk, cdv))
    inp = inputs(rng, b, h, cdk, cdv, False)
    o_ref, _ = reference_step(state.to_float(), *inp)
    o, failed = attempt("check state update", lambda: step_mixed_triton(
        *_on_device(state, device), *(torch.from_numpy(x).to(device) for x in inp)).cpu().numpy())
    shape = "x".join(map(str, check))
    if failed is not None:
        error = {"shape": shape, "max_error_vs_max": None, "ok": False, "error": failed}
    else:
        err = float(np.abs(o - o_ref).max() / np.abs(o_ref).max())
        error = {"shape": shape, "max_error_vs_max": err, "ok": err < 1e-5}
        print(f"check state update {shape}: max error / max |o| {err:.2e}", file=sys.stderr)
    rows = []
    for batch in batches:
        row, failed = attempt(f"state update batch {batch}",
                              lambda batch=batch: _time_state(layers, batch, heads, dk, dv, device, rounds, rng))
        rows.append(row if failed is None else {"shape": f"{layers} layers x batch {batch}", "error": failed})
    return error, rows


def _int_lists(sep: str, width: int | None = None):
    """An argparse type: comma-separated groups of positive integers joined by `sep` (4096x4096, 32:1:4)."""
    def parse(text: str) -> list[tuple[int, ...]]:
        groups = []
        for item in filter(None, text.split(",")):
            try:
                values = tuple(int(v) for v in item.split(sep))
            except ValueError:
                raise argparse.ArgumentTypeError(f"{item!r}: not integers joined by {sep!r}") from None
            if (width is not None and len(values) != width) or min(values) < 1:
                raise argparse.ArgumentTypeError(f"{item!r}: want {width or 'some'} positive integers joined by "
                                                 f"{sep!r}")
            groups.append(values)
        if not groups:
            raise argparse.ArgumentTypeError("empty list")
        return groups
    return parse


def _parts(text: str) -> set[str]:
    parts = set(filter(None, text.split(",")))
    if not parts or not parts <= {"matvec", "state"}:
        raise argparse.ArgumentTypeError(f"{text!r}: choose matvec, state or matvec,state")
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=_int_lists("x", 2), default=None,
                        help="timed matvec shapes, e.g. 4096x4096,14336x4096 (default: the three large)")
    parser.add_argument("--rounds", type=positive, default=None, help="timed rounds per arm (median; default 7, "
                                                                      "quick 3)")
    parser.add_argument("--parts", type=_parts, default={"matvec", "state"},
                        help="which sections to run: matvec, state or both")
    parser.add_argument("--nibble-configs", type=_int_lists(":", 3), default="32:1:4,64:1:4,32:3:4,64:2:8,128:1:8",
                        help="Leech nibble-kernel launches also timed at the first shape: WORDS:STAGES:WARPS,...")
    parser.add_argument("--footprint-mb", type=positive, default=None,
                        help="MiB of weight copies each timed arm cycles through (default: 4x the GPU's L2)")
    parser.add_argument("--quick", action="store_true", help="3 timed rounds per arm")
    parser.add_argument("--json", action="store_true",
                        help="accepted for the benchmarks' common form: the last line is always one JSON object")
    parser.add_argument("--interpret", action="store_true",
                        help="tiny shapes on the CPU under TRITON_INTERPRET=1 (checks the script, times nothing)")
    args = parser.parse_args()
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch

    from accel.kernels import triton_kernels

    device = triton_kernels._device()
    if device is None or (device == "cpu" and not args.interpret):
        print("bench/gpu.py: no CUDA GPU with Triton here (run with --interpret to check the script on the CPU)")
        print(json.dumps({"bench": "gpu", "device": None}))
        return
    rng = np.random.default_rng(0)
    if args.interpret:
        check_shape, shapes, state_check, state = (37, 96), [(48, 96)], (1, 2, 16, 32), (2, 2, 16, 32, (1, 2))
        rounds = 1
    else:
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 arm in full float32
        check_shape, state_check = (1536, 576), (2, 8, 64, 64)
        rounds = args.rounds or (3 if args.quick else 7)
        state = (36, 32, 128, 128, STATE_BATCHES)
        shapes = args.shapes or SHAPES
    if args.footprint_mb is not None:
        footprint = args.footprint_mb * 2**20
    elif device == "cuda":  # four times the L2 cache
        footprint = 4 * torch.cuda.get_device_properties(0).L2_cache_size
    else:  # the interpreter: a few copies of the tiny weights, to run the cycling
        footprint = 2**16
    started = time.perf_counter()
    parts = args.parts
    errors, rows, state_error, state_rows = [], [], {"ok": True, "skipped": True}, []
    if "matvec" in parts:
        configs = args.nibble_configs
        print(f"weights cycled over at least {footprint / 2**20:.2f} MiB per arm", file=sys.stderr)
        found, failed = attempt("matvec section", lambda: matvec_checks(check_shape, shapes, device, rounds, rng,
                                                                        configs, footprint))
        errors, rows = found if failed is None else ([{"kernel": "all", "ok": False, "error": failed}], [])
    if "state" in parts:
        layers, heads, dk, dv, batches = state
        found, failed = attempt("state section", lambda: state_checks(state_check, layers, heads, dk, dv, batches,
                                                                      device, rounds, rng))
        state_error, state_rows = found if failed is None else ({"ok": False, "error": failed}, [])
    name = "cpu (Triton interpreter)" if device == "cpu" else torch.cuda.get_device_name()
    big = [r for r in rows if r["shape"] == "4096x4096" and r["kernel"] == "leech-planes"]
    launches = [r for r in rows if r["shape"] == "4096x4096" and "us" in r
                and (r["kernel"] == "leech-planes" or r["kernel"].startswith("leech-planes["))]

    def best(key):
        """The best ratio over the nibble launches tried (None if none was timed): what setting the fastest as
        GpuWeight's default would give."""
        found = [r[key] for r in launches if r.get(key) is not None]
        return max(found) if found else None

    def at_least(found, key, goal):
        """True / False when every row has the ratio; None when a row is missing it (failed, or not measured)."""
        ratios = [r.get(key) for r in found]
        return None if not ratios or any(x is None for x in ratios) else all(x >= goal for x in ratios)

    goals = {"leech_planes_2x_fp16_at_4096": at_least(big, "speedup_vs_fp16", 2.0),
             "leech_planes_2x_fp16_at_4096_graph": at_least(big, "speedup_vs_fp16_graph", 2.0),
             "leech_planes_best_launch_vs_fp16": best("speedup_vs_fp16"),
             "leech_planes_best_launch_vs_fp16_graph": best("speedup_vs_fp16_graph"),
             "damp_state_1.5x_torch_f32": at_least(state_rows, "speedup_vs_torch_f32", 1.5),
             "damp_state_1.5x_triton_f32": at_least(state_rows, "speedup_vs_triton_f32", 1.5),
             "damp_state_1.5x_torch_f32_graph": at_least(state_rows, "speedup_vs_torch_f32_graph", 1.5),
             "damp_state_1.5x_triton_f32_graph": at_least(state_rows, "speedup_vs_triton_f32_graph", 1.5),
             "all_errors_ok": all(e["ok"] for e in errors) and state_error["ok"]}
    print(json.dumps({"bench": "gpu", "device": name, "seconds": time.perf_counter() - started, "footprint": footprint,
                      "matvec_errors": errors, "rows": rows, "state_error": state_error, "state_rows": state_rows,
                      "goals": goals}))


if __name__ == "__main__":
    sys.exit(run_main(main))
