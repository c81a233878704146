"""`accel probe report CAPTURE --package PKG`: a capture from the macOS harness, read against the package.

Measured ANE bytes per decode token (active-window counter bytes, minus the idle baseline scaled to the active
window, over the steps), its ratio to the package's predicted bytes and to the nominal encoding width, residency
from MLComputePlan (and how often accel's placement rules predicted the same device), and ms per token.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accel.converters.coreml.export import PLACEMENT_ITEM, read_manifest, read_package_item
from accel.converters.coreml.placement import ANE, PlacementReport
from accel.converters.coreml.probe.harness import CAPTURE_FORMAT, CAPTURE_VERSION
from accel.errors import AccelError, FormatError
from accel.formats import jsontext

BYTE_SOURCES = ("ioreport-amc", "ioreport-pmp", "none")
# Op kinds MLComputePlan lists that are storage, not computation (as in placement.STORAGE_OPS).
_STORAGE_PREFIXES = ("const", "constexpr_")


@dataclass
class Capture:
    doc: dict[str, Any]

    @property
    def steps(self) -> int:
        return int(self.doc["run"]["steps"])

    @property
    def byte_source(self) -> str:
        return self.doc["counters"]["source"]


def load_capture(path: Path) -> Capture:
    """Read and validate a capture file; every problem is a one-line FormatError naming the field."""
    path = Path(path)
    try:
        doc = jsontext.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AccelError(f"{path}: no such capture file") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise FormatError(f"{path}: not a JSON capture ({type(exc).__name__})") from None
    if not isinstance(doc, dict) or doc.get("format") != CAPTURE_FORMAT:
        raise FormatError(f"{path}: not an accel ANE capture (format is not {CAPTURE_FORMAT!r})")
    if not isinstance(doc.get("version"), int) or doc["version"] > CAPTURE_VERSION:
        raise FormatError(f"{path}: capture version {doc.get('version')!r} is newer than this accel reads")

    def need(obj: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
        if not isinstance(obj, dict) or key not in obj or not isinstance(obj[key], kind) or \
                isinstance(obj[key], bool) and kind is not bool:
            raise FormatError(f"{path}: capture field {where}{key} is missing or not {_kind_name(kind)}")
        return obj[key]

    run = need(doc, "run", dict, "")
    steps = need(run, "steps", int, "run.")
    if steps < 1:
        raise FormatError(f"{path}: capture field run.steps must be at least 1")
    timing = need(doc, "timing", dict, "")
    step_ms = need(timing, "step_ms", list, "timing.")
    if len(step_ms) != steps or not all(_measure(v) for v in step_ms):
        raise FormatError(f"{path}: timing.step_ms must hold {steps} finite non-negative numbers")
    counters = need(doc, "counters", dict, "")
    source = need(counters, "source", str, "counters.")
    if source not in BYTE_SOURCES:
        raise FormatError(f"{path}: counters.source {source!r} is not one of {', '.join(BYTE_SOURCES)}")
    if source != "none":
        keys = ("read_bytes", "write_bytes") if source == "ioreport-amc" else ("bytes",)
        windows = [("active", need(counters, "active", dict, "counters."))]
        if counters.get("idle") is not None:
            windows.append(("idle", counters["idle"]))
        for name, window in windows:
            if not _measure(need(window, "window_seconds", (int, float), f"counters.{name}."), positive=True):
                raise FormatError(f"{path}: counters.{name}.window_seconds must be a finite number above 0")
            for key in keys:
                if not _measure(need(window, key, (int, float), f"counters.{name}.")):
                    raise FormatError(f"{path}: counters.{name}.{key} must be a finite non-negative number")
    plan = doc.get("compute_plan", {"source": "unavailable", "functions": {}})
    if not isinstance(plan, dict) or not isinstance(plan.get("functions", {}), dict):
        raise FormatError(f"{path}: compute_plan.functions must be an object")
    for fname, ops in plan.get("functions", {}).items():
        if not isinstance(ops, list) or not all(isinstance(o, dict) and isinstance(o.get("op"), str)
                                                for o in ops):
            raise FormatError(f"{path}: compute_plan.functions.{fname} must be a list of ops with an 'op' name")
        if not all(isinstance(o.get("outputs", []), list) and all(isinstance(v, str) for v in o.get("outputs", []))
                   for o in ops):
            raise FormatError(f"{path}: compute_plan.functions.{fname}: an op's outputs must be a list of names")
    package = doc.get("package", {})
    if not isinstance(package, dict) or not isinstance(package.get("manifest_sha256", ""), (str, type(None))):
        raise FormatError(f"{path}: capture field package must be an object (manifest_sha256 a string)")
    if not isinstance(doc.get("errors", []), list):
        raise FormatError(f"{path}: capture field errors must be a list")
    return Capture(doc)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {int: "an integer", float: "a number", str: "a string", list: "a list", dict: "an object"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _measure(value: Any, positive: bool = False) -> bool:
    """A number a capture can hold: finite, not negative (above 0 if `positive`), below 2^63 (bytes, seconds, ms)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    return (value > 0 if positive else value >= 0) and value < 2**63  # NaN fails both, +inf the second


def measured_bytes(capture: Capture) -> tuple[float | None, dict[str, Any]]:
    """ANE bytes per decode token, idle baseline removed, and how it was obtained."""
    counters = capture.doc["counters"]
    source = counters["source"]
    if source == "none":
        return None, {"source": "none"}
    active, idle = counters["active"], counters.get("idle")

    def total(window: dict[str, Any]) -> float:
        if source == "ioreport-amc":
            return float(window["read_bytes"]) + float(window["write_bytes"])
        return float(window["bytes"])

    raw = total(active)
    baseline = 0.0
    if idle and idle.get("window_seconds"):
        baseline = total(idle) * float(active["window_seconds"]) / float(idle["window_seconds"])
    net = max(raw - baseline, 0.0)
    detail = {"source": source, "active_bytes": raw, "idle_baseline_bytes": baseline,
              "window_seconds": float(active["window_seconds"])}
    if source == "ioreport-amc":
        detail["read_bytes"] = float(active["read_bytes"])
        detail["write_bytes"] = float(active["write_bytes"])
    return net / capture.steps, detail


def measured_residency(capture: Capture, predicted: PlacementReport | None, function: str = "decode"
                       ) -> dict[str, Any]:
    """Share of compute ops MLComputePlan puts on the ANE; inside blocks and agreement with the rules where the
    ops can be matched to the predicted report by output name."""
    plan = capture.doc.get("compute_plan") or {}
    ops = [o for o in plan.get("functions", {}).get(function, [])
           if not o["op"].split(".")[-1].startswith(_STORAGE_PREFIXES)]
    if not ops:
        return {"source": plan.get("source", "unavailable"), "reason": plan.get("reason"), "ops": None}
    on_ane = [o.get("device") == ANE for o in ops]
    out: dict[str, Any] = {"source": plan.get("source"), "ops": sum(on_ane) / len(ops), "op_count": len(ops)}
    if predicted is not None:
        by_output = {p.output: p for p in predicted.ops if p.output}
        matched = [(o, by_output[o["outputs"][0]]) for o in ops if o.get("outputs") and o["outputs"][0] in by_output]
        if matched:
            block = [(o, p) for o, p in matched if p.in_block]
            out["matched_ops"] = len(matched)
            out["block_ops"] = (sum(o.get("device") == ANE for o, _ in block) / len(block)) if block else None
            out["prediction_agreement"] = sum((o.get("device") == ANE) == (p.device == ANE)
                                              for o, p in matched) / len(matched)
            out["mispredicted"] = sorted({f"{p.op_type}: predicted {p.device} ({p.rule}), ran on {o.get('device')}"
                                          for o, p in matched if (o.get("device") == ANE) != (p.device == ANE)})
    return out


def probe_report(capture_path: Path, package: Path) -> dict[str, Any]:
    capture = load_capture(capture_path)
    manifest = read_manifest(package)
    warnings = []
    cap_pkg = capture.doc.get("package", {})
    for key in ("encoding", "context"):
        if key in cap_pkg and cap_pkg[key] != manifest[key]:
            raise AccelError(f"the capture was recorded with {key} {cap_pkg[key]!r}, the package has "
                             f"{manifest[key]!r}: not the same package")
    import hashlib

    from accel.converters.coreml.export import MANIFEST_ITEM

    sha = hashlib.sha256(read_package_item(package, MANIFEST_ITEM)).hexdigest()
    if cap_pkg.get("manifest_sha256") not in (None, sha):
        warnings.append("the capture's manifest hash differs from this package's (re-exported since?)")
    try:
        placement_doc = jsontext.loads(read_package_item(package, PLACEMENT_ITEM))
        predicted = PlacementReport.from_json(placement_doc["functions"]["decode"])
    except (FormatError, ValueError, KeyError, TypeError):
        predicted = None
        warnings.append("the package has no readable placement report; block residency is not matched")

    per_token, detail = measured_bytes(capture)
    predicted_weights = int(manifest["predicted"]["weight_bytes_per_token"])
    predicted_kv = int(manifest["predicted"]["kv_bytes_per_token"])
    params = int(manifest["dims"]["params"])
    nominal = params * int(manifest["nominal_bits"]) / 8
    step_ms = [float(v) for v in capture.doc["timing"]["step_ms"]]
    report = {
        "capture": str(capture_path), "package": str(package), "encoding": manifest["encoding"],
        "steps": capture.steps,
        "measured_bytes_per_token": per_token,
        "predicted_weight_bytes_per_token": predicted_weights,
        "predicted_kv_bytes_per_token": predicted_kv,
        "ratio_to_predicted": per_token / predicted_weights if per_token is not None else None,
        "ratio_to_predicted_with_kv": per_token / (predicted_weights + predicted_kv) if per_token is not None
        else None,
        "nominal_bytes_per_token": nominal,
        "ratio_to_nominal": per_token / nominal if per_token is not None else None,
        "bytes": detail,
        "ms_per_token": statistics.median(step_ms),
        "ms_per_token_mean": statistics.fmean(step_ms),
        "residency": measured_residency(capture, predicted),
        "predicted_residency": predicted.residency() if predicted else None,
        "power": capture.doc.get("power"),
        "sources": capture.doc.get("sources", {"bytes": capture.byte_source}),
        "harness": capture.doc.get("harness"),
        "warnings": warnings + [str(e) for e in capture.doc.get("errors", [])],
    }
    return report
