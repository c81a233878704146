"""`accel verify` as a library call: checksums, decode every tensor, check what eval loads beside the weights
(maps, config, tokenizer files), compare against a reference model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from accel.errors import AccelError, FormatError, NotAccelOutput
from accel.eval.load import model_config
from accel.formats import jsontext
from accel.formats.artifact import MANIFEST_FILE, Artifact, sidecar_files_sha256
from accel.formats.container import AccelFile
from accel.formats.filehash import file_faults
from accel.progress import SILENT, Progress

CONFIG_FILE = "config.json"


def verify_artifact(path: Path, reference: str | None = None, progress: Progress = SILENT) -> dict[str, Any]:
    """Every fault found is one line in `errors`; `ok` is true when there are none.

    Faults: a stored tensor whose checksum or decode fails, or that decodes to NaN/Inf; maps that eval's loading
    refuses; for an OUT_DIR, a missing accel.json or config.json, a config that does not describe the stored
    tensors, missing tokenizer files, a file that differs from the SHA-256 accel.json recorded; with a reference,
    tensors that differ in name or shape. A path that does not exist is a usage error (AccelError)."""
    path = Path(path)
    if not path.exists():
        raise AccelError(f"{path}: no such file or directory")
    try:
        art = Artifact(path)
    except NotAccelOutput as exc:  # another kind of file: bad input, not a damaged output
        raise AccelError(f"{exc}; verify reads what accel quantize writes") from None
    except FormatError as exc:
        return {"ok": False, "errors": [str(exc)], "tensors": 0}
    source = None
    if reference is not None:
        from accel.converters import open_model

        try:
            source = open_model(reference)
            check_reference_config(art.config, source.config)
        except BaseException:
            art.close()
            if source is not None:
                source.close()
            raise
    reference_names = set(source.tensor_names()) if source is not None else set()
    errors: list[str] = []
    faulty: set[str] = set()  # logical tensors with a fault listed
    rel_errors: dict[str, float] = {}
    max_abs = 0.0
    try:
        progress.stage("verifying", len(art.names))
        for name in art.names:
            progress.advance()
            decoded, fault = checked_decode(art.owner[name], name)
            if fault is not None:
                errors.append(fault)
                faulty.add(name)
                continue
            if source is None or art.entry(name).role not in ("quantized", "kept"):
                continue
            if name not in reference_names:
                errors.append(f"tensor '{name}': not in the reference model")
                continue
            ref = source.load_tensor(name).astype(np.float64)
            if ref.shape != decoded.shape:
                errors.append(f"tensor '{name}': shape {list(decoded.shape)} differs from the reference's "
                              f"{list(ref.shape)}")
                continue
            diff = decoded.astype(np.float64) - ref
            norm = float(np.linalg.norm(ref))
            rel_errors[name] = float(np.linalg.norm(diff)) / norm if norm > 0 else float(np.linalg.norm(diff))
            max_abs = max(max_abs, float(np.abs(diff).max()) if diff.size else 0.0)
        progress.close()
        if art.path.is_dir():  # an OUT_DIR: what eval needs beside the weights (a lone container has none of it)
            errors.extend(directory_faults(art))
        if not any(art.entry(n).role == "map" for n in faulty):  # a broken map array is listed already
            errors.extend(map_faults(art))
        if source is not None:
            missing = sorted(n for n in reference_names if n not in art.owner)
            errors.extend(f"tensor '{n}': in the reference but missing from the output" for n in missing)
    finally:
        art.close()
        if source is not None:
            source.close()
    report: dict[str, Any] = {"ok": not errors, "errors": errors, "tensors": len(art.names),
                              "bytes": art.total_bytes()}
    if reference is not None:
        worst = max(rel_errors, key=rel_errors.get) if rel_errors else None
        report.update({"reference": reference, "max_rel_error": rel_errors[worst] if worst else 0.0,
                       "max_rel_error_tensor": worst, "max_abs_error": max_abs, "rel_error": rel_errors})
    return report


# Config keys that tell two models apart before any tensor is read (export-ane's verify checks the same dims).
REFERENCE_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "intermediate_size")


def check_reference_config(config: dict[str, Any] | None, reference: dict[str, Any]) -> None:
    """Refuse a --reference whose config is another model's (bad input, exit 2, as eval refuses it); tensors that
    differ under a matching config stay faults of the output."""
    if not config:  # a lone container has no config: its tensors are compared one by one
        return
    for key in REFERENCE_KEYS:
        if key in config and key in reference and config[key] != reference[key]:
            raise AccelError(f"--reference has {key}={reference[key]!r}, the output {config[key]!r}: not the model "
                             f"the output was quantized from")


def checked_decode(container: AccelFile, name: str) -> tuple[np.ndarray | None, str | None]:
    """One logical tensor of a container decoded, or the one-line fault that stops it: a stored tensor's checksum,
    a decode the reader refuses, NaN or Inf in the values (each naming the file by the path it was opened as)."""
    bad = [s for s in container.entries[name].parts.values() if not container.checksum_ok(s)]
    if bad:
        return None, f"{container.path}: tensor '{name}': checksum mismatch in stored tensor '{bad[0]}'"
    try:
        decoded = container.decode(name, check=False)
    except FormatError as exc:  # the reader's message names the file and the tensor
        return None, str(exc)
    except AccelError as exc:
        return None, f"{container.path}: tensor '{name}': {exc}"
    if decoded.dtype.kind == "f" and not np.isfinite(decoded).all():
        return None, f"{container.path}: tensor '{name}': decodes to NaN or Inf"
    return decoded, None


def map_faults(art: Artifact) -> list[str]:
    """The check eval's loading makes of the maps (accel.quantize.maps: read, then checked against the config)."""
    from accel.quantize.maps import check_maps, read_maps

    try:
        maps = read_maps(art)
        config = model_config(art)
        if config is not None:
            check_maps(maps, config)
    except AccelError as exc:
        return [f"maps: {exc}"]
    return []


def directory_faults(art: Artifact) -> list[str]:
    """An OUT_DIR's accel.json, config.json and tokenizer files (docs/format.md §6): present, JSON objects, the
    config describing the stored tensors, and every file accel.json's `files` lists with the SHA-256 recorded when
    quantize wrote it."""
    faults = []
    if art.manifest is None:
        faults.append(f"{MANIFEST_FILE}: missing")
    elif not isinstance(art.manifest, dict):
        faults.append(f"{MANIFEST_FILE}: not a JSON object")
    if art.config is None:
        faults.append(f"{CONFIG_FILE}: missing, so the model cannot be built")
    elif not isinstance(art.config, dict):
        faults.append(f"{CONFIG_FILE}: not a JSON object")
    else:
        faults.extend(config_faults(art, model_config(art)))
    faults.extend(tokenizer_faults(art))
    if isinstance(art.manifest, dict):  # one line a file: a file named above is not listed again
        reported = {f.split(":", 1)[0] for f in faults}
        faults.extend(f for f in recorded_file_faults(art) if f.split(":", 1)[0] not in reported)
    return faults


def recorded_file_faults(art: Artifact) -> list[str]:
    """The files accel.json's `files` lists (name → SHA-256, written by quantize since 2026-12-06; older outputs
    have none and are checked as before): each present, with its recorded SHA-256."""
    if art.manifest.get("files") is None:
        return []
    return file_faults(art.manifest["files"], sidecar_files_sha256(art.root), writer="quantize",
                       manifest=MANIFEST_FILE)


def tokenizer_faults(art: Artifact) -> list[str]:
    """The tokenizer files quantize copied from the source (its accel.json `inputs` name them) are there, and at
    least one file a tokenizer loads from (a GGUF source's tokenizer is saved by transformers)."""
    from accel.converters.hf_dir import SUPPORT_FILES, TOKENIZER_MODEL_FILES

    inputs = art.manifest.get("inputs") if isinstance(art.manifest, dict) else None
    copied = sorted(n for n in inputs if n in SUPPORT_FILES and n != "generation_config.json") \
        if isinstance(inputs, dict) else []
    faults = [f"{n}: missing (the source's tokenizer file, copied by quantize)" for n in copied
              if not (art.root / n).is_file()]
    if not faults and not any((art.root / n).is_file() for n in TOKENIZER_MODEL_FILES):
        faults.append(f"no tokenizer file ({', '.join(TOKENIZER_MODEL_FILES)}), so the tokenizer cannot be loaded")
    return faults


def config_faults(art: Artifact, config: dict[str, Any]) -> list[str]:
    """config.json against the stored tensors: the model it describes, built with its parameters on the meta
    device (no memory, nothing decoded), refuses them as eval's strict load would (accel.converters.materialize)."""
    from accel.converters.materialize import empty_model, tensor_problems

    try:
        model = empty_model(config)
    except AccelError as exc:
        return [f"{CONFIG_FILE}: {exc}"]
    return [f"{CONFIG_FILE}: {p}" for p in tensor_problems(model, art.model_shapes(), str(config.get("model_type")))]


def is_calibration(path: Path) -> bool:
    """A directory `accel calibrate` wrote (it holds calibration.json)."""
    from accel.calibrate import CALIB_MANIFEST

    return Path(path).is_dir() and (Path(path) / CALIB_MANIFEST).is_file()


def verify_calibration(path: Path, progress: Progress = SILENT) -> dict[str, Any]:
    """`accel verify CALIB_DIR`: calibration.json readable and its recorded JSON files unchanged (`files`, since
    2026-12-06), and every container under the directory (Hessians, KV and state statistics) with every stored
    tensor's checksum right and every logical tensor decoding to finite values. One line a fault."""
    from accel.calibrate import CALIB_MANIFEST
    from accel.calibrate.run import calibration_files_sha256

    path = Path(path)
    errors: list[str] = []
    try:
        manifest = jsontext.loads((path / CALIB_MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        manifest = None
        errors.append(f"{CALIB_MANIFEST}: cannot be read ({type(exc).__name__})")
    if manifest is not None and not isinstance(manifest, dict):
        errors.append(f"{CALIB_MANIFEST}: not a JSON object")
    if isinstance(manifest, dict) and "files" in manifest:
        errors += file_faults(manifest["files"], calibration_files_sha256(path), writer="calibrate",
                              manifest=CALIB_MANIFEST)
    containers = sorted(path.rglob("*.safetensors"))
    tensors = total = 0
    progress.stage("verifying", len(containers))
    for file in containers:
        progress.advance()
        rel = file.relative_to(path).as_posix()  # named as the calibration's other files are: kv/model.safetensors
        try:
            container = AccelFile(file)
        except FormatError as exc:
            errors.append(str(exc).replace(str(file), rel, 1))
            continue
        try:
            for name in container.entries:
                tensors += 1
                total += container.stored_bytes(name)
                fault = checked_decode(container, name)[1]
                if fault is not None:
                    errors.append(fault.replace(str(file), rel, 1))
        finally:
            container.close()
    progress.close()
    kinds = manifest.get("for") if isinstance(manifest, dict) else None
    if isinstance(kinds, list):  # each kind calibrate recorded writes its container into its own directory
        errors += [f"{kind}/: no container (*.safetensors), though {CALIB_MANIFEST} lists --for {kind}"
                   for kind in kinds if isinstance(kind, str) and not any((path / kind).glob("*.safetensors"))]
    elif not containers:
        errors.append("no container (*.safetensors) under the calibration directory")
    return {"ok": not errors, "errors": errors, "tensors": tensors, "bytes": total, "kind": "calibration"}
