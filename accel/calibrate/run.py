"""`accel calibrate` as one library call: load the model once, run every requested kind into one directory.

Each kind (weights, kv, state) is a function registered with `register_kind`; it gets a `CalibContext` and writes
into its own subdirectory of the calibration directory. `calibration.json` records the model, the data's sha256,
the settings and each kind's report.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from accel import __version__
from accel.calibrate import CALIB_MANIFEST, without_timings
from accel.errors import AccelError
from accel.eval.data import check_context, read_text, token_windows
from accel.formats.atomic import atomic_write_text, output_dir, path_for_report
from accel.progress import SILENT, Progress
from accel.usage import peak_rss_mb

# kind -> (module that registers it, issue that tracks it)
KIND_MODULES = {"weights": ("accel.calibrate.hessians", 3), "kv": ("accel.calibrate.kv", 5),
                "state": ("accel.calibrate.state", 6)}


@dataclass(frozen=True)
class CalibSettings:
    samples: int = 64
    seq_len: int = 512
    seed: int = 0


@dataclass
class CalibContext:
    """What a calibration kind gets: the loaded model, the text, the drawn windows, its own output directory."""

    model_spec: str
    loaded: Any  # accel.eval.load.LoadedModel
    text: str
    windows: np.ndarray  # [samples, seq_len] token ids drawn with the seed
    out_dir: Path  # this kind's subdirectory (created, empty)
    settings: CalibSettings
    progress: Progress = SILENT


CalibKind = Callable[[CalibContext], dict[str, Any]]
_KINDS: dict[str, CalibKind] = {}


def register_kind(name: str) -> Callable[[CalibKind], CalibKind]:
    def wrap(fn: CalibKind) -> CalibKind:
        _KINDS[name] = fn
        return fn
    return wrap


def get_kind(name: str) -> CalibKind:
    if name not in KIND_MODULES:
        raise AccelError(f"--for {name!r}: choose from {', '.join(KIND_MODULES)}")
    module, issue = KIND_MODULES[name]
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
    if name not in _KINDS:
        raise AccelError(f"accel calibrate --for {name} is not available yet (tracked in issue #{issue})")
    return _KINDS[name]


def check_samples(samples: int) -> None:
    if samples < 1:
        raise AccelError(f"--samples must be at least 1, got {samples}")


def pick_windows(tokenizer, text: str, settings: CalibSettings) -> np.ndarray:
    """`samples` non-overlapping windows drawn (seeded) from the whole text, in text order."""
    check_samples(settings.samples)
    windows = token_windows(tokenizer, text, settings.seq_len, None)
    if len(windows) <= settings.samples:
        return windows
    pick = np.sort(np.random.default_rng(settings.seed).choice(len(windows), settings.samples, replace=False))
    return windows[pick]


def calibration_files_sha256(calib: Path) -> dict[str, str]:
    """SHA-256 of a calibration's JSON files (kv/report.json, ...) by path relative to it, calibration.json left
    out: what calibration.json's `files` records and quantize checks. Its containers are not listed: their
    documents and stored tensors carry their own checksums."""
    from accel.formats.filehash import files_sha256

    return files_sha256(calib, lambda rel: rel != CALIB_MANIFEST, "*.json")


# Statistics recorded through NaN or Inf weights are NaN too: the model is refused, as quantize refuses it.
NONFINITE = "tensor '{name}' holds NaN or Inf values; refusing to calibrate with it"


def _check_finite_weights(model: Any) -> None:
    import torch

    for name, param in model.named_parameters():
        if not bool(torch.isfinite(param).all()):
            raise AccelError(NONFINITE.format(name=name))


def calibrate(model: str, data: Path, out: Path, kinds: list[str], settings: CalibSettings, force: bool = False,
              progress: Progress = SILENT) -> dict[str, Any]:
    """Run the requested kinds on MODEL over DATA into OUT; returns {out, for, windows, tokens, <kind>: report}."""
    from accel.calibrate.state import SEGMENT
    from accel.eval.data import check_window_args
    from accel.eval.load import is_accel_output, load_causal_lm, streamed_causal_lm
    from accel.formats.filehash import file_sha256
    from accel.quantize.pipeline import model_files_sha256

    started = time.perf_counter()
    if not kinds:
        raise AccelError("--for is empty: choose from weights, kv, state")
    runners = {kind: get_kind(kind) for kind in dict.fromkeys(kinds)}
    check_window_args(settings.seq_len, None)  # before the model is built (seconds)
    check_samples(settings.samples)
    if "kv" in runners and settings.samples < 2:
        raise AccelError(f"--for kv pairs windows for its bootstrap intervals: --samples must be at least 2, "
                         f"got {settings.samples}")
    if "state" in runners and settings.seq_len < SEGMENT + 2:
        # the windows run in segments of SEGMENT tokens, and a segment reads the state of the one before it: a
        # window no longer than one segment (and the token it predicts) reads no state, so the sensitivity,
        # quantize's default ranking for water-filled maps, came out all zero
        raise AccelError(f"--for state reads the recurrent state from token {SEGMENT + 1} on: --seq-len must be at "
                         f"least {SEGMENT + 2}, got {settings.seq_len}")
    text = read_text(data)
    with contextlib.ExitStack() as held:
        if set(runners) == {"weights"} and not is_accel_output(model):
            # the Hessians are recorded a decoder layer at a time: the weights are read a layer at a time too
            loaded = held.enter_context(streamed_causal_lm(model, progress, NONFINITE))
        else:
            loaded = load_causal_lm(model, progress)
            _check_finite_weights(loaded.model)
        check_context(settings.seq_len, loaded.config)
        windows = pick_windows(loaded.tokenizer, text, settings)
        if "kv" in runners and len(windows) < 2:
            raise AccelError(f"--for kv needs at least 2 windows of --seq-len {settings.seq_len}; the text holds "
                             f"{len(windows)}")
        reports: dict[str, Any] = {}
        with output_dir(Path(out), force, inputs=[Path(model), Path(data), *filter(None, [loaded.path])]) as tmp:
            for kind, run in runners.items():
                (tmp / kind).mkdir()
                reports[kind] = run(CalibContext(str(model), loaded, text, windows, tmp / kind, settings, progress))
            manifest = {"producer": f"accel {__version__}", "model": str(model), "for": list(runners),
                        "model_sha256": model_files_sha256(loaded.input_files),
                        "data": {Path(data).name: file_sha256(Path(data))}, "settings": asdict(settings),
                        "tokens": int(windows.size), "windows": len(windows), "reports": without_timings(reports),
                        "files": calibration_files_sha256(tmp)}
            atomic_write_text(tmp / CALIB_MANIFEST,
                              json.dumps(manifest, indent=2, sort_keys=True, allow_nan=False) + "\n")
    return {"out": path_for_report(out), "for": list(runners), "windows": len(windows), "tokens": int(windows.size),
            "seconds": time.perf_counter() - started, "peak_rss_mb": peak_rss_mb(), **reports}
