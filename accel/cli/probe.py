"""`accel probe`: turn bandwidth-counter captures from a Mac into bytes per token and residency."""

from __future__ import annotations

from pathlib import Path

import typer

from accel.cli.common import JSON_OPTION, not_available

app = typer.Typer(help="Read ANE probe captures recorded on a Mac.", no_args_is_help=True)


@app.command()
def report(
    capture: Path = typer.Argument(..., help="JSON capture written by the probe harness."),
    package: Path = typer.Option(..., "--package", help="The package the capture was recorded with."),
    json_out: bool = JSON_OPTION,
) -> None:
    """Measured bytes per token, its ratio to the prediction, residency and ms per token."""
    not_available("accel probe report", 7)
