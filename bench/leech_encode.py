"""Leech encoder speed: µs per 24-dim block per core, and (without --quick) the wall time and peak RSS of
calibrating + quantizing SmolLM2-135M at leech2.

Usage: python bench/leech_encode.py [--quick] [--json] [--blocks N]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # one core per measurement: the figure is per core
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from benchargs import positive, run_main

PUBLISHED_US = 680.0  # a published Rust encoder's µs per block (issue #3)


def encoder_rows(blocks: int) -> list[dict]:
    from accel.quantize.leech import nearest_point
    from accel.quantize.leech_weights import stage_alphas

    rng = np.random.default_rng(0)
    targets = rng.standard_normal((blocks, 24))
    rows = []
    for max_shell in (12, 13):
        alpha = stage_alphas((max_shell,))[0]
        nearest_point(targets[:256], alpha, max_shell)  # warm the tables
        t = time.perf_counter()
        found = nearest_point(targets, alpha, max_shell)
        us = (time.perf_counter() - t) / blocks * 1e6
        rows.append({"arm": f"nearest_point max_shell={max_shell}", "us_per_block": us,
                     "vs_published": PUBLISHED_US / us, "mse_per_coord": float(found.objective.mean() / 24)})
    return rows


def full_run() -> dict:
    """The CLI path in child processes (with the machine's normal threading): calibrate, then quantize."""
    import subprocess

    from accel.eval.data import pydoc_text

    work = Path(tempfile.mkdtemp(prefix="leech_encode."))
    text = pydoc_text()
    (work / "calib.txt").write_text(text[len(text) // 2 :], encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    accel = str(Path(sys.executable).with_name("accel"))
    times = {}
    for step, argv in (("calibrate", [accel, "calibrate", "smollm2-135m", "--for", "weights", "--data",
                                      str(work / "calib.txt"), "--out", str(work / "calib"), "--json"]),
                       ("quantize", [accel, "quantize", "smollm2-135m", "--weights", "leech2", "--calib",
                                     str(work / "calib"), "--out", str(work / "leech2"), "--json"])):
        t = time.perf_counter()
        out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout
        times[step] = time.perf_counter() - t
        times[f"{step}_report"] = json.loads(out)
    return {"calibrate_s": times["calibrate"], "quantize_s": times["quantize"],
            "total_s": times["calibrate"] + times["quantize"],
            "bits_per_weight": times["quantize_report"]["bits_per_weight"],
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="encoder speed only (skip the SmolLM2 run)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--blocks", type=positive, default=4096)
    args = ap.parse_args()
    rows = encoder_rows(args.blocks)
    print(f"Leech nearest-point encoder, {args.blocks} unit-Gaussian blocks, one BLAS thread")
    print(f"{'arm':28} {'µs/block':>9} {'680 µs / ours':>14} {'MSE/coord':>10}")
    for r in rows:
        print(f"{r['arm']:28} {r['us_per_block']:9.1f} {r['vs_published']:14.1f} {r['mse_per_coord']:10.4f}")
    result = {"benchmark": "leech_encode", "rows": rows}
    if not args.quick:
        full = full_run()
        print(f"SmolLM2-135M leech2 with calibration: calibrate {full['calibrate_s']:.0f} s + quantize "
              f"{full['quantize_s']:.0f} s = {full['total_s']:.0f} s, peak RSS {full['peak_rss_mb']:.0f} MB, "
              f"{full['bits_per_weight']:.4f} bits/weight")
        result["smollm2"] = full
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
