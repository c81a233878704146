"""`accel eval`: perplexity over non-overlapping windows, paired ΔNLL against a reference."""

from __future__ import annotations

import math
from pathlib import Path

import typer

from accel.cli.common import JSON_OPTION, BarProgress, emit_json, print_warnings, stdout
from accel.errors import AccelError, CheckFailed


def register(app: typer.Typer) -> None:
    @app.command("eval")
    def eval_(
        model: str = typer.Argument(..., help="Source model (HF dir, .gguf, alias) or accel OUT_DIR."),
        data: Path = typer.Option(..., "--data", help="UTF-8 text file."),
        reference: str = typer.Option(None, "--reference", help="Model to pair against (per-window ΔNLL)."),
        windows: int = typer.Option(32, "--windows", help="Number of windows (from the start of the text)."),
        seq_len: int = typer.Option(512, "--seq-len", help="Tokens per window."),
        kv: str = typer.Option(None, "--kv", help="KV-cache quantization spec (SemKV)."),
        state: str = typer.Option(None, "--state", help="Recurrent-state quantization spec (DAMP)."),
        seed: int = typer.Option(0, "--seed", min=0, max=2**32 - 1, help="Seed for the bootstrap."),
        kernels: bool = typer.Option(False, "--kernels", help="Serve an OUT_DIR's quantized weights through the "
                                     "fused decode kernels (QuantLinear) instead of decoding them to dense."),
        batch: int = typer.Option(1, "--batch", help="Windows decoded side by side when a KV or state map makes "
                                  "eval decode token by token (each through its own cache; faster on small models). "
                                  "Equal to --batch 1 up to float rounding, which a quantized cache can round "
                                  "differently: per-window NLL then moves by the map's own noise."),
        max_delta_nll: float = typer.Option(None, "--max-delta-nll", help="Quality gate (needs --reference): "
                                            "exit 1 unless the upper end of ΔNLL's 95% interval (ΔNLL itself "
                                            "with one window) is at most this many nats per token."),
        json_out: bool = JSON_OPTION,
    ) -> None:
        """Perplexity of MODEL on --data; with --reference, the paired ΔNLL and its bootstrap 95% interval."""
        from accel.eval.evaluate import EvalSettings, evaluate

        if max_delta_nll is not None and (reference is None or not math.isfinite(max_delta_nll)):
            raise AccelError("--max-delta-nll needs --reference and a finite number of nats per token")
        result = evaluate(model, EvalSettings(data=data, reference=reference, windows=windows, seq_len=seq_len,
                                              seed=seed, kv=kv, state=state, kernels=kernels, batch=batch),
                          BarProgress())
        finite = math.isfinite(result["nll"])
        ref_finite = "ref_nll" not in result or math.isfinite(result["ref_nll"])
        if max_delta_nll is not None:
            result["gate"] = delta_nll_gate(result, max_delta_nll)
        print_warnings(result["warnings"])
        if json_out:
            emit_json(result)
        else:
            _print(result)
        if not finite:
            raise CheckFailed("the model's NLL is not finite (NaN or Inf in its outputs); `accel verify` names "
                              "the tensors that decode to non-finite values")
        if not ref_finite:
            raise CheckFailed("the reference's NLL is not finite (NaN or Inf in its outputs), so there is no ΔNLL; "
                              "check --reference")
        gate = result.get("gate")
        if gate is not None and not gate["passed"]:
            raise CheckFailed(f"quality gate missed: ΔNLL {gate['measured']:+.5f} ({gate['measure']}) is above "
                              f"--max-delta-nll {max_delta_nll}")


def delta_nll_gate(result: dict, limit: float) -> dict:
    """The gate's verdict: the upper end of the paired ΔNLL's 95% interval (ΔNLL itself when one window gives no
    interval) against `limit`; a non-finite ΔNLL fails."""
    high = result["delta_nll_ci"][1]
    measure, measured = ("upper 95% bound", high) if math.isfinite(high) else ("one window", result["delta_nll"])
    return {"max_delta_nll": limit, "measure": measure, "measured": measured,
            "passed": bool(math.isfinite(measured) and measured <= limit)}


def _print(result: dict) -> None:
    stdout.print(f"ppl {result['ppl']:.4f}  nll {result['nll']:.5f} nats/token  "
                 f"({result['windows']} windows, {result['tokens']} tokens)")
    if "state_bits_per_value" in result:
        stdout.print(f"state ({result['state']['method']}): {result['state_bits_per_value']:.3f} bits per value, "
                     f"{result['state_bytes']:.0f} bytes per sequence (float32: {result['state_fp32_bytes']})")
    if "kv_bytes_per_token" in result:
        stdout.print(f"kv ({result['kv']['method']}): {result['kv_bytes_per_token']:.1f} bytes per token "
                     f"(fp16: {result['kv_fp16_bytes_per_token']}, {result['kv_reduction']:.2f}x smaller)")
    if "ref_ppl" in result:
        lo, hi = result["delta_nll_ci"]
        ci = "(one window: no interval)" if math.isnan(lo) else f"[{lo:+.5f}, {hi:+.5f}] (95% bootstrap)"
        stdout.print(f"reference ppl {result['ref_ppl']:.4f}  ΔNLL {result['delta_nll']:+.5f} {ci}  "
                     f"ppl ratio {result['ppl_ratio']:.4f}")
