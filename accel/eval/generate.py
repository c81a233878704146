"""`accel generate` as a library call: the greedy continuation of a prompt, through an OUT_DIR's maps and kernels.

The model is loaded as `accel eval` loads it (an OUT_DIR's weights decoded, or served by the fused kernels with
`kernels=True`), and its KV or state map (the OUT_DIR's own, or `kv=` / `state=`) decodes through the same runtime
cache eval measures: with a map, the prompt too goes through the cache one token at a time, so every attention or
recurrent-state read of the run is of the quantized storage. Decoding is greedy (the most likely token at each step),
so the same inputs give the same tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from accel.errors import AccelError
from accel.eval.data import max_positions
from accel.eval.evaluate import check_kernels_spec, map_runtime
from accel.eval.load import load_causal_lm
from accel.progress import SILENT, Progress


@dataclass
class GenerateSettings:
    prompt: str
    tokens: int = 64  # new tokens at most
    kv: str | None = None  # --kv METHOD[:ARG], as in eval
    state: str | None = None  # --state METHOD[:ARG], as in eval
    kernels: bool = False  # --kernels: an OUT_DIR's quantized linears through QuantLinear
    ignore_eos: bool = False  # generate `tokens` tokens even past the end-of-text token


def check_generate_args(settings: GenerateSettings) -> None:
    """The checks that need no model (run before loading one)."""
    if not settings.prompt:
        raise AccelError("--prompt is empty; give the text to continue")
    try:
        settings.prompt.encode("utf-8")
    except UnicodeEncodeError:  # bytes the locale could not decode reach Python as lone surrogates
        raise AccelError("--prompt is not valid UTF-8 text") from None
    if settings.tokens < 1:
        raise AccelError(f"--tokens must be at least 1, got {settings.tokens}")


def eos_ids(tokenizer: Any, config: dict[str, Any]) -> set[int]:
    """The token ids that end a text: the config's eos_token_id (an id or a list) and the tokenizer's."""
    found: set[int] = set()
    for value in (config.get("eos_token_id"), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            found.add(value)
        elif isinstance(value, (list, tuple)):
            found.update(v for v in value if isinstance(v, int))
    return found


@torch.inference_mode()
def greedy_tokens(model: torch.nn.Module, prompt_ids: list[int], tokens: int, make_cache: Any = None,
                  stop: set[int] | frozenset[int] = frozenset(), on_token: Any = None) -> dict[str, Any]:
    """Greedy decoding at batch 1 with a cache: {"ids", "stopped", "prefill_seconds", "decode_seconds"}.

    make_cache: None for the model's own cache (the prompt prefilled in one call), or a function returning a
    runtime cache, which the prompt then fills one token at a time (every read through the quantized storage)."""
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    t0 = time.perf_counter()
    if make_cache is None:
        out = model(input_ids=ids, use_cache=True)
        cache = out.cache
    else:
        cache = make_cache()
        for t in range(ids.shape[1]):
            out = model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True)
    prefill = time.perf_counter() - t0
    nxt = int(out.logits[0, -1].argmax())
    generated, stopped = [nxt], "eos" if nxt in stop else "length"
    if on_token:
        on_token()
    t0 = time.perf_counter()
    while stopped == "length" and len(generated) < tokens:
        out = model(input_ids=torch.tensor([[nxt]], dtype=torch.long), cache=cache, use_cache=True)
        nxt = int(out.logits[0, -1].argmax())
        generated.append(nxt)
        if nxt in stop:
            stopped = "eos"
        if on_token:
            on_token()
    return {"ids": generated, "stopped": stopped, "prefill_seconds": prefill,
            "decode_seconds": time.perf_counter() - t0}


def generate(spec: str | Path, settings: GenerateSettings, progress: Progress = SILENT) -> dict[str, Any]:
    """Continue `settings.prompt` greedily with MODEL (a source model or an OUT_DIR) for up to `settings.tokens`."""
    check_generate_args(settings)
    check_kernels_spec(spec, settings.kernels)
    loaded = load_causal_lm(spec, progress, kernels=settings.kernels)
    prompt_ids = [int(i) for i in loaded.tokenizer(settings.prompt)["input_ids"]]
    if not prompt_ids:
        raise AccelError("--prompt gives no tokens with this model's tokenizer")
    limit = max_positions(loaded.config)
    # the last new token is returned, never fed back: the model reads prompt + tokens - 1 positions
    if limit is not None and len(prompt_ids) + settings.tokens - 1 > limit:
        raise AccelError(f"the prompt's {len(prompt_ids)} tokens and --tokens {settings.tokens} exceed the model's "
                         f"{limit} positions")
    runtime, map_report = map_runtime(loaded, settings.kv, settings.state)
    stop = set() if settings.ignore_eos else eos_ids(loaded.tokenizer, loaded.config)
    progress.stage(f"generate {Path(str(spec)).name}" + (" (through the quantized cache)" if runtime else ""),
                   settings.tokens)
    run = greedy_tokens(loaded.model, prompt_ids, settings.tokens, runtime.make_cache if runtime else None, stop,
                        progress.advance)
    progress.close()
    if runtime is not None:
        map_report.update(runtime.report())
    steps = len(run["ids"]) - 1  # decode steps after the token the prefill gives
    return {"model": str(spec), "prompt": settings.prompt, "prompt_tokens": len(prompt_ids),
            "text": loaded.tokenizer.decode(run["ids"], skip_special_tokens=True), "token_ids": run["ids"],
            "tokens": len(run["ids"]), "stopped": run["stopped"], "kernels": settings.kernels,
            "prefill_seconds": run["prefill_seconds"],
            "tokens_per_second": steps / run["decode_seconds"] if steps and run["decode_seconds"] > 0 else None,
            **map_report}
