"""`accel calibrate`: record statistics on real text (weights Hessians, KV cliff, recurrent-state channels)."""

from __future__ import annotations

from pathlib import Path

import typer

from accel.cli.common import JSON_OPTION, BarProgress, emit_json, not_available, stdout
from accel.errors import AccelError

ISSUE_OF = {"weights": 3, "kv": 5, "state": 6}


def register(app: typer.Typer) -> None:
    @app.command()
    def calibrate(
        model: str = typer.Argument(..., help="HF directory, .gguf file or alias (see `accel models`)."),
        data: Path = typer.Option(..., "--data", help="UTF-8 text file to calibrate on."),
        for_: str = typer.Option(..., "--for", help="What to calibrate: weights, kv, state (comma-separated)."),
        out: Path = typer.Option(..., "--out", help="Calibration directory to write."),
        samples: int = typer.Option(64, "--samples", help="Number of text windows (drawn with --seed)."),
        seq_len: int = typer.Option(512, "--seq-len", help="Tokens per window."),
        seed: int = typer.Option(0, "--seed", help="Seed for window sampling."),
        force: bool = typer.Option(False, "--force", help="Replace an existing --out."),
        json_out: bool = JSON_OPTION,
    ) -> None:
        """Run real text through MODEL and record statistics for quantization."""
        kinds = [k.strip() for k in for_.split(",") if k.strip()]
        if not kinds or any(k not in ISSUE_OF for k in kinds):
            raise AccelError(f"--for {for_!r}: choose from weights, kv, state")
        for kind in kinds:
            if kind != "weights":
                not_available(f"accel calibrate --for {kind}", ISSUE_OF[kind])
        from accel.calibrate.hessians import CalibSettings, calibrate_weights

        report = calibrate_weights(model, data, out, CalibSettings(samples=samples, seq_len=seq_len, seed=seed),
                                   force=force, progress=BarProgress())
        if json_out:
            emit_json(report)
            return
        stdout.print(f"wrote {report['out']}: Hessians of {report['layers']} layers ({report['hessians']} distinct "
                     f"inputs) from {report['windows']} windows, {report['tokens']} tokens")
