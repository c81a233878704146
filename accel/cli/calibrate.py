"""`accel calibrate`: record statistics on real text (weights Hessians, KV cliff, recurrent-state channels)."""

from __future__ import annotations

from pathlib import Path

import typer

from accel.cli.common import JSON_OPTION, BarProgress, emit_json, stdout


def register(app: typer.Typer) -> None:
    @app.command()
    def calibrate(
        model: str = typer.Argument(..., help="HF directory, .gguf file or alias (see `accel models`)."),
        data: Path = typer.Option(..., "--data", help="UTF-8 text file to calibrate on."),
        for_: str = typer.Option(..., "--for", help="What to calibrate: weights, kv, state (comma-separated)."),
        out: Path = typer.Option(..., "--out", help="Calibration directory to write."),
        samples: int = typer.Option(64, "--samples", "--windows",
                                    help="Number of text windows (drawn with --seed); --windows as in eval."),
        seq_len: int = typer.Option(512, "--seq-len", help="Tokens per window."),
        seed: int = typer.Option(0, "--seed", min=0, max=2**32 - 1, help="Seed for window sampling."),
        force: bool = typer.Option(False, "--force", help="Replace an existing --out."),
        json_out: bool = JSON_OPTION,
    ) -> None:
        """Run real text through MODEL and record statistics for quantization."""
        from accel.calibrate.run import CalibSettings, calibrate

        kinds = [k.strip() for k in for_.split(",") if k.strip()]
        report = calibrate(model, data, out, kinds, CalibSettings(samples=samples, seq_len=seq_len, seed=seed),
                           force=force, progress=BarProgress())
        if json_out:
            emit_json(report)
            return
        stdout.print(f"wrote {report['out']}: {', '.join(report['for'])} from {report['windows']} windows, "
                     f"{report['tokens']} tokens")
        if "weights" in report:
            stdout.print(f"  weights: Hessians of {report['weights']['layers']} layers "
                         f"({report['weights']['hessians']} distinct inputs)")
        if "kv" in report:
            kv = report["kv"]
            picks = ", ".join(f"{b}: {r['levels'][0]}/{r['levels'][1]}@{r['frac']} ({r['reduction']:.2f}x)"
                              if r else f"{b}: none" for b, r in kv["recommendations"].items())
            stdout.print(f"  kv: cliff (lowest L with the ΔNLL CI inside ±{kv['margin']}) {kv['cliff']}; "
                         f"SemKV picks {picks}; score {kv['runtime_indicator']} (kv/sweep.md, kv/sweep.png)")
        if "state" in report:
            st = report["state"]
            stdout.print(f"  state: {st['arch']} {len(st['layers'])} layers x {st['heads']} heads x {st['d_k']} "
                         f"channels; top-10% channels hold {st['top10_energy_share']:.1%} of the INT8 error energy; "
                         f"split-half rank correlation energy {st['energy_rank_corr']:.3f}, persistence "
                         f"{st['persistence_rank_corr']:.3f} (table.md, {len(st['plots'])} plots)")
