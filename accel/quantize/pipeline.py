"""`accel quantize` as one library call: source model -> codecs -> container -> OUT_DIR, streamed per tensor."""

from __future__ import annotations

import hashlib
import json
import resource
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from accel import __version__
from accel.errors import AccelError
from accel.formats.artifact import MANIFEST_FILE, Artifact, write_weights
from accel.formats.atomic import atomic_write_text, check_output_dir, output_dir
from accel.formats.layouts import get_layout
from accel.formats.tensor import encode_tensor
from accel.progress import SILENT, Progress
from accel.quantize.methods import WeightSettings, get_weight_method, is_quantizable
from accel.quantize.parallel import FixedHessian, default_jobs, encode_one, worker_pool


@dataclass(frozen=True)
class QuantizeSettings:
    weights: str | None = None
    group: int = 64
    layout: str | None = None
    seed: int = 0
    calib: str | None = None
    max_shard_bytes: int = 2 * 1024**3


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _check_settings(settings: QuantizeSettings) -> None:
    if settings.weights is None:
        raise AccelError("nothing to quantize: pass --weights (for example --weights rtn4)")
    method = get_weight_method(settings.weights)
    if settings.group < 1:
        raise AccelError(f"--group must be positive, got {settings.group}")
    if settings.layout is not None:
        get_layout(settings.layout)
    if method.needs_calibration and settings.calib is None:
        raise AccelError(f"--weights {settings.weights} needs --calib (run `accel calibrate --for weights` first)")


def quantize_model(model: str, out: Path, settings: QuantizeSettings, force: bool = False,
                   progress: Progress = SILENT, jobs: int | None = None) -> dict[str, Any]:
    """Quantize MODEL into OUT_DIR; returns the report of design.md §3 (`quantize`).

    `jobs` worker processes share the heavy methods' tensors (default: one per core); the bytes written do
    not depend on it.
    """
    from accel.converters import open_model
    from accel.converters.sources import config_json_bytes

    started = time.perf_counter()
    jobs = default_jobs() if jobs is None else jobs
    _check_settings(settings)
    check_output_dir(Path(out), force)
    method = get_weight_method(settings.weights)
    hessians = None
    if settings.calib is not None:
        from accel.calibrate.hessians import HessianStore

        hessians = HessianStore(Path(settings.calib))
    weight_settings = WeightSettings(group=settings.group, layout=settings.layout, seed=settings.seed,
                                     hessians=hessians)
    with open_model(model) as source:
        inputs = sorted({Path(p) for p in source.input_files})
        with output_dir(Path(out), force, inputs=inputs + [Path(model)]) as tmp:
            names = source.tensor_names()
            progress.stage(f"quantizing ({settings.weights})", len(names))
            results: dict[str, Any] = {}
            with worker_pool(jobs if method.parallel else 1) as pool:
                for name in names:
                    x = source.load_tensor(name)
                    if not np.isfinite(x).all():
                        raise AccelError(f"tensor '{name}' holds NaN or Inf values; refusing to quantize it")
                    if not is_quantizable(name, x.shape):
                        results[name] = encode_tensor(name, x, "raw", role="kept", dtype=source.tensor_dtype(name))
                        progress.advance()
                        continue
                    own = replace(weight_settings, hessians=None if hessians is None else
                                  FixedHessian(name, hessians.get(name, x.shape[1])))
                    if pool is None:
                        results[name] = encode_one(settings.weights, name, x, own)
                        progress.advance()
                    else:
                        results[name] = pool.submit(encode_one, settings.weights, name, x, own)
                for name, result in results.items():
                    if isinstance(result, Future):
                        results[name] = result.result()
                        progress.advance()
            encoded = [results[name] for name in names]
            del results
            progress.close()
            write_weights(tmp, encoded, settings.max_shard_bytes)
            source.save_support_files(tmp)
            config = dict(source.config)
            config["accel"] = {"format_version": 1, "weights": settings.weights}
            (tmp / "config.json").write_bytes(config_json_bytes(config))
            summary = {e.name: {"codec": e.codec, "layout": e.layout, "role": e.role,
                                "bytes": int(sum(a.nbytes for a in arrays.values()))} for e, arrays in encoded}
            del encoded
            hashed = inputs + ([Path(settings.calib) / "calibration.json"] if settings.calib else [])
            manifest = {
                "producer": f"accel {__version__}",
                "source": str(model),
                "inputs": {p.name: file_sha256(p) for p in hashed},
                "settings": asdict(settings),
                "tensors": summary,
            }
            atomic_write_text(tmp / MANIFEST_FILE, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            art = Artifact(tmp)
            bpw = art.bits_per_weight("quantized")
            art.close()
    return {
        "out": str(out),
        "weights": settings.weights,
        "bits_per_weight": bpw,
        "seconds": time.perf_counter() - started,
        "peak_rss_mb": max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF,
                                                                          resource.RUSAGE_CHILDREN)) / 1024.0,
        "jobs": jobs if method.parallel else 1,
        "tensors": len(summary),
        "quantized_tensors": sum(1 for s in summary.values() if s["role"] == "quantized"),
    }
