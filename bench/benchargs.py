"""What every benchmark script shares at its command line: counts that must be positive, and one line (exit 2)
for what accel refuses, instead of a traceback."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


def positive(text: str) -> int:
    """An argparse type: an integer of at least 1 (argparse turns the error into its usage message, exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def run_main(main: Callable[[], int | None]) -> int:
    """main(), with accel's refusals (a model that is not there, an unknown arm, a bad spec) and unwritable paths
    as one line on stderr and exit 2."""
    from accel.errors import AccelError

    try:
        return main() or 0
    except (AccelError, OSError) as exc:
        print(f"error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
        return 2
