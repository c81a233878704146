"""`accel quantize` as one library call: source model -> codecs -> container -> OUT_DIR, streamed per tensor."""

from __future__ import annotations

import json
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from accel import __version__
from accel.calibrate import CALIB_MANIFEST
from accel.converters.checkpoint_names import NameMap, name_map
from accel.errors import AccelError
from accel.formats import jsontext
from accel.formats.artifact import MANIFEST_FILE, Artifact, Encoded, WeightsWriter, sidecar_files_sha256
from accel.formats.atomic import atomic_write_text, check_output_dir, output_dir, path_for_report
from accel.formats.container import FORMAT_VERSION
from accel.formats.filehash import file_sha256
from accel.formats.layouts import get_layout
from accel.formats.tensor import decode_parts, encode_tensor
from accel.progress import SILENT, Progress
from accel.quantize.maps import BuildContext, encode_map, parse_spec
from accel.quantize.methods import WeightMethod, WeightSettings, get_weight_method, is_quantizable
from accel.quantize.parallel import FixedHessian, default_jobs, encode_one, workers
from accel.usage import peak_rss_mb

DEFAULT_GROUP = 64  # the affine methods' group size when --group is not given


@dataclass(frozen=True)
class QuantizeSettings:
    weights: str | None = None
    group: int | None = None  # --group as given (None: DEFAULT_GROUP for the affine methods, unused by Leech)
    layout: str | None = None
    seed: int = 0
    calib: str | None = None
    kv: str | None = None  # --kv METHOD[:ARG] (accel.quantize.maps)
    state: str | None = None  # --state METHOD[:ARG]
    tune_steps: int = 0  # --tune-steps: leech row scales refit by KL on the calibration windows (leech_tune)
    max_shard_bytes: int = 2 * 1024**3


def effective_group(settings: QuantizeSettings) -> int | None:
    """The group size the weights are quantized with: --group, or DEFAULT_GROUP for an affine method; None where
    no method reads one (Leech, or no --weights)."""
    if settings.weights is None or settings.weights.startswith("leech"):
        return None
    return settings.group if settings.group is not None else DEFAULT_GROUP


def model_files_sha256(files: list[Path]) -> dict[str, str]:
    """sha256 of a source model's files by name: what a calibration records of its model, and quantize checks."""
    return {Path(p).name: file_sha256(Path(p)) for p in sorted(set(files)) if Path(p).is_file()}


def check_calibration_model(calib: Path, files_sha256: dict[str, str]) -> None:
    """Refuse a calibration recorded on other model files (older calibrations record none and are not checked), and
    one whose manifest is missing or damaged (not a JSON object), which would otherwise skip that check: a copy of
    model A's calibration without its manifest was taken for model B of the same shapes."""
    path = Path(calib) / CALIB_MANIFEST
    if not path.is_file():
        raise AccelError(f"--calib {calib}: no {CALIB_MANIFEST} (not a directory accel calibrate wrote, or a damaged "
                         f"one; without it the calibration's model cannot be checked): run accel calibrate again")
    try:
        doc = jsontext.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise AccelError(f"--calib {calib}: {CALIB_MANIFEST} cannot be read ({type(exc).__name__}); the calibration "
                         f"is damaged: run accel calibrate again") from None
    if not isinstance(doc, dict):
        raise AccelError(f"--calib {calib}: {CALIB_MANIFEST} is not a JSON object; the calibration is damaged: run "
                         f"accel calibrate again")
    files = doc.get("files")
    if files is not None:  # calibrations written since 2026-12-06; a missing file is left to its reader
        from accel.calibrate.run import calibration_files_sha256

        found = calibration_files_sha256(calib)
        changed = sorted(n for n in files if n in found and found[n] != files[n]) if isinstance(files, dict) \
            else [CALIB_MANIFEST]
        if changed:
            raise AccelError(f"--calib {calib}: {', '.join(changed)} changed since calibrate wrote it (SHA-256 "
                             f"differs from {CALIB_MANIFEST}'s); the calibration is damaged: run accel calibrate again")
    recorded = doc.get("model_sha256")
    if isinstance(recorded, dict) and recorded and recorded != files_sha256:
        differ = sorted(n for n in set(recorded) | set(files_sha256) if recorded.get(n) != files_sha256.get(n))
        raise AccelError(f"--calib {calib} was recorded on a different model: its sha256 of {', '.join(differ)} "
                         f"differs from this model's")


def _check_settings(settings: QuantizeSettings) -> None:
    if settings.weights is None and settings.kv is None and settings.state is None:
        raise AccelError("nothing to quantize: pass --weights (for example --weights rtn4), --kv or --state")
    for kind in ("kv", "state"):
        if getattr(settings, kind) is not None:
            parse_spec(kind, getattr(settings, kind))
    if settings.group is not None and settings.group < 1:
        raise AccelError(f"--group must be positive, got {settings.group}")
    if settings.tune_steps < 0:
        raise AccelError(f"--tune-steps must be 0 or more, got {settings.tune_steps}")
    if settings.tune_steps and (settings.weights is None or not settings.weights.startswith("leech")
                                or settings.calib is None):
        raise AccelError("--tune-steps tunes Leech row scales: it needs --weights leech2|3|4 and --calib")
    if settings.calib is not None and not Path(settings.calib).is_dir():
        what = "not a directory" if Path(settings.calib).exists() else "no such directory"
        raise AccelError(f"--calib {settings.calib}: {what} (write one with accel calibrate)")
    # options that would change nothing are refused, not recorded in accel.json as if applied
    if settings.weights is None:
        if settings.layout is not None or settings.group is not None:
            option = "--layout" if settings.layout is not None else "--group"
            raise AccelError(f"{option} shapes quantized weights: it needs --weights")
        return
    method = get_weight_method(settings.weights)
    if settings.layout is not None:
        get_layout(settings.layout)
    if settings.weights.startswith("leech") and settings.group is not None:
        raise AccelError(f"--group is the affine methods' group size (rtn, hqq, gptq); --weights {settings.weights} "
                         f"codes 24-value blocks: drop --group")
    if method.needs_calibration and settings.calib is None:
        raise AccelError(f"--weights {settings.weights} needs --calib (run `accel calibrate --for weights` first)")
    if settings.calib is not None and not (method.needs_calibration or method.uses_calibration) \
            and settings.kv is None and settings.state is None:
        raise AccelError(f"--weights {settings.weights} reads no calibration, and no --kv or --state map is built: "
                         f"drop --calib")


def _build_maps(model: str, config: dict[str, Any], settings: QuantizeSettings, progress: Progress
                ) -> dict[str, Any]:
    """The --kv / --state maps, built (and checked against the model) before any weight work."""
    maps = {}
    for kind in ("kv", "state"):
        spec = getattr(settings, kind)
        if spec is None:
            continue
        map_method, arg = parse_spec(kind, spec)
        ctx = BuildContext(model=model, config=config, calib=Path(settings.calib) if settings.calib else None,
                           seed=settings.seed, progress=progress)
        stored = map_method.build(arg, ctx)
        map_method.check(stored, config)
        maps[kind] = stored
    return maps


def keep_tensor(source, name: str, x: np.ndarray):
    """A tensor accel does not quantize, stored losslessly: on the grid the source itself stores it on when there is
    one and the `affine` codec reproduces every value bit for bit from it (a Q4_1 or Q8_0 GGUF tensor: 5 or 9 bits a
    weight instead of 32), else `raw` in the source's precision."""
    grid = source.native_grid(name)
    if grid is not None:
        entry, arrays = encode_tensor(name, x, "affine", role="kept", levels=grid["levels"], group=grid["group"],
                                      symmetric=False, scale=grid["scale"], offset=grid["offset"])
        decoded = decode_parts(entry, {part: arrays[stored] for part, stored in entry.parts.items()})
        if np.array_equal(np.ascontiguousarray(decoded, np.float32).view(np.uint32), x.view(np.uint32)):
            return entry, arrays
    return encode_tensor(name, x, "raw", role="kept", dtype=source.tensor_dtype(name))


def _plan_tensors(source: Any, names: list[str], method: WeightMethod | None, settings: QuantizeSettings,
                  hessians: Any) -> tuple[NameMap, dict[str, str | None]]:
    """The checkpoint's model names, and the tensors `method` quantizes, each with the name calibration recorded its
    inputs under (None without calibration): judged and checked before any work, by the model's names (a router's
    checkpoint name may not say router: GraniteMoE's router.layer.weight is the model's router.weight)."""
    shapes = source.tensor_shapes()
    model_names = name_map(str(source.config.get("model_type")), shapes)
    if method is None:
        return model_names, {}
    quantized: dict[str, str | None] = {n: None for n in names
                                        if is_quantizable(model_names.model_name(n) or n, shapes[n])}
    fused = [n for n in quantized if model_names.model_name(n) is None]
    if settings.tune_steps and fused:  # tuning swaps each leech tensor's nn.Linear, found by the model's name
        raise AccelError(f"--tune-steps refits the row scales of nn.Linear layers, and '{fused[0]}' is a part of a "
                         f"merged parameter (a mixture-of-experts layer's experts): drop --tune-steps for this model")
    if hessians is not None:
        quantized = {n: _hessian_name(n, model_names, settings, hessians.key_of) for n in quantized}
    return model_names, quantized


def _hessian_name(name: str, model_names: NameMap, settings: QuantizeSettings, recorded: dict[str, str]) -> str:
    """The name calibration recorded a checkpoint tensor's Hessian under: its nn.Linear's in the model's names, or
    for one expert of a fused experts parameter `<parameter>.<expert>` (accel.calibrate.hessians.expert_key)."""
    from accel.calibrate.hessians import expert_key, recorded_experts, unreached_key

    model_name = model_names.model_name(name)
    if model_name is not None:
        return model_name
    expert = model_names.expert_of(name)
    if expert is None:
        raise AccelError(f"--weights {settings.weights} needs the inputs of '{name}', a part of a merged parameter "
                         f"that calibration does not record; use a method without calibration (rtn, hqq)")
    key = expert_key(*expert)
    if key in recorded:
        return key
    if recorded_experts(expert[0], recorded):  # no token was routed to this expert: round to nearest
        return unreached_key(*expert)
    raise AccelError(f"--calib has no inputs for '{name}' (expert {expert[1]} of {expert[0]}): no calibration token "
                     f"reached any expert of it, or the calibration predates expert Hessians (2026-12-07); "
                     f"calibrate again")


def unreached_warnings(quantized: dict[str, str | None], model_names: NameMap) -> list[str]:
    """One line for the experts no calibration token reached, quantized as with an identity Hessian."""
    from accel.calibrate.hessians import UNREACHED_PREFIX

    experts = sorted({model_names.expert_of(n) for n, key in quantized.items()
                      if key is not None and key.startswith(UNREACHED_PREFIX)})
    if not experts:
        return []
    first = f"expert {experts[0][1]} of {experts[0][0]}" + (", ..." if len(experts) > 1 else "")
    line = (f"{len(experts)} expert projection(s) got no calibration token ({first}): rounded to nearest (an "
            f"identity Hessian); calibrate with more --samples to give each its own")
    return [line]


def check_source_loads(model: str, source: Any) -> None:
    """Refuse, before any work, a source whose config and tensors eval could not build a model from: its output
    would hold the same config and tensors, and eval would refuse it after the whole quantization (the same check as
    `build_transformers_model`'s, on the meta device: nothing is loaded)."""
    from accel.converters.materialize import loading_problem

    problem = loading_problem(dict(source.config), source.tensor_shapes())
    if problem:
        raise AccelError(f"{model}: {problem} (its config does not describe its tensors; eval could not load the "
                         "output)")


def tokenizer_warnings(source: Any) -> list[str]:
    """A source without a tokenizer still quantizes (export-ane needs none), but its output cannot be evaluated,
    continued or verified: looked for before any work, said in the report (and by the CLI on stderr)."""
    try:
        source.load_tokenizer()
    except AccelError as exc:
        message = (f"{exc}; the output will have none, so eval, generate and verify refuse it until its tokenizer "
                   "files are added (export-ane needs none)")
        return [message]
    return []


def quantize_model(model: str, out: Path, settings: QuantizeSettings, force: bool = False,
                   progress: Progress = SILENT, jobs: int | None = None, ray: str | None = None) -> dict[str, Any]:
    """Quantize MODEL into OUT_DIR; returns the report of design.md §3 (`quantize`).

    `jobs` worker processes share the heavy methods' tensors (default: one per core), or with `ray` the CPUs of
    that Ray cluster (accel.quantize.parallel.ray_workers; "local" starts one of `jobs` CPUs); the bytes written
    depend on neither.
    """
    from accel.converters import announce_tokenizer_work, open_model
    from accel.converters.sources import config_json_bytes

    started = time.perf_counter()
    if jobs is not None and ray not in (None, "local"):
        raise AccelError(f"--jobs sets the local worker count; with --ray {ray} the cluster's CPUs do the work")
    jobs = default_jobs() if jobs is None else jobs
    if jobs < 1:
        raise AccelError(f"--jobs must be at least 1, got {jobs}")
    _check_settings(settings)
    calib = [Path(settings.calib)] if settings.calib is not None else []  # an input too: never overwritten
    check_output_dir(Path(out), force, [Path(model)] + calib)
    method: WeightMethod | None = get_weight_method(settings.weights) if settings.weights else None
    parallel = method is not None and method.parallel
    if ray is not None and not parallel:
        what = f"--weights {settings.weights} runs in this process" if method else "nothing is quantized"
        raise AccelError(f"--ray spreads the heavy methods' tensors (leech, gptq) over a cluster; {what}")
    hessians = None
    if settings.calib is not None and method is not None and method.uses_calibration:
        from accel.calibrate.hessians import HessianStore

        hessians = HessianStore(Path(settings.calib))
    weight_settings = WeightSettings(group=effective_group(settings), layout=settings.layout, seed=settings.seed,
                                     hessians=hessians)
    progress.stage(f"reading {Path(str(model)).name}", 3)  # seconds of silence otherwise (a GGUF, its tokenizer)
    with open_model(model) as source:
        progress.advance()
        inputs = sorted({Path(p) for p in source.input_files})
        check_source_loads(model, source)
        progress.advance()
        announce_tokenizer_work(source, progress)
        warnings = tokenizer_warnings(source)
        progress.advance()
        progress.close()
        maps = _build_maps(model, dict(source.config), settings, progress)  # names a shape mismatch first
        hashes = model_files_sha256(inputs)
        if settings.calib is not None:
            check_calibration_model(Path(settings.calib), hashes)
        names = source.tensor_names()
        model_names, quantized = _plan_tensors(source, names, method, settings, hessians)
        warnings += unreached_warnings(quantized, model_names)
        with output_dir(Path(out), force, inputs=inputs + [Path(model), source.path] + calib) as tmp, \
                WeightsWriter(tmp, settings.max_shard_bytes) as writer:
            progress.stage(f"quantizing ({settings.weights or 'weights kept'})", len(names))
            held: list[Encoded] = []  # --tune-steps refits the leech tensors' scales after all are quantized

            def store(item: Encoded) -> None:
                if settings.tune_steps:
                    held.append(item)
                else:
                    writer.add(item)
                progress.advance()

            with workers(jobs if parallel else 1, ray) as pool:
                used_workers = 1 if pool is None else pool.count
                pending: deque[Future] = deque()  # at most 2 a worker: the source is read as the workers go
                for name in names:
                    x = source.load_tensor(name)
                    if not np.isfinite(x).all():
                        raise AccelError(f"tensor '{name}' holds NaN or Inf values; refusing to quantize it")
                    if name not in quantized:
                        store(keep_tensor(source, name, x))
                        continue
                    own = replace(weight_settings, hessians=None if hessians is None else
                                  FixedHessian(name, hessians.get(quantized[name], x.shape[1])))
                    if pool is None:
                        store(encode_one(settings.weights, name, x, own))
                        continue
                    pending.append(pool.submit(encode_one, settings.weights, name, x, own))
                    while len(pending) >= 2 * pool.count:
                        store(pending.popleft().result())
                while pending:
                    store(pending.popleft().result())
            progress.close()
            tuned = None
            if settings.tune_steps:
                from accel.quantize.leech_tune import tune_leech_scales

                tuned = tune_leech_scales(dict(source.config), {n: source.load_tensor(n) for n in names}, held,
                                          hessians.windows(), settings.tune_steps, seed=settings.seed,
                                          progress=progress, model_name=model_names.model_name)
                for item in held:
                    writer.add(item)
                del held[:]
            maps_doc = {}
            for kind, stored in maps.items():
                maps_doc[kind], map_tensors = encode_map(stored)
                for item in map_tensors:
                    writer.add(item)
            writer.finish(extra={"maps": maps_doc} if maps_doc else None)
            summary = {entry.name: {"codec": entry.codec, "layout": entry.layout, "role": entry.role, "bytes": nbytes}
                       for entry, nbytes in writer.tensors()}  # every stored tensor, the maps' included
            source.save_support_files(tmp)
            config = dict(source.config)
            config["accel"] = {"format_version": FORMAT_VERSION, "weights": settings.weights,
                               **{kind: getattr(settings, kind) for kind in maps}}
            (tmp / "config.json").write_bytes(config_json_bytes(config))
            manifest = {
                "producer": f"accel {__version__}",
                "source": str(model),
                "inputs": hashes | model_files_sha256([c / CALIB_MANIFEST for c in calib]),
                "files": sidecar_files_sha256(tmp),
                "settings": {**asdict(settings), "group": effective_group(settings)},
                "tensors": summary,
                "maps": {kind: {"method": m.method, "params": m.params} for kind, m in maps.items()},
            }
            atomic_write_text(tmp / MANIFEST_FILE, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            art = Artifact(tmp)
            bpw = art.bits_per_weight("quantized")
            art.close()
    return {
        "out": path_for_report(out),
        "weights": settings.weights,
        "bits_per_weight": bpw,
        "seconds": time.perf_counter() - started,
        "peak_rss_mb": peak_rss_mb(),
        "jobs": used_workers,
        **({"ray": ray} if ray is not None else {}),
        "maps": {kind: m.method for kind, m in maps.items()},
        "tensors": len(summary),
        "quantized_tensors": sum(1 for s in summary.values() if s["role"] == "quantized"),
        **({"tune": tuned} if tuned is not None else {}),
        "warnings": warnings,
    }
