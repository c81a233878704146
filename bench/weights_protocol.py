"""The weight benchmarks' shared protocol on SmolLM2-135M: the pydoc corpus split in halves, calibration on the
second half, evaluation windows from the first, so no window is seen twice (bench/leech_quality.py,
bench/leech_ablation.py)."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from accel.calibrate.run import CalibSettings, calibrate
from accel.eval.data import pydoc_text

MODEL = "smollm2-135m"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true", help="8 windows of 256 tokens, 16 calibration windows")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--calib-samples", type=int, default=64)
    ap.add_argument("--workdir", type=Path, default=None,
                    help="keep outputs here (default: a temporary dir); an existing calib/ is reused")
    ap.add_argument("--jobs", type=int, default=None, help="accel quantize worker processes (default: one per core)")


def prepare(args: argparse.Namespace, prefix: str) -> tuple[Path, str]:
    """Apply --quick, create the work directory, write both halves; returns (workdir, evaluation text)."""
    if args.quick:
        args.windows, args.seq_len, args.calib_samples = 8, 256, 16
    work = args.workdir or Path(tempfile.mkdtemp(prefix=prefix))
    work.mkdir(parents=True, exist_ok=True)
    text = pydoc_text()
    half = len(text) // 2
    (work / "eval.txt").write_text(text[:half], encoding="utf-8")
    (work / "calib.txt").write_text(text[half:], encoding="utf-8")
    return work, text[:half]


def _has_windows(calib: Path) -> bool:
    from accel.calibrate.hessians import WINDOWS, HessianStore

    return WINDOWS in HessianStore(calib).artifact.names


def ensure_calibration(work: Path, args: argparse.Namespace) -> Path:
    """work/calib, calibrated for weights on the second half unless it is already there (with its windows)."""
    calib = work / "calib"
    if not calib.exists() or not _has_windows(calib):
        started = time.perf_counter()
        calibrate(MODEL, work / "calib.txt", calib, ["weights"],
                  CalibSettings(samples=args.calib_samples, seq_len=args.seq_len), force=True)
        print(f"calibration: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return calib
