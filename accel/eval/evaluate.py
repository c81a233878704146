"""`accel eval` as a library call: perplexity of a model or OUT_DIR, optionally paired against a reference."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from accel.errors import AccelError
from accel.eval.data import check_context, check_window_args, read_text, token_windows
from accel.eval.load import is_accel_output, load_causal_lm
from accel.eval.perplexity import decode_nll, window_nll
from accel.eval.stats import paired_bootstrap
from accel.progress import SILENT, Progress


@dataclass
class EvalSettings:
    data: Path
    reference: str | None = None
    windows: int | None = 32
    seq_len: int = 512
    seed: int = 0
    kv: str | None = None  # --kv METHOD[:ARG]: a KV scheme applied at eval time (accel.quantize.maps)
    state: str | None = None  # --state METHOD[:ARG]: a recurrent-state scheme applied at eval time
    kernels: bool = False  # --kernels: an OUT_DIR's quantized linear weights run through QuantLinear (accel.kernels)
    batch: int = 1  # --batch: windows decoded side by side when a KV / state map makes eval decode token by token


def evaluate(spec: str | Path, settings: EvalSettings, progress: Progress = SILENT) -> dict[str, Any]:
    """Perplexity over non-overlapping windows; with a reference, the paired per-window ΔNLL and its 95% CI."""
    text = read_text(settings.data)  # validate the data before any model work
    if settings.batch < 1:
        raise AccelError(f"--batch must be at least 1, got {settings.batch}")
    check_window_args(settings.seq_len, settings.windows)  # before any model work
    check_kernels_spec(spec, settings.kernels)
    torch.manual_seed(settings.seed)
    loaded = load_causal_lm(spec, progress, kernels=settings.kernels)
    check_context(settings.seq_len, loaded.config)
    windows = token_windows(loaded.tokenizer, text, settings.seq_len, settings.windows)
    runtime, map_report = map_runtime(loaded, settings.kv, settings.state)
    progress.stage(f"eval {Path(str(spec)).name}" + (" (token by token)" if runtime else ""), len(windows))
    if runtime is None:
        arm = window_nll(loaded.model, windows, progress.advance)
    else:
        arm = decode_nll(loaded.model, windows, runtime.make_cache, progress.advance, batch=settings.batch)
        map_report.update(runtime.report())
    progress.close()
    del loaded
    warnings = []
    if settings.windows is not None and len(windows) < settings.windows:
        warnings.append(f"the text holds {len(windows)} windows of --seq-len {settings.seq_len} tokens, fewer than "
                        f"--windows {settings.windows}: evaluated {len(windows)}")
    result: dict[str, Any] = {"model": str(spec), "ppl": arm.ppl, "nll": arm.mean, "windows": len(windows),
                              "tokens": arm.tokens, "seq_len": settings.seq_len, "kernels": settings.kernels,
                              "window_nll": [float(v) for v in arm.nll], **map_report, "warnings": warnings}
    if settings.reference is not None:
        ref_loaded = load_causal_lm(settings.reference, progress)
        check_context(settings.seq_len, ref_loaded.config, "the reference")
        ref_windows = token_windows(ref_loaded.tokenizer, text, settings.seq_len, settings.windows)
        if ref_windows.shape != windows.shape or (ref_windows != windows).any():
            raise AccelError("the model and --reference tokenize the text differently; their NLLs cannot be paired")
        progress.stage(f"eval reference {Path(str(settings.reference)).name}", len(windows))
        ref = window_nll(ref_loaded.model, windows, progress.advance)
        progress.close()
        delta = paired_bootstrap(arm.nll, ref.nll, seed=settings.seed)
        result.update({"reference": str(settings.reference), "ref_ppl": ref.ppl, "ref_nll": ref.mean,
                       "delta_nll": delta.mean, "delta_nll_ci": [delta.low, delta.high],  # NaN for one window
                       "ppl_ratio": arm.ppl / ref.ppl})
    return result


def check_kernels_spec(spec: str | Path, kernels: bool) -> None:
    """--kernels needs an OUT_DIR with quantized weights (checked before any model work, from the headers)."""
    if not kernels:
        return
    if not is_accel_output(spec):
        raise AccelError("--kernels serves an accel OUT_DIR's quantized weights; a source model has none (drop "
                         "--kernels, or pass an OUT_DIR of accel quantize)")
    from accel.formats import Artifact

    artifact = Artifact(Path(spec))
    try:
        quantized = any(artifact.entry(name).role == "quantized" for name in artifact.names)
    finally:
        artifact.close()
    if not quantized:
        raise AccelError(f"--kernels serves an accel OUT_DIR's quantized weights; {spec} holds none (its weights "
                         f"are kept in source precision): drop --kernels")


def map_runtime(loaded: Any, kv: str | None, state: str | None) -> tuple[Any, dict[str, Any]]:
    """The KV / state runtime to decode through (the OUT_DIR's map, or --kv / --state), and its report keys."""
    from accel.quantize.maps import get_method, parse_spec

    maps = dict(loaded.maps)
    for kind, spec in (("kv", kv), ("state", state)):
        if spec is not None:
            method, arg = parse_spec(kind, spec)
            maps[kind] = method.from_eval_spec(arg, loaded.config)
            method.check(maps[kind], loaded.config)  # an OUT_DIR's own maps were checked when it was loaded
    if not maps:
        return None, {}
    if len(maps) > 1:
        raise AccelError("a KV map and a state map together are not supported; apply one at a time")
    kind, stored = next(iter(maps.items()))
    method = get_method(kind, stored.method)
    return method.runtime(stored, loaded.model), {kind: {"method": stored.method, "params": stored.params}}
