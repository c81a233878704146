"""`accel eval`: perplexity over non-overlapping windows, paired ΔNLL against a reference."""

from __future__ import annotations

import math
from pathlib import Path

import typer

from accel.cli.common import JSON_OPTION, BarProgress, emit_json, stdout
from accel.errors import CheckFailed


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
        json_out: bool = JSON_OPTION,
    ) -> None:
        """Perplexity of MODEL on --data; with --reference, the paired ΔNLL and its bootstrap 95% interval."""
        from accel.eval.evaluate import EvalSettings, evaluate

        result = evaluate(model, EvalSettings(data=data, reference=reference, windows=windows, seq_len=seq_len,
                                              seed=seed, kv=kv, state=state, kernels=kernels, batch=batch),
                          BarProgress())
        finite = math.isfinite(result["nll"])
        ref_finite = "ref_nll" not in result or math.isfinite(result["ref_nll"])
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
