"""`accel generate`: the greedy continuation of a prompt, through an OUT_DIR's maps and (optionally) kernels."""

from __future__ import annotations

import typer

from accel.cli.common import JSON_OPTION, BarProgress, emit_json, stderr, write_stdout


def register(app: typer.Typer) -> None:
    @app.command("generate")
    def generate_(
        model: str = typer.Argument(..., help="Source model (HF dir, .gguf, alias) or accel OUT_DIR."),
        prompt: str = typer.Option(..., "--prompt", help="The text to continue."),
        tokens: int = typer.Option(64, "--tokens", help="New tokens at most (fewer when the model ends the text)."),
        kv: str = typer.Option(None, "--kv", help="KV-cache quantization spec (SemKV), as in eval."),
        state: str = typer.Option(None, "--state", help="Recurrent-state quantization spec (DAMP), as in eval."),
        kernels: bool = typer.Option(False, "--kernels", help="Serve an OUT_DIR's quantized weights through the "
                                     "fused decode kernels (QuantLinear) instead of decoding them to dense."),
        ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Generate --tokens tokens even past the "
                                        "end-of-text token (for timing)."),
        json_out: bool = JSON_OPTION,
    ) -> None:
        """Continue --prompt greedily with MODEL: the text on stdout, speed and cache bytes on stderr. With a KV or
        state map (the OUT_DIR's, or --kv / --state) every step reads the quantized cache, prompt included."""
        from accel.eval.generate import GenerateSettings, generate

        result = generate(model, GenerateSettings(prompt=prompt, tokens=tokens, kv=kv, state=state,
                                                  kernels=kernels, ignore_eos=ignore_eos), BarProgress())
        if json_out:
            emit_json(result)
            return
        write_stdout(result["prompt"] + result["text"] + "\n")
        speed = result["tokens_per_second"]
        parts = [f"{result['tokens']} tokens ({'end of text' if result['stopped'] == 'eos' else '--tokens reached'})",
                 f"prefill of {result['prompt_tokens']} tokens {result['prefill_seconds']:.3f} s"]
        if speed is not None:
            parts.append(f"{speed:.1f} tokens/s")
        if "kv_bytes_per_token" in result:
            parts.append(f"kv ({result['kv']['method']}) {result['kv_bytes_per_token']:.1f} bytes per token "
                         f"({result['kv_reduction']:.2f}x smaller than fp16)")
        if "state_bits_per_value" in result:
            parts.append(f"state ({result['state']['method']}) {result['state_bits_per_value']:.3f} bits per value, "
                         f"{result['state_bytes']:.0f} bytes (float32: {result['state_fp32_bytes']})")
        stderr.print("  ".join(parts), soft_wrap=True)
