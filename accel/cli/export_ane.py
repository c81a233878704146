"""`accel export-ane`: Core ML packages for the Apple Neural Engine."""

from __future__ import annotations

from pathlib import Path

import typer

from accel.cli.common import JSON_OPTION, not_available


def register(app: typer.Typer) -> None:
    @app.command("export-ane")
    def export_ane(
        model: str = typer.Argument(..., help="Source model or accel OUT_DIR."),
        out: Path = typer.Option(..., "--out", help="Package directory to write (.mlpackage)."),
        encoding: str = typer.Option("fp16", "--encoding", help="fp16, int8, lut2, lut4 or ternary."),
        context: int = typer.Option(512, "--context", help="Context length of the KV cache."),
        force: bool = typer.Option(False, "--force", help="Replace an existing --out."),
        json_out: bool = JSON_OPTION,
    ) -> None:
        """Export a Llama-family model as a Core ML package for the Neural Engine."""
        not_available("accel export-ane", 7)
