"""The ANE probe: the harness's pure parts, the capture parser and `accel probe report`, on recorded fixtures."""

from __future__ import annotations

import hashlib
import json
import statistics
from pathlib import Path

import pytest
from conftest import mutate_json
from test_export_ane import make_llama, one_line_error, run_cli

from accel.converters.coreml.export import (
    ExportSettings,
    export_ane,
    harness_source,
    read_manifest,
    read_package_item,
)
from accel.converters.coreml.placement import PlacementReport
from accel.converters.coreml.probe import harness
from accel.converters.coreml.probe.report import load_capture, measured_bytes, probe_report
from accel.errors import AccelError, FormatError

FIXTURES = Path(__file__).parent / "fixtures" / "probe"


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    """A tiny lut4 package with context 64: what the fixtures were recorded with."""
    root = tmp_path_factory.mktemp("probe")
    pkg = root / "tiny-lut4.mlpackage"
    export_ane(make_llama(root / "m"), pkg, ExportSettings(encoding="lut4", context=64, prefill=8, naive=False))
    return pkg


# ------------------------------------------------------------------------------------------- the harness
def test_harness_ships_inside_the_package_and_imports_without_macos(package):
    assert read_package_item(package, "probe_harness.py") == harness_source().read_bytes()
    assert harness.main(["--steps", "4"]) == 2  # not macOS: a clear refusal, no import of Apple frameworks


def test_harness_finds_its_package_manifest(package):
    manifest, sha = harness.read_package_manifest(package)
    assert manifest == read_manifest(package)
    assert sha == hashlib.sha256(read_package_item(package, "accel-manifest.json")).hexdigest()


@pytest.mark.parametrize("group,name,kind", [
    ("AMC Stats", "ANE0 RD", "read"), ("AMC Stats", "ANE WR", "write"), ("AMC Stats", "ANE1 DCS RD", "read"),
    ("AMC Stats", "ANE Read", "read"), ("AMC Stats", "GFX RD", None), ("AMC Stats", "ANE", None),
    ("PMP", "ANE RD", None), ("AMC Stats", "PLANE RD", None),
])
def test_amc_channels_are_classified_by_name(group, name, kind):
    assert harness.classify_channel(group, name) == kind


def test_pmp_buckets_and_powermetrics_are_parsed():
    assert harness.bucket_bytes_per_second("1-2GB/s") == pytest.approx(1.5e9)
    assert harness.bucket_bytes_per_second("256 - 512 MB/s") == pytest.approx(384e6)
    assert harness.bucket_bytes_per_second(">4GB/s") == pytest.approx(4e9)
    assert harness.bucket_bytes_per_second("IDLE") is None
    est = harness.pmp_bytes([{"name": "ANE BW", "states": [["IDLE", 50], ["1-3GB/s", 50]]},
                             {"name": "GFX BW", "states": [["1-3GB/s", 100]]}], window_seconds=2.0)
    assert est["bytes"] == pytest.approx(2.0 * 2e9 * 0.5) and est["histograms"] == ["ANE BW"]
    assert est["unreadable_states"] == ["ANE BW:IDLE"]
    text = "**** ANE usage ****\nANE Power: 120 mW\n\nANE Power: 80 mW\n"
    assert harness.parse_powermetrics(text) == pytest.approx(100.0)
    assert harness.parse_powermetrics("CPU Power: 3 mW") is None


def test_compute_devices_are_named_by_their_class():
    class MLNeuralEngineComputeDevice:
        pass

    class MLGPUComputeDevice:
        pass

    class MLCPUComputeDevice:
        pass

    assert [harness.device_name(c()) for c in (MLNeuralEngineComputeDevice, MLGPUComputeDevice,
                                                MLCPUComputeDevice)] == ["ANE", "GPU", "CPU"]


def test_summarize_prefers_amc_then_pmp_and_says_which():
    amc = {"window_seconds": 1.0, "channels": [
        {"group": "AMC Stats", "subgroup": "", "name": "ANE RD", "unit": "B", "delta": 10},
        {"group": "AMC Stats", "subgroup": "", "name": "ANE WR", "unit": "B", "delta": 5},
        {"group": "PMP", "subgroup": "", "name": "ANE BW", "unit": "", "states": [["1-3GB/s", 1]]}]}
    out = harness.summarize(amc, amc)
    assert out["source"] == "ioreport-amc" and out["active"]["read_bytes"] == 10 and out["idle"]["write_bytes"] == 5
    pmp = {"window_seconds": 1.0, "channels": [amc["channels"][2]]}
    out = harness.summarize(pmp, pmp)
    assert out["source"] == "ioreport-pmp" and out["active"]["bytes"] == pytest.approx(2e9)
    out = harness.summarize(None, {"window_seconds": 1.0, "channels": [
        {"group": "Energy Model", "subgroup": "", "name": "ANE", "unit": "mJ", "delta": 3}]})
    assert out["source"] == "none" and out["groups_seen"] == ["Energy Model"]
    assert harness.summarize(None, None) == {"source": "none"}


# ------------------------------------------------------------------------------------- captures and report
def test_amc_capture_gives_bytes_per_token_ratios_residency_and_timing(package):
    report = probe_report(FIXTURES / "capture_amc.json", package)
    manifest = read_manifest(package)
    # (1 229 000 + 594 500) active - (200 000 + 100 000) B/s idle x 0.145 s, over 32 steps
    per_token = (1_229_000 + 594_500 - 300_000 * 0.145) / 32
    assert report["measured_bytes_per_token"] == pytest.approx(per_token)
    predicted = manifest["predicted"]["weight_bytes_per_token"]
    assert report["ratio_to_predicted"] == pytest.approx(per_token / predicted)
    assert report["ratio_to_predicted_with_kv"] == pytest.approx(
        per_token / (predicted + manifest["predicted"]["kv_bytes_per_token"]))
    nominal = manifest["dims"]["params"] * 4 / 8
    assert report["ratio_to_nominal"] == pytest.approx(per_token / nominal)
    step_ms = json.loads((FIXTURES / "capture_amc.json").read_text())["timing"]["step_ms"]
    assert report["ms_per_token"] == pytest.approx(statistics.median(step_ms))
    assert report["residency"]["ops"] == pytest.approx(7 / 9)  # the constexpr is storage, not counted
    assert report["sources"] == {"bytes": "ioreport-amc", "power": "ioreport-energy", "placement": "MLComputePlan"}
    assert report["bytes"]["read_bytes"] == 1_229_000 and report["predicted_residency"]["block_ops"] == 1.0


def test_pmp_capture_falls_back_and_records_its_source(package):
    report = probe_report(FIXTURES / "capture_pmp.json", package)
    capture = json.loads((FIXTURES / "capture_pmp.json").read_text())
    active, idle = capture["counters"]["active"]["bytes"], capture["counters"]["idle"]["bytes"]
    assert report["bytes"]["source"] == "ioreport-pmp"
    assert report["measured_bytes_per_token"] == pytest.approx((active - idle * 0.145) / 32)
    assert report["power"]["powermetrics_mw"] == 812.5 and report["sources"]["power"] == "powermetrics"


def test_capture_without_counters_reports_timing_and_says_bytes_are_unavailable(package):
    report = probe_report(FIXTURES / "capture_power_only.json", package)
    assert report["measured_bytes_per_token"] is None and report["ratio_to_predicted"] is None
    assert report["residency"]["ops"] is None and report["residency"]["source"] == "unavailable"
    assert report["ms_per_token"] > 0 and any("IOReport unavailable" in w for w in report["warnings"])


def test_measured_ops_are_matched_to_the_predicted_placement_by_output_name(package, tmp_path):
    """A capture whose MLComputePlan ops carry the package's own output names (as on a Mac)."""
    doc = json.loads(read_package_item(package, "placement.json"))["functions"]["decode"]
    placement = PlacementReport.from_json(doc).op_rows()
    capture = json.loads((FIXTURES / "capture_amc.json").read_text())
    ops = [{"op": f"ios18.{o['op']}", "outputs": [o["output"]], "supported": ["CPU"],
            "device": "CPU" if o["op"] in ("gather", "softmax") else "ANE"} for o in placement]
    capture["compute_plan"]["functions"]["decode"] = ops
    path = tmp_path / "capture.json"
    path.write_text(json.dumps(capture))
    res = probe_report(path, package)["residency"]
    assert res["matched_ops"] == len(placement)
    assert res["block_ops"] < 1.0  # the softmaxes inside the blocks ran on the CPU in this capture
    assert any(m.startswith("softmax: predicted ANE") for m in res["mispredicted"])
    assert 0 < res["prediction_agreement"] < 1


@pytest.mark.parametrize("fixture,message", [("capture_bad_version.json", "newer than this accel reads"),
                                             ("capture_bad_steps.json", "timing.step_ms must hold 32")])
def test_malformed_captures_are_named_errors(fixture, message):
    with pytest.raises(FormatError, match=message):
        load_capture(FIXTURES / fixture)


@pytest.mark.parametrize("mutate,message", [
    (lambda c: c.pop("run"), "run is missing"),
    (lambda c: c["counters"].update(source="magic"), "is not one of"),
    (lambda c: c["counters"]["active"].update(read_bytes=-1), "read_bytes must be a finite non-negative number"),
    (lambda c: c["counters"]["active"].update(write_bytes="many"), "write_bytes is missing or not"),
    (lambda c: c["run"].update(steps=True), "steps is missing or not an integer"),
    (lambda c: c.update(format="something"), "not an accel ANE capture"),
    # found by a fuzz of the recorded captures (2026-12-06): each was a traceback in probe report
    (lambda c: c.update(package=True), "package must be an object"),
    (lambda c: c.update(errors=-1), "errors must be a list"),
    (lambda c: c["compute_plan"]["functions"]["decode"][0].update(outputs={"a": 1}), "outputs must be a list"),
    # found by a black-box audit (2026-12-06, later): OverflowError tracebacks, or nonsense figures with exit 0
    (lambda c: c["counters"]["active"].update(read_bytes=10**400), "active.read_bytes must be a finite"),
    (lambda c: c["counters"]["active"].update(read_bytes=float("nan")), "active.read_bytes must be a finite"),
    (lambda c: c["counters"]["idle"].update(read_bytes=-10**12), "idle.read_bytes must be a finite"),
    (lambda c: c["counters"]["idle"].update(window_seconds=0), "idle.window_seconds must be a finite number above"),
    (lambda c: c["counters"]["active"].update(window_seconds=-1.0), "active.window_seconds must be a finite"),
    (lambda c: c["timing"].update(step_ms=[10**400] * len(c["timing"]["step_ms"])), "finite non-negative numbers"),
])
def test_capture_fields_are_validated(tmp_path, mutate, message):
    capture = json.loads((FIXTURES / "capture_amc.json").read_text())
    mutate(capture)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(capture))
    with pytest.raises(FormatError, match=message):
        load_capture(path)


def test_idle_baseline_never_makes_bytes_negative(tmp_path):
    capture = json.loads((FIXTURES / "capture_amc.json").read_text())
    capture["counters"]["idle"].update(read_bytes=10**12)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(capture))
    assert measured_bytes(load_capture(path))[0] == 0.0


def test_a_capture_of_another_package_is_refused(package, tmp_path):
    capture = json.loads((FIXTURES / "capture_amc.json").read_text())
    capture["package"]["encoding"] = "int8"
    path = tmp_path / "c.json"
    path.write_text(json.dumps(capture))
    with pytest.raises(AccelError, match="encoding 'int8'"):
        probe_report(path, package)


def test_cli_probe_report(capsys, package, tmp_path):
    code, out, err = run_cli(capsys, "probe", "report", FIXTURES / "capture_amc.json", "--package", package, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert {"measured_bytes_per_token", "ratio_to_predicted", "ratio_to_nominal", "residency", "ms_per_token",
            "sources"} <= set(doc)
    code, out, _ = run_cli(capsys, "probe", "report", FIXTURES / "capture_pmp.json", "--package", package)
    assert code == 0 and "bytes from ioreport-pmp" in out and "ms per token" in out
    code, _, err = run_cli(capsys, "probe", "report", FIXTURES / "capture_bad_version.json", "--package", package)
    one_line_error(code, err, "newer than this accel reads")
    code, _, err = run_cli(capsys, "probe", "report", tmp_path / "missing.json", "--package", package)
    one_line_error(code, err, "no such capture file")
    code, _, err = run_cli(capsys, "probe", "report", FIXTURES / "capture_amc.json", "--package", tmp_path)
    one_line_error(code, err, "Manifest.json")


def test_mutated_captures_are_reported_or_refused_in_one_line(capsys, package, tmp_path):
    """Seeded structural mutations of the recorded captures (a field deleted, or set to a value of another type):
    each gives a report or a one-line error. A fuzz like this found 18 tracebacks in 300 mutations (2026-12-06)."""
    import copy
    import random

    values = [None, True, 0, -1, 1.5, "x", [], {}, [1, 2], {"a": 1}, 10**30]
    captures = [json.loads((FIXTURES / n).read_text())
                for n in ("capture_amc.json", "capture_pmp.json", "capture_power_only.json")]
    pick = random.Random(0)
    path = tmp_path / "c.json"
    for _ in range(150):
        doc = copy.deepcopy(pick.choice(captures))
        at = mutate_json(doc, pick, values, 0.3)
        path.write_text(json.dumps(doc))
        code, _, err = run_cli(capsys, "probe", "report", path, "--package", package)
        assert code in (0, 2) and "Traceback" not in err, (at, err)
        if code == 2:
            assert len([line for line in err.strip().splitlines() if line.strip()]) == 1, (at, err)


def test_the_cli_gives_its_warnings_on_stderr_as_every_command_does(package, capsys):
    """`probe report` printed them on stdout as 'note:' (and not at all under --json)."""
    from accel.cli.main import main

    for extra in ([], ["--json"]):
        assert main(["probe", "report", str(FIXTURES / "capture_power_only.json"), "--package", str(package),
                     *extra]) == 0
        out, err = capsys.readouterr()
        assert "warning: " in err and "IOReport unavailable" in err and "IOReport unavailable" not in out.split("{")[0]
