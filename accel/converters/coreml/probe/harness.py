"""accel ANE probe harness: run a package's decode function on the Neural Engine and record what streams.

Shipped inside every package accel exports (Data/com.github.accel/probe_harness.py). On a Mac with Apple
silicon, with coremltools installed:

    python3 probe_harness.py PACKAGE.mlpackage --steps 64 --out capture.json

It compiles and loads the model with compute units CPU_AND_NE, runs decode steps, samples the memory-controller
counters around them (IOReport group "AMC Stats", the ANE read/write byte channels; else the "PMP" bandwidth
histograms; ANE power from IOReport "Energy Model" and `powermetrics` when run as root), records MLComputePlan's
device for every op, and writes one JSON capture (format "accel-ane-capture", documented in docs/ane.md).
Each figure says which source it came from. Then, on any machine: `accel probe report capture.json --package PKG`.

Only the standard library and coremltools. The platform code is the `MacCounters` class and `compute_plan`;
everything else is plain Python that accel's tests run on Linux.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

CAPTURE_FORMAT = "accel-ane-capture"
CAPTURE_VERSION = 1
HARNESS_VERSION = 1
MANIFEST_ITEM = "accel-manifest.json"
ACCEL_AUTHOR = "com.github.accel"

# Channels counted as ANE traffic: (group, name pattern) -> direction; names differ between chips
# ("ANE RD", "ANE0 DCS WR", "ANE Read"...), so they are matched, and the matched names are recorded.
AMC_GROUP = "AMC Stats"
PMP_GROUP = "PMP"
ENERGY_GROUP = "Energy Model"
_ANE = re.compile(r"\bANE\d*\b|^ANE", re.IGNORECASE)
_READ = re.compile(r"\b(RD|READ)\b", re.IGNORECASE)
_WRITE = re.compile(r"\b(WR|WRITE)\b", re.IGNORECASE)
_BANDWIDTH = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*(K|M|G)?B/?s", re.IGNORECASE)


# --------------------------------------------------------------------------------------- pure helpers (tested)
def classify_channel(group: str, name: str) -> str | None:
    """'read' / 'write' for an ANE byte counter of AMC Stats, None for anything else."""
    if group != AMC_GROUP or not _ANE.search(name):
        return None
    if _READ.search(name):
        return "read"
    if _WRITE.search(name):
        return "write"
    return None


def amc_bytes(channels: list[dict]) -> dict:
    """Sum ANE read and write bytes over AMC channel deltas [{group, subgroup, name, unit, delta}]."""
    out = {"read_bytes": 0, "write_bytes": 0, "channels": []}
    for ch in channels:
        kind = classify_channel(ch.get("group", ""), ch.get("name", ""))
        if kind is None or ch.get("delta") is None:
            continue
        out[f"{kind}_bytes"] += int(ch["delta"])
        out["channels"].append(ch)
    return out


def bucket_bytes_per_second(state_name: str) -> float | None:
    """Midpoint of a bandwidth histogram bucket named like '1-2 GB/s' or '>16GB/s' (None if unparsable)."""
    scale = {None: 1.0, "K": 1e3, "M": 1e6, "G": 1e9}
    hits = _BANDWIDTH.findall(state_name)
    numbers = [float(v) for v in re.findall(r"[0-9]+(?:\.[0-9]+)?", state_name)]
    if not hits or not numbers:
        return None
    unit = scale[hits[-1][1].upper() or None]
    return (sum(numbers[:2]) / len(numbers[:2])) * unit


def pmp_bytes(histograms: list[dict], window_seconds: float) -> dict:
    """Estimate ANE bytes from PMP bandwidth histograms [{name, states: [[state, residency], ...]}]: the window
    times the residency-weighted bucket midpoints. Buckets without a readable bandwidth are skipped (and named)."""
    total, unreadable, used = 0.0, [], []
    for h in histograms:
        if not _ANE.search(h.get("name", "")):
            continue
        residencies = [float(r) for _, r in h["states"]]
        whole = sum(residencies)
        if whole <= 0:
            continue
        used.append(h["name"])
        for (state, residency) in h["states"]:
            rate = bucket_bytes_per_second(state)
            if rate is None:
                unreadable.append(f"{h['name']}:{state}")
                continue
            total += window_seconds * rate * float(residency) / whole
    return {"bytes": total, "histograms": used, "unreadable_states": unreadable}


def parse_powermetrics(text: str) -> float | None:
    """The mean 'ANE Power: N mW' of powermetrics output, in mW."""
    values = [float(v) for v in re.findall(r"ANE Power:\s*([0-9.]+)\s*mW", text)]
    return sum(values) / len(values) if values else None


def device_name(compute_device: object) -> str:
    """MLComputePlan device objects -> 'ANE' / 'GPU' / 'CPU'."""
    name = type(compute_device).__name__
    if "NeuralEngine" in name:
        return "ANE"
    if "GPU" in name:
        return "GPU"
    if "CPU" in name:
        return "CPU"
    return name or "unknown"


def read_package_manifest(package: Path) -> tuple[dict, str]:
    """accel's manifest item of the package, and its sha256."""
    manifest = json.loads((package / "Manifest.json").read_text())
    for entry in manifest["itemInfoEntries"].values():
        if entry.get("author") == ACCEL_AUTHOR and entry.get("name") == MANIFEST_ITEM:
            data = (package / "Data" / entry["path"]).read_bytes()
            return json.loads(data), hashlib.sha256(data).hexdigest()
    raise SystemExit(f"{package}: no {MANIFEST_ITEM}: not a package written by accel export-ane")


# ------------------------------------------------------------------------------------- platform code (macOS)
class MacCounters:
    """IOReport through ctypes: subscribe to AMC Stats, PMP and Energy Model; sample; delta; read channels."""

    def __init__(self) -> None:
        import ctypes
        import ctypes.util

        c = ctypes
        self.c = c
        self.cf = c.CDLL(c.util.find_library("CoreFoundation"))
        self.ior = c.CDLL("/usr/lib/libIOReport.dylib")
        vp, i64, i32 = c.c_void_p, c.c_int64, c.c_int32
        sig = {
            (self.cf, "CFStringCreateWithCString"): (vp, [vp, c.c_char_p, c.c_uint32]),
            (self.cf, "CFStringGetCString"): (c.c_bool, [vp, c.c_char_p, c.c_long, c.c_uint32]),
            (self.cf, "CFDictionaryGetValue"): (vp, [vp, vp]),
            (self.cf, "CFDictionaryCreateMutableCopy"): (vp, [vp, c.c_long, vp]),
            (self.cf, "CFArrayGetCount"): (c.c_long, [vp]),
            (self.cf, "CFArrayGetValueAtIndex"): (vp, [vp, c.c_long]),
            (self.cf, "CFRelease"): (None, [vp]),
            (self.ior, "IOReportCopyChannelsInGroup"): (vp, [vp, vp, c.c_uint64, c.c_uint64, c.c_uint64]),
            (self.ior, "IOReportMergeChannels"): (None, [vp, vp, vp]),
            (self.ior, "IOReportCreateSubscription"): (vp, [vp, vp, c.POINTER(vp), c.c_uint64, vp]),
            (self.ior, "IOReportCreateSamples"): (vp, [vp, vp, vp]),
            (self.ior, "IOReportCreateSamplesDelta"): (vp, [vp, vp, vp]),
            (self.ior, "IOReportChannelGetGroup"): (vp, [vp]),
            (self.ior, "IOReportChannelGetSubGroup"): (vp, [vp]),
            (self.ior, "IOReportChannelGetChannelName"): (vp, [vp]),
            (self.ior, "IOReportChannelGetUnitLabel"): (vp, [vp]),
            (self.ior, "IOReportChannelGetFormat"): (i32, [vp]),
            (self.ior, "IOReportSimpleGetIntegerValue"): (i64, [vp, i32]),
            (self.ior, "IOReportStateGetCount"): (i32, [vp]),
            (self.ior, "IOReportStateGetNameForIndex"): (vp, [vp, i32]),
            (self.ior, "IOReportStateGetResidency"): (i64, [vp, i32]),
        }
        for (lib, name), (restype, argtypes) in sig.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        channels = None
        self.groups = []
        for group in (AMC_GROUP, PMP_GROUP, ENERGY_GROUP):
            found = self.ior.IOReportCopyChannelsInGroup(self._cfstr(group), None, 0, 0, 0)
            if not found:
                continue
            self.groups.append(group)
            if channels is None:
                channels = self.cf.CFDictionaryCreateMutableCopy(None, 0, found)
            else:
                self.ior.IOReportMergeChannels(channels, found, None)
        if channels is None:
            raise OSError("IOReport offers none of the groups AMC Stats, PMP, Energy Model")
        self.subscribed = vp()
        self.subscription = self.ior.IOReportCreateSubscription(None, channels, c.byref(self.subscribed), 0, None)
        if not self.subscription:
            raise OSError("IOReportCreateSubscription failed")

    def _cfstr(self, text: str):
        return self.cf.CFStringCreateWithCString(None, text.encode(), 0x08000100)

    def _str(self, ref) -> str:
        if not ref:
            return ""
        buf = self.c.create_string_buffer(512)
        return buf.value.decode() if self.cf.CFStringGetCString(ref, buf, 512, 0x08000100) else ""

    def sample(self):
        return self.ior.IOReportCreateSamples(self.subscription, self.subscribed, None)

    def delta(self, before, after) -> list[dict]:
        """Every channel of the delta between two samples: simple ones with `delta`, state ones with `states`."""
        d = self.ior.IOReportCreateSamplesDelta(before, after, None)
        items = self.cf.CFDictionaryGetValue(d, self._cfstr("IOReportChannels"))
        out = []
        for i in range(self.cf.CFArrayGetCount(items) if items else 0):
            ch = self.cf.CFArrayGetValueAtIndex(items, i)
            rec = {"group": self._str(self.ior.IOReportChannelGetGroup(ch)),
                   "subgroup": self._str(self.ior.IOReportChannelGetSubGroup(ch)),
                   "name": self._str(self.ior.IOReportChannelGetChannelName(ch)),
                   "unit": self._str(self.ior.IOReportChannelGetUnitLabel(ch))}
            fmt = self.ior.IOReportChannelGetFormat(ch)
            if fmt == 1:
                rec["delta"] = int(self.ior.IOReportSimpleGetIntegerValue(ch, 0))
            elif fmt == 2:
                rec["states"] = [[self._str(self.ior.IOReportStateGetNameForIndex(ch, j)),
                                  int(self.ior.IOReportStateGetResidency(ch, j))]
                                 for j in range(self.ior.IOReportStateGetCount(ch))]
            else:
                continue
            out.append(rec)
        self.cf.CFRelease(d)
        return out


def compute_plan(compiled_path: str, compute_units) -> dict:
    """MLComputePlan's preferred and supported devices per op, per function (macOS 14.4+, coremltools 8+)."""
    try:
        from coremltools.models.compute_plan import MLComputePlan
    except ImportError as exc:
        return {"source": "unavailable", "reason": f"coremltools has no MLComputePlan ({exc})", "functions": {}}
    try:
        plan = MLComputePlan.load_from_path(path=compiled_path, compute_units=compute_units)
        program = plan.model_structure.program
    except Exception as exc:  # noqa: BLE001 - an OS without the API says so in the capture
        return {"source": "unavailable", "reason": f"{type(exc).__name__}: {exc}", "functions": {}}
    functions = {}
    for fname, function in program.functions.items():
        ops = []
        for op in function.block.operations:
            usage = plan.get_compute_device_usage_for_mlprogram_operation(op)
            cost = plan.get_estimated_cost_for_mlprogram_operation(op)
            ops.append({
                "op": op.operator_name,
                "outputs": [o.name for o in op.outputs],
                "device": device_name(usage.preferred_compute_device) if usage else None,
                "supported": sorted({device_name(d) for d in usage.supported_compute_devices}) if usage else [],
                "cost": cost.weight if cost else None,
            })
        functions[fname] = ops
    return {"source": "MLComputePlan", "functions": functions}


def powermetrics_ane(seconds: float) -> tuple[float | None, str]:
    """ANE power from `powermetrics` over `seconds` (needs root)."""
    if os.geteuid() != 0:
        return None, "powermetrics needs root (run the harness with sudo for this fallback)"
    try:
        out = subprocess.run(["powermetrics", "--samplers", "ane_power", "-n", "1", "-i",
                              str(max(100, int(seconds * 1000)))], capture_output=True, text=True,
                             timeout=seconds + 30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"powermetrics failed: {exc}"
    value = parse_powermetrics(out.stdout)
    return value, "" if value is not None else "powermetrics printed no 'ANE Power' line"


# ------------------------------------------------------------------------------------------------------ run
def run(package: Path, steps: int, warmup: int, idle_seconds: float) -> dict:
    import coremltools as ct
    import numpy as np

    manifest, manifest_sha = read_package_manifest(package)
    context = int(manifest["context"])
    steps = min(steps, context - warmup)
    errors: list[str] = []
    capture = {
        "format": CAPTURE_FORMAT, "version": CAPTURE_VERSION,
        "harness": {"version": HARNESS_VERSION, "python": platform.python_version(), "coremltools": ct.__version__,
                    "macos": platform.mac_ver()[0], "machine": platform.machine(), "chip": _chip()},
        "package": {"path": str(package), "manifest_sha256": manifest_sha, "encoding": manifest["encoding"],
                    "context": context},
        "errors": errors,
    }
    units = ct.ComputeUnit.CPU_AND_NE
    t = time.perf_counter()
    model = ct.models.MLModel(str(package), compute_units=units, function_name="decode")
    load_seconds = time.perf_counter() - t
    state = model.make_state()
    vocab = int(manifest["dims"]["vocab"])
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, size=warmup + steps)

    def step(pos: int) -> float:
        begin = time.perf_counter()
        model.predict({"input_ids": np.array([[tokens[pos]]], dtype=np.int32),
                       "position_ids": np.array([[pos]], dtype=np.int32)}, state=state)
        return (time.perf_counter() - begin) * 1000.0

    for pos in range(warmup):
        step(pos)

    try:
        counters = MacCounters()
    except OSError as exc:
        counters = None
        errors.append(f"IOReport unavailable: {exc}")

    idle = active = None
    if counters is not None:
        a = counters.sample()
        time.sleep(idle_seconds)
        b = counters.sample()
        idle = {"window_seconds": idle_seconds, "channels": counters.delta(a, b)}
    t0 = time.perf_counter()
    a = counters.sample() if counters else None
    step_ms = [step(warmup + i) for i in range(steps)]
    b = counters.sample() if counters else None
    window = time.perf_counter() - t0
    if counters is not None:
        active = {"window_seconds": window, "channels": counters.delta(a, b)}
    power_mw, power_note = powermetrics_ane(min(window, 2.0))
    if power_note:
        errors.append(power_note)

    capture["run"] = {"function": "decode", "compute_units": "CPU_AND_NE", "warmup_steps": warmup, "steps": steps,
                      "load_seconds": load_seconds, "first_position": warmup}
    capture["timing"] = {"step_ms": step_ms, "window_seconds": window}
    capture["counters"] = summarize(idle, active)
    capture["power"] = {"powermetrics_mw": power_mw,
                        "energy_model": _energy(active["channels"]) if active else None}
    compiled = model.get_compiled_model_path() if hasattr(model, "get_compiled_model_path") else None
    capture["compute_plan"] = compute_plan(compiled, units) if compiled else {
        "source": "unavailable", "reason": "this coremltools cannot give the compiled model path", "functions": {}}
    capture["sources"] = {"bytes": capture["counters"]["source"],
                          "power": "powermetrics" if power_mw is not None else (
                              "ioreport-energy" if capture["power"]["energy_model"] else "none"),
                          "placement": capture["compute_plan"]["source"]}
    return capture


def summarize(idle: dict | None, active: dict | None) -> dict:
    """ANE bytes of the idle and active windows, from AMC channels if any, else PMP histograms."""
    if active is None:
        return {"source": "none"}
    out = {"idle": {"window_seconds": idle["window_seconds"]} if idle else None,
           "active": {"window_seconds": active["window_seconds"]}}
    amc = amc_bytes(active["channels"])
    if amc["channels"]:
        out["source"] = "ioreport-amc"
        for key, window in (("active", active), ("idle", idle)):
            if window is None:
                continue
            summed = amc_bytes(window["channels"])
            out[key].update(read_bytes=summed["read_bytes"], write_bytes=summed["write_bytes"])
        out["channels"] = amc["channels"]
        return out
    hist = [{"name": ch["name"], "states": ch["states"]} for ch in active["channels"]
            if ch["group"] == PMP_GROUP and "states" in ch]
    pmp = pmp_bytes(hist, active["window_seconds"])
    if pmp["histograms"]:
        out["source"] = "ioreport-pmp"
        out["active"].update(bytes=pmp["bytes"], histograms=hist)
        out["unreadable_states"] = pmp["unreadable_states"]
        if idle is not None:
            idle_hist = [{"name": ch["name"], "states": ch["states"]} for ch in idle["channels"]
                         if ch["group"] == PMP_GROUP and "states" in ch]
            out["idle"].update(bytes=pmp_bytes(idle_hist, idle["window_seconds"])["bytes"])
        return out
    out["source"] = "none"
    out["groups_seen"] = sorted({ch["group"] for ch in active["channels"]})
    return out


def _energy(channels: list[dict]) -> dict | None:
    for ch in channels:
        if ch["group"] == ENERGY_GROUP and _ANE.search(ch["name"]) and "delta" in ch:
            return {"name": ch["name"], "unit": ch["unit"], "delta": ch["delta"]}
    return None


def _chip() -> str:
    try:
        return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                              timeout=5, check=False).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Record ANE bytes, timing and placement for an accel package.")
    parser.add_argument("package", type=Path, nargs="?", default=Path(__file__).resolve().parents[2],
                        help="the .mlpackage (default: the package this harness sits in)")
    parser.add_argument("--steps", type=int, default=64, help="decode steps measured")
    parser.add_argument("--warmup", type=int, default=8, help="decode steps run before measuring")
    parser.add_argument("--idle", type=float, default=1.0, help="seconds of idle baseline sampled first")
    parser.add_argument("--out", type=Path, default=Path("capture.json"), help="capture file to write")
    args = parser.parse_args(argv)
    if sys.platform != "darwin":
        print("the probe harness runs on macOS with Apple silicon", file=sys.stderr)
        return 2
    capture = run(args.package.resolve(), args.steps, args.warmup, args.idle)
    args.out.write_text(json.dumps(capture, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out}: bytes from {capture['sources']['bytes']}, power from {capture['sources']['power']}, "
          f"placement from {capture['sources']['placement']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
