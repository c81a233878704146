"""Speed of one recurrent-state decode step: DAMP storage (C kernel) against the float32 update, in one run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/state_update.py [--quick] [--threads N] [--json]

Arms per shape: `torch_f32` (transformers' recurrent update in PyTorch ops, float32 state), `c_f32` (the same
loop as the DAMP kernel on a float32 state), `c_damp` (accel.kernels.state_update.step_mixed on DAMP storage: 22.5%
of channels float16 at d_v 128 so the state holds 9.9 bits per value with scales, the rest INT8; at the fixtures'
d_v 64, 21.3%), `c_water` (step_water on an `alloc=water` map's storage at 9.9 bits: every channel its own INT-K
width, chosen by the map's own water-filling on random log-normal channel risks, so widths spread over ~6..13),
and `copy` (numpy copy of the float32 state's bytes, then of the DAMP bytes: the bandwidth floor).
One step updates every linear-attention layer once (each has its own state, as in decoding), so for many layers
the states do not stay in the core's caches between their updates (this machine reports a 480 MB L3, so only
batch 16, 1.2 GB of float32 state, is certain to stream from DRAM). Shapes: the committed fixtures (from their
configs: 3 layers of 4 heads × 64×64; tiny-kda's row with KDA's per-channel decay), Qwen3-Next's per-layer state
(32 heads of 128×128) for one layer, and for 36 layers (Qwen3-Next-80B's linear layers) at batch 1, 4 and 16.
Times are medians over repeats, the arms timed round-robin so that load from other processes hits them alike;
the GDN decay (one per head) is used, and KDA's per-channel decay is timed at the Qwen3-Next shape too.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from accel.converters.aliases import FIXTURES_DIR
from accel.kernels.state_update import MixedState, WaterState, step_f32, step_mixed, step_torch, step_water
from accel.quantize.damp import WATER_BITS, water_fill
from accel.runtime.state_cache import row_bits
from accel.runtime.state_shapes import state_shape
from bench.benchargs import positive, run_main

TARGET_BITS = 9.9


def high_fraction(d_v: int) -> float:
    lo, hi = row_bits("int8", d_v), row_bits("fp16", d_v)
    return (TARGET_BITS - lo) / (hi - lo)


def water_widths(rng, h: int, dk: int, dv: int) -> np.ndarray:
    """An alloc=water map's widths [h, dk] at TARGET_BITS, water-filled on random log-normal risks r·4^-K."""
    risk = np.exp(rng.normal(size=h * dk) * 2.0)
    loss = risk[:, None] * 4.0 ** -np.asarray(WATER_BITS, dtype=np.float64)[None, :]
    steps = int(np.floor((TARGET_BITS - row_bits(f"int{WATER_BITS[0]}", dv)) * h * dk + 1e-6))
    return (WATER_BITS[0] + water_fill(loss, steps)).astype(np.uint8).reshape(h, dk)


def fixture_shape(name: str) -> tuple:
    """A committed fixture's state, from its config: (label, layers, batch, heads, d_k, d_v, KDA decay)."""
    shape = state_shape(json.loads((FIXTURES_DIR / name / "config.json").read_text()))
    return (f"{name}, {len(shape.layers)} layers", len(shape.layers), 1, shape.heads, shape.d_k, shape.d_v,
            shape.arch == "kda")


def inputs(rng, b, h, dk, dv, kda):
    q = rng.normal(size=(b, h, dk)).astype(np.float32)
    q /= np.linalg.norm(q, axis=-1, keepdims=True) * np.sqrt(dk)
    k = rng.normal(size=(b, h, dk)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.normal(size=(b, h, dv)).astype(np.float32)
    g = (-rng.random((b, h, dk) if kda else (b, h)) * 0.1).astype(np.float32)
    beta = rng.random((b, h)).astype(np.float32)
    return q, k, v, g, beta


def interleaved_medians(fns: dict, repeats: int, min_seconds: float) -> dict:
    """Median seconds per call of each function, timed round-robin (one call of each per round) so that a load
    change on the machine hits every arm alike."""
    for fn in fns.values():
        fn()  # warm-up
    times = {name: [] for name in fns}
    started = time.perf_counter()
    rounds = 0
    while rounds < repeats or (time.perf_counter() - started < min_seconds and rounds < 200):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
        rounds += 1
    return {name: float(np.median(ts)) for name, ts in times.items()}


def bench_shape(name, layers, b, h, dk, dv, kda, threads, repeats, min_seconds, rng):
    states = [(rng.normal(size=(b, h, dk, dv)) * 0.05).astype(np.float32) for _ in range(layers)]
    n_high = int(np.floor(high_fraction(dv) * h * dk))
    high = np.zeros(h * dk, dtype=np.uint8)
    high[rng.permutation(h * dk)[:n_high]] = 1
    mixed = [MixedState.from_float(s, high.reshape(h, dk)) for s in states]
    widths = water_widths(rng, h, dk, dv)
    water = [WaterState.from_float(s, widths) for s in states]
    step_inputs = [inputs(rng, b, h, dk, dv, kda) for _ in range(layers)]
    torch_states = [torch.from_numpy(s.copy()) for s in states]
    torch_inputs = [tuple(torch.from_numpy(x) for x in inp) for inp in step_inputs]
    torch.set_num_threads(max(1, threads))

    def run_torch():
        for i in range(layers):
            _, torch_states[i] = step_torch(torch_states[i], *torch_inputs[i])

    def run_f32():
        for i in range(layers):
            step_f32(states[i], *step_inputs[i], threads=threads)

    def run_damp():
        for i in range(layers):
            step_mixed(mixed[i], *step_inputs[i], threads=threads)

    def run_water():
        for i in range(layers):
            step_water(water[i], *step_inputs[i], threads=threads)

    f32_bytes = sum(s.nbytes for s in states)
    damp_bytes = sum(m.nbytes for m in mixed)
    water_bytes = sum(w.nbytes for w in water)
    big_src = np.ones(f32_bytes // 4, dtype=np.float32)
    big_dst = np.empty_like(big_src)
    small_src, small_dst = big_src[: damp_bytes // 4], big_dst[: damp_bytes // 4]

    row = {"shape": name, "layers": layers, "batch": b, "heads": h, "d_k": dk, "d_v": dv,
           "decay": "kda" if kda else "gdn", "f32_state_bytes": f32_bytes, "damp_state_bytes": damp_bytes,
           "damp_bits_per_value": 8.0 * damp_bytes / (f32_bytes / 4), "high_fraction": n_high / (h * dk),
           "water_state_bytes": water_bytes, "water_bits_per_value": 8.0 * water_bytes / (f32_bytes / 4),
           "water_widths": [int(widths.min()), int(widths.max())]}
    medians = interleaved_medians({"torch_f32": run_torch, "c_f32": run_f32, "c_damp": run_damp, "c_water": run_water,
                                   "copy_f32": lambda: np.copyto(big_dst, big_src),
                                   "copy_damp": lambda: np.copyto(small_dst, small_src)}, repeats, min_seconds)
    row.update({f"{name}_ms": 1e3 * sec for name, sec in medians.items()})
    row["speedup_vs_c_f32"] = row["c_f32_ms"] / row["c_damp_ms"]
    row["speedup_vs_torch_f32"] = row["torch_f32_ms"] / row["c_damp_ms"]
    row["water_speedup_vs_c_f32"] = row["c_f32_ms"] / row["c_water_ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    parser.add_argument("--threads", type=positive, default=1, help="OpenMP / torch threads (default 1)")
    parser.add_argument("--json", action="store_true", help="accepted: the last line is always the JSON object")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    repeats, min_s = (5, 0.2) if args.quick else (9, 1.0)
    shapes = [fixture_shape(name) for name in ("tiny-gdn", "tiny-kda")]
    shapes += [("qwen3-next, 1 layer", 1, 1, 32, 128, 128, False),
              ("qwen3-next, 1 layer, KDA decay", 1, 1, 32, 128, 128, True),
              ("qwen3-next, 36 layers", 36, 1, 32, 128, 128, False)]
    if not args.quick:
        shapes += [("qwen3-next, 36 layers, batch 4", 36, 4, 32, 128, 128, False),
                   ("qwen3-next, 36 layers, batch 16", 36, 16, 32, 128, 128, False)]
    rows = []
    for shape in shapes:
        row = bench_shape(*shape, threads=args.threads, repeats=repeats, min_seconds=min_s, rng=rng)
        rows.append(row)
        print(f"{row['shape']:34s} torch f32 {row['torch_f32_ms']:9.3f} ms  C f32 {row['c_f32_ms']:9.3f} ms  "
              f"C DAMP {row['c_damp_ms']:9.3f} ms ({row['damp_bits_per_value']:.2f} bits)  "
              f"copy f32/DAMP {row['copy_f32_ms']:.3f}/{row['copy_damp_ms']:.3f} ms  "
              f"DAMP vs C f32 {row['speedup_vs_c_f32']:.2f}x, vs torch {row['speedup_vs_torch_f32']:.2f}x  "
              f"C water {row['c_water_ms']:9.3f} ms ({row['water_bits_per_value']:.2f} bits, "
              f"int{row['water_widths'][0]}..int{row['water_widths'][1]}) vs C f32 "
              f"{row['water_speedup_vs_c_f32']:.2f}x", flush=True)
    print(json.dumps({"bench": "state_update", "threads": args.threads, "target_bits": TARGET_BITS,
                      "rows": rows}))


if __name__ == "__main__":
    sys.exit(run_main(main))
