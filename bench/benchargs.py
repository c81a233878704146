"""What every benchmark script shares at its command line: counts that must be positive, and one line (exit 2)
for what accel refuses, instead of a traceback."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


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
