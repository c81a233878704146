"""`accel inspect`: tensors, codecs, layouts, bits per weight, maps and sizes of an accel output."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from accel.cli.common import JSON_OPTION, emit_json, stdout


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _param_text(value) -> str | None:
    """A map parameter for the text line: scalars as they are, a short list of scalars as a/b (SemKV's levels
    LLO/LHI); longer or nested values only in --json (None)."""
    if isinstance(value, dict):
        return None
    if isinstance(value, list):
        if len(value) <= 4 and all(isinstance(v, (int, float, str)) for v in value):
            return "/".join(str(v) for v in value)
        return None
    return str(value)


def register(app: typer.Typer) -> None:
    @app.command()
    def inspect(
        path: Path = typer.Argument(..., help="An accel OUT_DIR or container file."),
        json_out: bool = JSON_OPTION,
    ) -> None:
        """List logical tensors with codec, layout, exact bits per weight (codes plus side data) and sizes."""
        from accel.converters.coreml.export import is_package

        if is_package(path):  # a Core ML package from `accel export-ane`
            from accel.cli.export_ane import show_package

            return show_package(path, json_out)
        from accel.formats.inspect import inspect_artifact

        report = inspect_artifact(path)
        if json_out:
            emit_json(report)
            return
        table = Table("tensor", "role", "codec", "layout", "shape", "bits/weight", "bytes")
        for t in report["tensors"]:
            codec = t["codec"] + ("".join(f" {k}={v}" for k, v in sorted(t["params"].items())
                                          if k in ("levels", "group", "dtype")))
            table.add_row(t["name"], t["role"], codec, t["layout"], "x".join(map(str, t["shape"])),
                          f"{t['bits_per_weight']:.4f}", _fmt_bytes(t["bytes"]))
        stdout.print(table)
        bpw = report["bits_per_weight"]
        stdout.print(f"quantized tensors: {bpw:.4f} bits/weight" if bpw is not None else "no quantized tensors")
        stdout.print(f"total: {_fmt_bytes(report['bytes'])} in {len(report['files'])} file(s), "
                     f"format version {report['format_version']}")
        for kind, m in report["maps"].items():  # each checked by Artifact.map_documents
            texts = {k: _param_text(v) for k, v in sorted(m["params"].items())}
            shown = ", ".join(f"{k}={t}" for k, t in texts.items() if t is not None)
            stdout.print(f"{kind} map: {m['method']} ({shown}); arrays: {', '.join(sorted(m['arrays']))}",
                         markup=False)
