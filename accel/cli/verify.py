"""`accel verify`: checksums, decode everything, compare against the source."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape

from accel.cli.common import JSON_OPTION, BarProgress, emit_json, stdout
from accel.errors import CheckFailed


def register(app: typer.Typer) -> None:
    @app.command()
    def verify(
        path: Path = typer.Argument(..., help="An accel OUT_DIR, container file, calibration directory or Core ML "
                                              "package."),
        reference: str = typer.Option(None, "--reference", help="Source model to compare decoded tensors with."),
        json_out: bool = JSON_OPTION,
    ) -> None:
        """Check every checksum, decode every tensor, check the maps, config and tokenizer files eval loads, and
        report the error against --reference. Exit 1 on a fault."""
        from accel.converters.coreml.export import is_package
        from accel.errors import AccelError
        from accel.eval.verify import is_calibration, verify_artifact, verify_calibration

        if is_package(path):  # a Core ML package from `accel export-ane`
            from accel.cli.export_ane import verify_package_cli

            return verify_package_cli(path, reference, json_out)
        if is_calibration(path):
            if reference is not None:
                raise AccelError(f"{path} is a calibration: it holds statistics, not weights to compare with "
                                 f"--reference (drop --reference)")
            report = verify_calibration(path, BarProgress())
        else:
            report = verify_artifact(path, reference, BarProgress())
        if json_out:
            emit_json({k: v for k, v in report.items() if k != "rel_error"})
        else:
            for line in report["errors"]:
                stdout.print(f"[red]FAULT[/] {escape(line)}", soft_wrap=True, markup=True, highlight=False)
            if "max_rel_error" in report:
                stdout.print(f"max relative error {report['max_rel_error']:.4g} "
                             f"({report['max_rel_error_tensor']}), max abs error {report['max_abs_error']:.4g}")
            stdout.print(f"{'ok' if report['ok'] else 'FAILED'}: {report['tensors']} tensors, "
                         f"{len(report['errors'])} fault(s)")
        if not report["ok"]:
            raise CheckFailed()
