"""`accel export-ane`: Core ML packages for the Apple Neural Engine (and `accel export-ane sweep`)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from accel.cli.common import JSON_OPTION, BarProgress, emit_json, print_warnings, stdout

SWEEP = "sweep"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def register(app: typer.Typer) -> None:
    @app.command("export-ane")
    def export_ane(
        model: str = typer.Argument(..., help="Source model or accel OUT_DIR; or `sweep` for the primitive matrix."),
        out: Path = typer.Option(..., "--out", help="Package to write (NAME.mlpackage); for `sweep`, a directory."),
        encoding: str = typer.Option("fp16", "--encoding", help="fp16, int8, lut2, lut4 or ternary."),
        context: int = typer.Option(512, "--context", help="Context length of the KV cache."),
        prefill: int = typer.Option(64, "--prefill", help="Tokens per prefill call (the prefill function's shape)."),
        naive: bool = typer.Option(True, "--naive/--no-naive",
                                   help="Also convert the plain transformers model for the placement comparison."),
        force: bool = typer.Option(False, "--force", help="Replace an existing --out."),
        json_out: bool = JSON_OPTION,
    ) -> None:
        """Export a Llama-family model (Llama, Mistral, Qwen2, Qwen3) as a multifunction (prefill, decode) Core ML
        package for the Neural Engine."""
        if model == SWEEP and not Path(model).exists():
            from accel.converters.coreml.sweep import run_sweep

            report = run_sweep(out, force=force, progress=BarProgress())
            if json_out:
                emit_json(report)
                return
            table = Table("variant", "primitive", "ops", "ANE ops", "off-ANE rules")
            for v in report["variants"]:
                table.add_row(v["name"], v["primitive"], str(v["ops"]), _share(v["residency"]["ops"]),
                              ", ".join(sorted({o["rule"] for o in v["off_ane"]})) or "-")
            stdout.print(table)
            stdout.print(f"wrote {len(report['variants'])} variant packages and {report['runner']} to {report['out']}")
            return

        from accel.converters.coreml.export import ExportSettings
        from accel.converters.coreml.export import export_ane as run_export

        settings = ExportSettings(encoding=encoding, context=context, prefill=prefill, naive=naive)
        report = run_export(model, out, settings, force=force, progress=BarProgress())
        print_warnings(report["warnings"])
        if json_out:
            emit_json(report)
            return
        table = Table("predicted ANE share", "accel package (decode)", "naive conversion")
        naive_res = report["naive_residency"] or {}
        for key, label in (("block_ops", "ops inside decoder blocks"), ("ops", "all ops"), ("flops", "FLOPs"),
                           ("weight_bytes", "weight bytes")):
            table.add_row(label, _share(report["residency"][key]), _share(naive_res.get(key)))
        stdout.print(table)
        stdout.print(f"wrote {report['package']}: {report['encoding']}, functions "
                     f"{', '.join(f'{k}({v} tokens)' for k, v in report['functions'].items())}, "
                     f"context {report['context']}")
        stdout.print(f"predicted weight bytes per decode token: {report['predicted_weight_bytes_per_token']:,} "
                     f"(+ {report['predicted_kv_bytes_per_token']:,} KV-cache bytes)")
        stdout.print(f"package {report['package_bytes']:,} bytes = {report['size_ratio']:.3f} x nominal "
                     f"({report['params']:,} params at the nominal width), {report['seconds']:.1f} s")


def show_package(path: Path, json_out: bool) -> None:
    """`accel inspect PKG`: encoded tensors, predicted residency beside the naive conversion's, off-ANE ops."""
    from accel.converters.coreml.export import inspect_package

    report = inspect_package(path)
    if json_out:
        emit_json(report)
        return
    table = Table("tensor", "encoding op", "from", "bits/weight", "bytes")
    for t in report["tensors"]:
        table.add_row(t["name"], t["layout"], t["from"], f"{t['bits_per_weight']:.4f}", f"{t['bytes']:,}")
    stdout.print(table)
    res = Table("predicted ANE share", *[f"accel {name}" for name in report["residency"]], "naive conversion")
    naive = report["naive_residency"] or {}
    for key, label in (("block_ops", "ops inside decoder blocks"), ("ops", "all ops"), ("flops", "FLOPs"),
                       ("weight_bytes", "weight bytes")):
        res.add_row(label, *[_share(r[key]) for r in report["residency"].values()], _share(naive.get(key)))
    stdout.print(res)
    for name, groups in [*report["off_ane"].items(), ("naive", report["naive_off_ane"] or [])]:
        for g in groups:
            where = "block" if g["in_block"] else "outside blocks"
            stdout.print(f"{name}: {g['count']} x {g['op']} on {g['device']} ({where}): rule {g['rule']}: "
                         f"{g['reason']}", soft_wrap=True, markup=False)
    stdout.print(f"{report['encoding']}, {report['bits_per_weight']:.4f} bits/weight over the encoded matrices, "
                 f"Core ML model {report['bytes']:,} bytes; predicted weight bytes per decode token "
                 f"{report['predicted']['weight_bytes_per_token']:,}")


def verify_package_cli(path: Path, reference: str | None, json_out: bool) -> None:
    """`accel verify PKG [--reference MODEL]`: the NumPy MIL interpreter against the PyTorch reference."""
    from accel.converters.coreml.verify import verify_package
    from accel.errors import CheckFailed

    report = verify_package(path, reference, progress=BarProgress())
    if json_out:
        emit_json(report)
    else:
        for line in report["errors"]:
            stdout.print(f"[red]FAULT[/] {escape(line)}", soft_wrap=True, markup=True, highlight=False)
        for call in report.get("calls", []) if isinstance(report.get("calls"), list) else []:
            stdout.print(f"{call['call']}: {call['tokens']} token(s), relative logit error {call['rel_error']:.3g}, "
                         f"top-1 agreement {call['top1_agreement']:.0%}")
        if "max_rel_error" in report:
            stdout.print(f"max relative error {report['max_rel_error']:.4g} (fp16 tolerance {report['tolerance']}); "
                         f"weights vs source: {report['weight_rel_error']:.3g} ({report['weight_rel_error_tensor']})")
        stdout.print(f"{'ok' if report['ok'] else 'FAILED'}: {path}, {len(report['errors'])} fault(s)")
    if not report["ok"]:
        raise CheckFailed()
