"""`accel probe`: turn bandwidth-counter captures from a Mac into bytes per token and residency."""

from __future__ import annotations

from pathlib import Path

import typer

from accel.cli.common import JSON_OPTION, emit_json, print_warnings, stdout

app = typer.Typer(help="Read ANE probe captures recorded on a Mac.", no_args_is_help=True)


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


@app.command()
def report(
    capture: Path = typer.Argument(..., help="JSON capture written by the probe harness."),
    package: Path = typer.Option(..., "--package", help="The package the capture was recorded with."),
    json_out: bool = JSON_OPTION,
) -> None:
    """Measured bytes per token, its ratio to the prediction, residency and ms per token."""
    from accel.converters.coreml.probe.report import probe_report

    result = probe_report(capture, package)
    print_warnings(result["warnings"])  # on stderr, as every command gives its warnings
    if json_out:
        emit_json(result)
        return
    res = result["residency"]
    stdout.print(f"{result['encoding']} package, {result['steps']} decode steps, bytes from {result['bytes']['source']}")
    stdout.print(f"measured ANE bytes per token: {_fmt(result['measured_bytes_per_token'], ',.0f')}"
                 f" (predicted weights {result['predicted_weight_bytes_per_token']:,},"
                 f" + KV {result['predicted_kv_bytes_per_token']:,})")
    stdout.print(f"ratio to predicted: {_fmt(result['ratio_to_predicted'], '.3f')}"
                 f" (with KV {_fmt(result['ratio_to_predicted_with_kv'], '.3f')}),"
                 f" to nominal width: {_fmt(result['ratio_to_nominal'], '.3f')}")
    stdout.print(f"residency (MLComputePlan): ops {_fmt(res.get('ops'), '.1%')},"
                 f" block ops {_fmt(res.get('block_ops'), '.1%')},"
                 f" rules agree on {_fmt(res.get('prediction_agreement'), '.1%')} of matched ops")
    stdout.print(f"ms per token: {result['ms_per_token']:.2f} median, {result['ms_per_token_mean']:.2f} mean")
