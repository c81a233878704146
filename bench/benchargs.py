"""What the benchmark scripts share: counts that must be positive, one line (exit 2) for what accel refuses
instead of a traceback, and whether a calibration left in a work directory may be reused."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path


def _at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    return parse


# argparse types: an integer of at least 1 / 0 (argparse turns the error into its usage message, exit 2)
positive = _at_least(1)
non_negative = _at_least(0)


def run_main(main: Callable[[], int | None]) -> int:
    """main(), with accel's refusals (a model that is not there, an unknown arm, a bad spec) and unwritable paths
    as one line on stderr and exit 2."""
    from accel.errors import AccelError

    try:
        return main() or 0
    except (AccelError, OSError) as exc:
        print(f"error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
        return 2


def calibration_matches(calib: Path, text: Path, kind: str, samples: int, seq_len: int) -> bool:
    """`calib` holds an `accel calibrate --for kind` recorded with these settings (seed 0) on this text: a --quick
    run's calibration left in the same work directory is not one for a full run."""
    manifest = calib / "calibration.json"
    if not manifest.is_file():
        return False
    done = json.loads(manifest.read_text(encoding="utf-8"))
    sha = hashlib.sha256(text.read_bytes()).hexdigest()
    return (done.get("settings") == {"samples": samples, "seq_len": seq_len, "seed": 0}
            and sha in done.get("data", {}).values() and kind in done.get("for", []))
