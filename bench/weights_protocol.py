"""The weight benchmarks' shared protocol on SmolLM2-135M: the pydoc corpus split in halves, calibration on the
second half, evaluation windows from the first, so no window is seen twice (bench/leech_quality.py,
bench/leech_ablation.py)."""

from __future__ import annotations

import argparse
import atexit
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchargs import calibration_matches, positive

MODEL = "smollm2-135m"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true",
                    help="8 windows of 256 tokens, 16 calibration windows (where not given)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--windows", type=positive, default=None, help="evaluation windows (default 40; quick 8)")
    ap.add_argument("--seq-len", type=positive, default=None, help="tokens per window (default 512; quick 256)")
    ap.add_argument("--calib-samples", type=positive, default=None,
                    help="calibration windows (default 64; quick 16)")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="keep outputs here (default: a temporary directory, removed at the end); a calib/ there "
                         "is reused when it was recorded with the same --calib-samples and --seq-len")
    ap.add_argument("--jobs", type=positive, default=1,
                    help="accel quantize worker processes (default 1: the benchmarks run one process at a time)")


def prepare(args: argparse.Namespace, prefix: str) -> tuple[Path, str]:
    """Fill the counts --quick or the defaults give, create the work directory, write both halves; returns
    (workdir, evaluation text). A temporary work directory is removed when the process exits."""
    from accel.eval.data import pydoc_text

    quick = {"windows": 8, "seq_len": 256, "calib_samples": 16}
    full = {"windows": 40, "seq_len": 512, "calib_samples": 64}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.workdir is None:
        work = Path(tempfile.mkdtemp(prefix=prefix))
        atexit.register(shutil.rmtree, work, ignore_errors=True)
    else:
        work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    text = pydoc_text()
    half = len(text) // 2
    (work / "eval.txt").write_text(text[:half], encoding="utf-8")
    (work / "calib.txt").write_text(text[half:], encoding="utf-8")
    return work, text[:half]


def _reusable(calib: Path, samples: int, seq_len: int) -> bool:
    """A weights calibration with these settings on this text, with its token windows (--tune-steps reads them)."""
    from accel.calibrate.hessians import WINDOWS, HessianStore

    return calibration_matches(calib, calib.parent / "calib.txt", "weights", samples, seq_len) \
        and WINDOWS in HessianStore(calib).artifact.names


def ensure_calibration(work: Path, args: argparse.Namespace) -> Path:
    """work/calib, calibrated for weights on the second half unless one with these settings is there."""
    from accel.calibrate.run import CalibSettings, calibrate

    calib = work / "calib"
    if _reusable(calib, args.calib_samples, args.seq_len):
        print(f"reusing the calibration in {calib}", file=sys.stderr)
        return calib
    started = time.perf_counter()
    calibrate(MODEL, work / "calib.txt", calib, ["weights"],
              CalibSettings(samples=args.calib_samples, seq_len=args.seq_len), force=True)
    print(f"calibration: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return calib
