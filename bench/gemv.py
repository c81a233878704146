"""Batch-1 matrix-vector products: accel's fused decode kernels against torch's dense fp32 and bf16 matvec.

Per shape (out x in): the time of torch.mv in fp32 and bf16, and of every accel CPU kernel on random stored
weights of its format; the bytes one call reads (every stored part of the weight, plus x and y, plus what the
kernel derives at load and reads on every call: the Leech transforms' signs and odd-factor rotation), the GB/s that
implies, the speedup over fp32, and two fractions: of the kernel's byte bound (its bytes at the bandwidth of a
1-GiB multi-threaded copy, read + write bytes counted as STREAM does: issue #4's figure) and of its read bound (its
bytes at the bandwidth of a 1-GiB read-only stream). Weights are random codes packed by the format library's own
layouts (for Leech: random ball indices of shells 2..13 converted to the serving layouts); correctness is the
tests' job.

Times are the best pass (see `_time_arms`). The arms of a shape (torch fp32 and bf16, every accel kernel, the copy
and the read) take turns inside each round, so they all meet the same host: this machine's memory is shared with
other guests, and what they leave changes by the hour. Every call in a timed loop reads a different copy of the
weight, with enough copies that they fill at least --footprint MiB, so weights come from memory and not from a
cache that a 4-MiB-per-core CPU would not have for a real model. After the table it reads issue #4's CPU goals off
the same run, per shape from 4096x4096 up (which kernels are slower than fp32 or under 60% of their byte bound; the
Leech planes kernel's time per stored weight byte over int4's), also in the JSON as `goals`. Usage: python
bench/gemv.py [--quick] [--json] [--threads N]
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

from bench.benchargs import positive, run_main

SHAPES = [(576, 576), (1536, 576), (576, 1536), (4096, 4096), (14336, 4096), (4096, 14336)]
QUICK_SHAPES = [(576, 576), (1536, 576), (576, 1536), (4096, 4096)]
KERNELS = ["int8", "int4", "int2", "base3", "leech-planes", "leech-onehot"]
GROUP = 64


def make_weight(kind: str, rows: int, cols: int, rng: np.random.Generator):
    """(TensorEntry, parts) of random codes in one stored format."""
    from accel.formats import bitpack
    from accel.formats.codecs import get_codec
    from accel.formats.tensor import TensorEntry

    ngroups = -(-cols // GROUP)
    if kind in ("int8", "int4", "int2", "base3"):
        levels = {"int8": 256, "int4": 16, "int2": 4, "base3": 3}[kind]
        layout = "base" if kind == "base3" else "packed"
        codes = rng.integers(0, levels, size=rows * cols, dtype=np.uint8)
        stored = (bitpack.pack_base_levels(codes, levels) if layout == "base"
                  else bitpack.pack_bits(codes, bitpack.bits_for_levels(levels)))
        parts = {"codes": stored,
                 "scale": (rng.random((rows, ngroups)) * 0.01 + 0.001).astype(np.float16),
                 "offset": (rng.standard_normal((rows, ngroups)) * 0.01).astype(np.float16)}
        entry = TensorEntry("w", "affine", {"levels": levels, "group": GROUP, "symmetric": False,
                                            "scale_dtype": "float16"}, (rows, cols), layout, "quantized")
    else:
        from accel.formats.leech_codec import ball_levels
        from accel.quantize.leech_weights import padded_width, stage_alphas

        layout = kind.split("-")[1]
        padded = padded_width(rows, cols, (13,))  # the width accel quantize writes
        params = {"stages": [{"max_shell": 13, "alpha": stage_alphas((13,))[0]}], "cols": padded,
                  "seed_in": 1, "seed_out": 2, "scale_dtype": "float16"}
        levels = ball_levels(13)
        indices = rng.integers(0, levels, size=rows * padded // 24, dtype=np.uint64)
        codec = get_codec("leech")
        parts = {"codes": codec.layout_for(layout, "codes", params).pack(indices, levels),
                 "scale": (rng.random(rows) * 0.01 + 0.001).astype(np.float16)}
        entry = TensorEntry("w", "leech", params, (rows, cols), layout, "quantized")
    return entry, parts


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """"ROWSxCOLS[,ROWSxCOLS...]" as (rows, cols) pairs; ValueError if it is not that."""
    shapes = [tuple(int(n) for n in s.split("x")) for s in text.split(",") if s]
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise ValueError(text)
    return shapes


def _replicas(parts: dict[str, np.ndarray], nbytes: int, footprint: int) -> list[dict[str, np.ndarray]]:
    copies = max(1, min(64, -(-footprint // max(nbytes, 1))))
    return [parts] + [{k: v.copy() for k, v in parts.items()} for _ in range(copies - 1)]


def _time_arms(arms: dict[str, list], min_seconds: float, turn_seconds: float = 0.02) -> dict[str, tuple[float, float]]:
    """Per arm, (best, median) seconds of one call, from rounds in which the arms take turns.

    In its turn an arm runs passes over its calls (each call once a pass) for at least turn_seconds and at least
    two passes; the first pass of a turn is not counted (the arm before it left the caches, and torch's thread
    pool, in its own state). Rounds go on until every arm has had min_seconds and at least 5 counted passes.
    The best pass is the figure reported: on a shared 2-core machine a pass in which another process takes a
    core makes every fork-join kernel (torch's and ours alike) wait for its parked thread, and the best pass is
    the one that measured the kernel rather than the neighbours. The median is kept in the JSON."""
    samples: dict[str, list[float]] = {name: [] for name in arms}
    started = time.perf_counter()
    while time.perf_counter() - started < min_seconds * len(arms) or min(map(len, samples.values())) < 5:
        for name, calls in arms.items():
            turn_started, passes = time.perf_counter(), 0
            while True:
                t0 = time.perf_counter()
                for call in calls:
                    call()
                t1 = time.perf_counter()
                passes += 1
                if passes > 1:
                    samples[name].append((t1 - t0) / len(calls))
                    if t1 - turn_started >= turn_seconds:
                        break
    return {name: (min(s), statistics.median(s)) for name, s in samples.items()}


def bandwidth_arms(threads: int, mib: int = 1024) -> dict:
    """The probes over mib MiB, every thread on its own slice: "copy" (the issue's large copy: read + write bytes
    counted, as STREAM does) and two read-only sums (`accel_read`): "read-1" one plain stream a thread, "read-2" two
    streams a thread with software prefetch; name -> (call, bytes). The read bound is the faster of the two: which
    one wins changes with the host (docs/kernels.md, "Streaming").

    1 GiB, as the copy probe always was: glibc's memcpy writes a copy that large with non-temporal stores, while at
    256 MiB and below it reads each destination line before writing it (3 bytes on the bus for the 2 counted) and
    measured 25-27 GB/s here against 45-48 at 512 MiB and up."""
    from accel.kernels._build import library

    lib = library()
    n = mib * 2**20 // 4
    src = np.ones(n, dtype=np.float32)
    dst = np.zeros_like(src)
    arms = {"copy": ((lambda: lib.accel_copy(dst.ctypes.data, src.ctypes.data, n, threads)), 2 * n * 4)}
    for streams in (1, 2):
        arms[f"read-{streams}"] = ((lambda s=streams: lib.accel_read(src.ctypes.data, n, threads, s)), n * 4)
    return arms


def run(shapes, kernels, threads: int, min_seconds: float, footprint: int, seed: int = 0) -> dict:
    import torch

    from accel.kernels.weights import kernel_weight, set_threads

    torch.set_num_threads(threads)
    set_threads(threads)
    rng = np.random.default_rng(seed)
    probes = bandwidth_arms(threads)
    rows_out, probe_gbps = [], {}
    for rows, cols in shapes:
        shape = f"{rows}x{cols}"
        x = rng.standard_normal(cols).astype(np.float32)
        xt = torch.from_numpy(x)
        io_bytes = 4 * (rows + cols)
        arms, call_bytes, stored = {name: [call] for name, (call, _) in probes.items()}, {}, {}
        for name, dtype in (("torch-fp32", torch.float32), ("torch-bf16", torch.bfloat16)):
            w = torch.randn(rows, cols, dtype=torch.float32).to(dtype)
            nbytes = w.numel() * w.element_size()
            ws = [w] + [w.clone() for _ in range(max(0, min(16, -(-footprint // nbytes)) - 1))]
            xv = xt.to(dtype)
            arms[name] = [(lambda m=m, xv=xv: torch.mv(m, xv)) for m in ws]
            call_bytes[name] = nbytes + io_bytes * (2 if dtype == torch.bfloat16 else 4) // 4
        for kind in kernels:
            entry, parts = make_weight(kind, rows, cols, rng)
            nbytes = sum(a.nbytes for a in parts.values())
            weights = [kernel_weight(entry, p) for p in _replicas(parts, nbytes, footprint)]
            out = np.empty(rows, dtype=np.float32)
            arms[kind] = [(lambda k=k, x=x, out=out: k.matvec(x, out)) for k in weights]
            call_bytes[kind] = weights[0].call_bytes + io_bytes
            stored[kind] = weights[0].nbytes + io_bytes
        timed = _time_arms(arms, min_seconds)
        del arms
        gbps = probe_gbps[shape] = {name: nbytes / timed.pop(name)[0] / 1e9 for name, (_, nbytes) in probes.items()}
        gbps["read"] = max(gbps["read-1"], gbps["read-2"])
        fp32 = timed["torch-fp32"][0]
        for kernel, (seconds, median) in timed.items():
            nbytes = call_bytes[kernel]
            rows_out.append({"shape": shape, "kernel": kernel, "us": seconds * 1e6, "us_median": median * 1e6,
                             "bytes": int(nbytes), "stored_bytes": int(stored.get(kernel, nbytes)),
                             "gbps": nbytes / seconds / 1e9, "speedup_vs_fp32": fp32 / seconds,
                             "copy_gbps": gbps["copy"], "read_gbps": gbps["read"],
                             "byte_bound_fraction": nbytes / (gbps["copy"] * 1e9) / seconds,
                             "read_bound_fraction": nbytes / (gbps["read"] * 1e9) / seconds})
        print(f"  measured {shape}", file=sys.stderr, flush=True)
    return {"copy_gbps": {shape: g["copy"] for shape, g in probe_gbps.items()},
            "read_gbps": {shape: g["read"] for shape, g in probe_gbps.items()},
            "read_patterns_gbps": {shape: {"one_stream": g["read-1"], "two_streams": g["read-2"]}
                                   for shape, g in probe_gbps.items()},
            "threads": threads, "rows": rows_out}


def goals(result: dict) -> dict:
    """Issue #4's CPU goals read off one run, per shape from 4096x4096 up: every accel kernel faster than torch's
    fp32 matvec and at >= 60% of its byte bound; the Leech planes kernel's time per stored weight byte (the weight's
    own bytes, plus x and y) within 1.5x of int4's."""
    out = {}
    for shape in dict.fromkeys(r["shape"] for r in result["rows"]):
        rows, cols = (int(n) for n in shape.split("x"))
        if rows * cols < 4096 * 4096:
            continue
        arms = {r["kernel"]: r for r in result["rows"] if r["shape"] == shape}
        ours = {k: r for k, r in arms.items() if not k.startswith("torch-")}
        per_byte = {k: r["us"] / r["stored_bytes"] for k, r in ours.items()}
        ratio = (per_byte["leech-planes"] / per_byte["int4"]) if {"leech-planes", "int4"} <= per_byte.keys() else None
        out[shape] = {"faster_than_fp32": sorted(k for k, r in ours.items() if r["speedup_vs_fp32"] > 1),
                      "slower_than_fp32": sorted(k for k, r in ours.items() if r["speedup_vs_fp32"] <= 1),
                      "below_60pct_of_byte_bound": sorted(k for k, r in ours.items()
                                                          if r["byte_bound_fraction"] < 0.6),
                      "planes_vs_int4_time_per_weight_byte": ratio}
    return out


def goals_text(checks: dict) -> str:
    lines = []
    for shape, c in checks.items():
        ratio = c["planes_vs_int4_time_per_weight_byte"]
        lines.append(f"{shape}: slower than fp32: {', '.join(c['slower_than_fp32']) or 'none'}; under 60% of the byte "
                     f"bound: {', '.join(c['below_60pct_of_byte_bound']) or 'none'}; leech planes / int4 time per "
                     f"weight byte: {'n/a' if ratio is None else f'{ratio:.2f}x'}")
    return "\n".join(lines)


def table(result: dict) -> str:
    header = (f"{result['threads']} threads; µs: best pass; byte bound: the bytes at the bandwidth of the 1-GiB copy "
              "(read + write bytes) timed in the same rounds; read bound: at that of the 1-GiB read, the faster of one "
              "stream and two streams a thread")
    lines = [header, "",
             "| shape | kernel | µs | bytes | GB/s | × fp32 | of byte bound | of read bound |",
             "|---|---|---|---|---|---|---|---|"]
    shape = None
    for r in result["rows"]:
        if r["shape"] != shape:
            shape = r["shape"]
            copy, read = result["copy_gbps"][shape], result["read_gbps"][shape]
            lines.append(f"| {shape} | copy | | | {copy:.1f} | | 100% | {copy / read:.0%} |")
            patterns = result["read_patterns_gbps"][shape]
            lines.append(f"| {shape} | read | | | {read:.1f} | | {read / copy:.0%} | 100% |")
            for name, label in (("one_stream", "read, 1 stream"), ("two_streams", "read, 2 streams")):
                g = patterns[name]
                lines.append(f"| {shape} | {label} | | | {g:.1f} | | {g / copy:.0%} | {g / read:.0%} |")
        lines.append(f"| {r['shape']} | {r['kernel']} | {r['us']:.1f} | {r['bytes']:,} | {r['gbps']:.1f} | "
                     f"{r['speedup_vs_fp32']:.2f} | {r['byte_bound_fraction']:.0%} | {r['read_bound_fraction']:.0%} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller shapes, shorter timing")
    ap.add_argument("--json", action="store_true", help="last line: one JSON object with the rows")
    ap.add_argument("--threads", type=positive, default=os.cpu_count() or 1, help="kernel and torch threads")
    ap.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated subset of " + ",".join(KERNELS))
    ap.add_argument("--footprint", type=positive, default=256, help="MiB of weight copies cycled per timed kernel")
    ap.add_argument("--shapes", help="comma-separated subset such as 4096x4096,14336x4096 (default: all)")
    args = ap.parse_args()
    kernels = [k for k in args.kernels.split(",") if k]
    unknown = sorted(set(kernels) - set(KERNELS))
    if unknown:
        ap.error(f"unknown kernels {unknown}")
    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.shapes:
        try:
            shapes = parse_shapes(args.shapes)
        except ValueError:
            ap.error(f"--shapes: expected ROWSxCOLS[,ROWSxCOLS...], got {args.shapes!r}")
    result = run(shapes, kernels, args.threads, 0.2 if args.quick else 1.0, args.footprint * 2**20)
    result["load_average"] = os.getloadavg()
    result["goals"] = goals(result)
    print(table(result))
    if result["goals"]:
        print("\n" + goals_text(result["goals"]))
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(run_main(main))
