"""`accel quantize`: weights (rtnN now; leech/gptq later), KV and state maps, written as an OUT_DIR."""

from __future__ import annotations

from pathlib import Path

import typer

from accel.cli.common import JSON_OPTION, BarProgress, emit_json, print_warnings, stdout


def register(app: typer.Typer) -> None:
    @app.command()
    def quantize(
        model: str = typer.Argument(..., help="HF directory, .gguf file or alias (see `accel models`)."),
        out: Path = typer.Option(..., "--out", help="Output directory (refused if it exists, unless --force)."),
        weights: str = typer.Option(None, "--weights", help="leech2|3|4, gptq2|3|4, hqq2|3|4, rtn2..rtn8."),
        group: int = typer.Option(None, "--group", help="Group size along the input axis for the affine methods "
                                  "(rtn, hqq, gptq) [default: 64]."),
        calib: Path = typer.Option(None, "--calib", help="Calibration directory from `accel calibrate`."),
        layout: str = typer.Option(None, "--layout", help="Code layout: packed, base, planes, onehot."),
        kv: str = typer.Option(None, "--kv", help="semkv[:auto|BASE|LLO/LHI@FRAC|BASE:LLO/LHI@FRAC] KV-cache "
                              "precision map (BASE: affine or turbo)."),
        state: str = typer.Option(None, "--state", help="damp[:BITS] recurrent-state channel map."),
        tune_steps: int = typer.Option(0, "--tune-steps", help="leechN: refit the fp16 row scales by KL to the "
                                       "source model on the calibration windows, this many steps (docs/leech.md)."),
        seed: int = typer.Option(0, "--seed", min=0, max=2**32 - 1, help="Seed for every randomized step."),
        jobs: int = typer.Option(None, "--jobs", help="Worker processes for heavy methods (default: one per core)."),
        ray: str = typer.Option(None, "--ray", help="Run the heavy methods' tensors on a Ray cluster: an address "
                                "ray.init takes (auto, ray://HOST:10001) or local (a Ray instance of --jobs CPUs)."),
        force: bool = typer.Option(False, "--force", help="Replace an existing --out."),
        json_out: bool = JSON_OPTION,
    ) -> None:
        """Quantize MODEL and write an accel OUT_DIR (config, weights, tokenizer, accel.json)."""
        from accel.quantize.pipeline import QuantizeSettings, quantize_model

        settings = QuantizeSettings(weights=weights, group=group, layout=layout, seed=seed,
                                    calib=str(calib) if calib else None, kv=kv, state=state,
                                    tune_steps=tune_steps)
        report = quantize_model(model, out, settings, force=force, progress=BarProgress(), jobs=jobs, ray=ray)
        print_warnings(report["warnings"])
        if json_out:
            emit_json(report)
            return
        what = (f"{report['quantized_tensors']} of {report['tensors']} tensors quantized with {report['weights']}, "
                f"{report['bits_per_weight']:.4f} bits/weight" if report["weights"] else "weights kept")
        maps = "".join(f", {kind} map {method}" for kind, method in report["maps"].items())
        stdout.print(f"wrote {report['out']}: {what}{maps}, {report['seconds']:.1f} s, "
                     f"peak RSS {report['peak_rss_mb']:.0f} MB")
