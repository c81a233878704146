"""`accel verify PKG [--reference MODEL]`: run the saved package's program in the NumPy MIL interpreter and compare
its logits with the PyTorch reference model, for a prefill call and several decode steps.

The reference is transformers' Llama holding the package's own decoded weights (for fp16, the source weights):
the check is that the program computes the model, within fp16 arithmetic; the encoding's quantization error is
reported separately (`weight_rel_error`), per tensor against the source.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from accel.converters.coreml.ane_llama import llama_dims, logits_from_pieces
from accel.converters.coreml.export import WeightSource, package_files_sha256, read_manifest
from accel.converters.coreml.mil_interp import SUPPORTED_OPS, Interpreter
from accel.errors import AccelError, FormatError
from accel.formats.filehash import file_faults
from accel.progress import SILENT, Progress

# Largest |interpreter - reference| / max|reference| per call accepted as "within fp16 tolerance": fp16 keeps
# 11 significant bits (4.9e-4 relative); 30 layers of fp16 storage compound on SmolLM2-135M to 1.5e-3..8.5e-3 per
# decode step and 7.0e-3..1.06e-2 for a 64-token prefill, over all five encodings (docs/benchmarks.md), so 2e-2
# passes rounding and fails a wrong op.
FP16_TOLERANCE = 2e-2
DEFAULT_STEPS = 4
# Largest relative (Frobenius) error of a decoded matrix against the reference's that an encoding can explain:
# k-means LUTs on Gaussian-like weights give ~0.11 (4 bits) and ~0.35 (2 bits), ternary ~0.45, int8 < 0.01.
# A package built from other weights lands near sqrt(2); the reference must then be the wrong model.
WEIGHT_ERROR_BOUND = {"fp16": 0.01, "int8": 0.05, "lut4": 0.3, "lut2": 0.7, "ternary": 0.8}


def verify_package(package: Path, reference: str | None = None, steps: int = DEFAULT_STEPS, seed: int = 0,
                   progress: Progress = SILENT) -> dict[str, Any]:
    package = Path(package)
    if not package.is_dir():  # a wrong path is bad input (exit 2), not a damaged package
        raise AccelError(f"{package}: no such package directory")
    if not (package / "Manifest.json").is_file():
        raise AccelError(f"{package}: no Manifest.json (not a Core ML package)")
    errors: list[str] = []
    try:
        manifest = read_manifest(package)
        errors += file_errors(package, manifest)
        if errors:  # nothing is interpreted from files that are not what export wrote
            return {"ok": False, "errors": errors, "package": str(package)}
        interp = Interpreter.from_package(package)
    except FormatError as exc:
        return {"ok": False, "errors": [str(exc)], "package": str(package)}
    source = WeightSource(reference) if reference is not None else None  # a bad --reference: exit 2 before work
    try:
        if source is not None:
            check_reference_dims(source, manifest)
        try:
            return _verify(package, manifest, interp, source, steps, seed, progress)
        except (AccelError, ValueError, KeyError, IndexError, TypeError, OverflowError) as exc:
            # the manifest passed its checks but does not describe the program (an edited value): a fault
            fault = (f"the package does not run as its manifest describes it ({type(exc).__name__}: "
                     f"{' '.join(str(exc).split())[:200]})")
            return {"ok": False, "package": str(package), "encoding": manifest.get("encoding"), "errors": [fault]}
    finally:
        if source is not None:
            source.close()


def check_reference_dims(source: WeightSource, manifest: dict[str, Any]) -> None:
    """Refuse a --reference whose shape is not the package's (bad input: the wrong model named)."""
    dims = llama_dims(source.config)
    for key in ("vocab", "hidden", "layers", "heads", "kv_heads", "head_dim"):
        if getattr(dims, key) != manifest["dims"][key]:
            raise AccelError(f"--reference has {key}={getattr(dims, key)}, the package {manifest['dims'][key]}: "
                             f"not the model the package was exported from")


def file_errors(package: Path, manifest: dict[str, Any]) -> list[str]:
    """The package's files against the SHA-256s its manifest recorded (`files`; packages exported before
    2026-12-06 have none): one line a missing, changed or unlisted file."""
    if manifest.get("files") is None:
        return []
    return file_faults(manifest["files"], package_files_sha256(package), writer="export", manifest="the manifest",
                       prefix="Data/", unlisted=True)


def _verify(package: Path, manifest: dict[str, Any], interp: Interpreter, source: WeightSource | None, steps: int,
            seed: int, progress: Progress) -> dict[str, Any]:
    errors = structure_errors(manifest, interp)
    report: dict[str, Any] = {"package": str(package), "encoding": manifest.get("encoding"),
                              "functions": interp.functions}
    if errors:
        return {**report, "ok": False, "errors": errors}
    seq = int(manifest["functions"]["prefill"]["seq"])
    # decode steps after the prefill stay inside the cache; a prefill that fills it (prefill = context) leaves none,
    # and the decode function is then run from an empty cache instead (positions 0, 1, ...)
    after = max(0, min(steps, int(manifest.get("context", seq + steps)) - seq))
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, int(manifest["dims"]["vocab"]), size=seq + after)
    progress.stage("interpreting the package", 1 + steps)
    calls = run_interpreter(interp, tokens, seq, after, progress)
    if after < steps:
        calls += run_decode_from_empty(interp, tokens, min(steps - after, len(tokens)), progress)
    bad = [f"{name}: non-finite logits" for name, _, logits in calls if not np.all(np.isfinite(logits))]
    errors += bad
    if source is None:
        return {**report, "ok": not errors, "errors": errors, "calls": len(calls)}
    ref_logits, weight_errors = reference_logits(source, manifest, interp, tokens)
    results = []
    for name, start, logits in calls:
        want = ref_logits[start:start + logits.shape[0]]
        rel = float(np.abs(logits - want).max() / max(np.abs(want).max(), 1e-6))
        top1 = float(np.mean(logits.argmax(-1) == want.argmax(-1)))
        results.append({"call": name, "tokens": int(logits.shape[0]), "rel_error": rel, "top1_agreement": top1})
        if rel > FP16_TOLERANCE:
            errors.append(f"{name}: logits differ from the reference by {rel:.3g} of their range "
                          f"(fp16 tolerance {FP16_TOLERANCE})")
    progress.close()
    worst = max(weight_errors.items(), key=lambda kv: kv[1]) if weight_errors else (None, 0.0)
    bound = WEIGHT_ERROR_BOUND.get(str(manifest.get("encoding")), 0.8)
    if worst[1] > bound:
        errors.append(f"weight {worst[0]}: the package's matrix differs from the reference's by {worst[1]:.3g} "
                      f"(more than {manifest.get('encoding')} encoding explains, {bound}): another model?")
    return {**report, "ok": not errors, "errors": errors, "reference": source.spec,
            "max_rel_error": max(r["rel_error"] for r in results), "tolerance": FP16_TOLERANCE,
            "calls": results, "weight_rel_error": worst[1], "weight_rel_error_tensor": worst[0],
            "weight_rel_errors": dict(sorted(weight_errors.items()))}


def structure_errors(manifest: dict[str, Any], interp: Interpreter) -> list[str]:
    errors = []
    for name in manifest.get("functions", {}):
        if name not in interp.functions:
            errors.append(f"function {name!r} of the manifest is not in the program")
    for fname, func in interp.program.functions.items():
        for operation in func.operations:
            if operation.op_type not in SUPPORTED_OPS:
                errors.append(f"{fname}: op {operation.op_type} ({operation.name}) is not one accel emits")
        outputs = [v.name for v in func.outputs]
        if outputs != manifest.get("outputs"):
            errors.append(f"{fname}: outputs {outputs} differ from the manifest's {manifest.get('outputs')}")
    return errors


def run_interpreter(interp: Interpreter, tokens: np.ndarray, seq: int, steps: int,
                    progress: Progress = SILENT) -> list[tuple[str, int, np.ndarray]]:
    """Prefill `seq` tokens, then decode `steps` more one at a time, sharing one state; per call its name, the
    position of its first token and its logits."""
    state = interp.new_state("prefill")
    out = interp.run("prefill", {"input_ids": tokens[None, :seq], "position_ids": np.arange(seq)[None]}, state)
    calls = [("prefill", 0, logits_from_pieces(_pieces(out)))]
    progress.advance()
    for i in range(steps):
        calls.append((f"decode[{i}]", seq + i, _decode(interp, tokens, seq + i, state)))
        progress.advance()
    return calls


def run_decode_from_empty(interp: Interpreter, tokens: np.ndarray, steps: int,
                          progress: Progress = SILENT) -> list[tuple[str, int, np.ndarray]]:
    """Decode tokens 0 .. steps - 1 one at a time from an empty cache (as run_interpreter returns them)."""
    state = interp.new_state("decode")
    calls = []
    for pos in range(steps):
        calls.append((f"decode[{pos}] from an empty cache", pos, _decode(interp, tokens, pos, state)))
        progress.advance()
    return calls


def _decode(interp: Interpreter, tokens: np.ndarray, pos: int, state: dict[str, np.ndarray]) -> np.ndarray:
    out = interp.run("decode", {"input_ids": tokens[None, pos:pos + 1], "position_ids": np.array([[pos]])}, state)
    return logits_from_pieces(_pieces(out))


def _pieces(outputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    return [outputs[k] for k in sorted(outputs, key=lambda k: int(k.rsplit("_", 1)[1]))]


def package_weights(manifest: dict[str, Any], interp: Interpreter) -> dict[str, np.ndarray]:
    """Each encoded matrix as the package reconstructs it, keyed by manifest weight name, (rows, cols)."""
    func = interp.program.functions["decode"]
    by_name = {op.name: op for op in func.operations}
    out = {}
    for pname, info in manifest["weights"].items():
        producer = by_name.get(info["mil_name"])
        if producer is None:
            raise FormatError(f"the package program has no op {info['mil_name']!r} for weight {pname!r}")
        value = interp.constant(producer.outputs[0])
        out[pname] = value.reshape(value.shape[0], value.shape[1])
    return out


def reference_logits(source: WeightSource, manifest: dict[str, Any], interp: Interpreter,
                     tokens: np.ndarray) -> tuple[np.ndarray, dict[str, float]]:
    """transformers' logits for all tokens (no cache), with the package's matrices in place of the source's."""
    import torch

    from accel.converters import build_transformers_model
    from accel.converters.coreml.export import quiet_coremltools
    from accel.converters.coreml.placement import _hf_names

    dims = llama_dims(source.config)  # the same as the package's (check_reference_dims)
    tensors = {name: source.float(name).copy() for name in _hf_names(dims)}
    weight_errors = {}
    for pname, value in package_weights(manifest, interp).items():
        info = manifest["weights"][pname]
        rows = slice(*info["rows"]) if info["rows"] else slice(None)
        original = tensors[info["source"]][rows]
        weight_errors[pname] = float(np.linalg.norm(value - original) / max(np.linalg.norm(original), 1e-12))
        tensors[info["source"]][rows] = value
    with quiet_coremltools():
        model = build_transformers_model(source.config, tensors, attn_implementation="eager")
        with torch.no_grad():
            logits = model(torch.from_numpy(tokens[None].astype(np.int64))).logits[0].float().numpy()
    return logits, weight_errors
