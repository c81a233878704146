"""SemKV end to end on the tiny model: calibrate --for kv, quantize --kv semkv, eval; baselines; bad input."""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest
import torch

from accel.cli.main import main
from accel.errors import AccelError, FormatError
from accel.eval.evaluate import EvalSettings, evaluate
from accel.formats.artifact import Artifact
from accel.quantize.maps import StoredMap, parse_spec, read_maps
from accel.quantize.pipeline import QuantizeSettings, quantize_model
from accel.quantize.semkv import check_kv_map, make_arrays, make_params

INDICATORS = {"key_norm", "value_norm", "acc_attention", "obs_attention"}


@pytest.fixture(scope="module")
def kv_calib(tiny_llama, text_file, tmp_path_factory):
    """`accel calibrate --for kv --json` on the tiny model (the CLI over the library call)."""
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("calib") / "c"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(["calibrate", str(tiny_llama), "--for", "kv", "--data", str(text_file), "--out", str(out),
                     "--samples", "4", "--seq-len", "40", "--json"])
    assert code == 0
    return out, json.loads(stdout.getvalue().strip().splitlines()[-1])


def test_cli_quantize_and_eval_with_a_semkv_map(kv_calib, tiny_llama, tmp_path, text_file, capsys):
    out = tmp_path / "d"
    code = main(["quantize", str(tiny_llama), "--kv", "semkv:affine:5/6@0.5", "--calib", str(kv_calib[0]),
                 "--out", str(out), "--json"])
    assert code == 0
    q = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert q["maps"] == {"kv": "semkv"} and q["out"] == str(out)
    code = main(["eval", str(out), "--data", str(text_file), "--windows", "1", "--seq-len", "24", "--json"])
    assert code == 0
    ev = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"ppl", "nll", "windows", "tokens", "kv_bytes_per_token", "kv_fp16_bytes_per_token"} <= set(ev)
    code = main(["eval", str(out), "--data", str(text_file), "--windows", "1", "--seq-len", "24"])
    assert code == 0 and "bytes per token" in capsys.readouterr().out
    code = main(["quantize", str(tiny_llama), "--kv", "semkv:affine:5/6@0.5", "--out", str(tmp_path / "e")])
    err = capsys.readouterr().err
    assert code == 2 and "needs --calib" in err and "Traceback" not in err


def test_calibration_writes_the_sweep_cliff_indicators_and_plot(kv_calib):
    out, report = kv_calib
    kv = report["kv"]
    for name in ("report.json", "sweep.md", "sweep.png", "model.safetensors"):
        assert (out / "kv" / name).is_file(), name
    assert (out / "kv" / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    full = json.loads((out / "kv" / "report.json").read_text())
    assert full["margin"] == kv["margin"] == 0.01
    for base in ("affine", "turbo"):
        rows = [r for r in full["sweep"] if r["base"] == base]
        assert {r["levels"][0] for r in rows} >= set(range(3, 17))
        for r in rows:
            assert r["ci"][0] <= r["delta_nll"] <= r["ci"][1] and len(r["window_delta_nll"]) == 4
            assert r["passes"] == (-0.01 <= r["ci"][0] and r["ci"][1] <= 0.01)
            assert r["bytes_per_token"] > 0 and r["code_bits"] == pytest.approx(
                {3: 1.6, 4: 2.0, 5: 7 / 3, 16: 4.0}.get(r["levels"][0], r["code_bits"]))
        cliff = full["cliff"][base]
        if cliff is not None:  # the cliff passes, and so does everything above it
            assert all(r["passes"] for r in rows if r["levels"][0] >= cliff)
    stab = full["stability"]["indicators"]
    assert INDICATORS <= set(stab)
    for name in INDICATORS:
        assert -1 <= stab[name]["profile_spearman"] <= 1 and 0 <= stab[name]["fraction_transfer_error"] <= 1
    assert "key_norm~acc_attention" in full["stability"]["agreement_top25_jaccard"]
    assert full["runtime_indicator"] in ("key_norm", "value_norm")
    assert "| affine-3 |" in (out / "kv" / "sweep.md").read_text()
    for base in ("affine", "turbo"):  # the sweep runs with a sink token and pre-RoPE keys
        assert full["options"][base]["sink"] == 1 and full["options"][base]["pre_rope"] == 1
    assert full["smoothed"] == {"affine": False, "turbo": True}
    manifest = json.loads((out / "calibration.json").read_text())
    assert manifest["for"] == ["kv"] and manifest["reports"]["kv"]["cliff"] == full["cliff"]


def test_semkv_map_round_trips_and_eval_reports_kv_bytes(kv_calib, tiny_llama, tmp_path, text_file):
    calib, _ = kv_calib
    out = tmp_path / "d"
    q = quantize_model(tiny_llama, out, QuantizeSettings(kv="semkv:turbo:3/4@0.25", calib=str(calib), seed=7))
    assert q["maps"] == {"kv": "semkv"}
    stored = read_maps(Artifact(out))["kv"]
    p = stored.params
    assert (p["base"], p["levels"], p["frac"], p["seed"]) == ("turbo", [3, 4], 0.25, 7)
    assert p["indicator"] in ("key_norm", "value_norm") and (p["layers"], p["kv_heads"], p["head_dim"]) == (2, 2, 10)
    assert stored.arrays["thresholds"].shape == (2,) and stored.arrays["codebook_high"].shape == (4,)
    assert stored.arrays["key_mean"].shape == (2, 2, 10) and stored.arrays["key_scale"].shape == (2, 2, 10)
    assert (p["sink"], p["pre_rope"]) == (1, 1) and p["rope_theta"] == 10000.0
    result = evaluate(out, EvalSettings(data=text_file, windows=3, seq_len=40, reference=str(tiny_llama)))
    fp16 = 2 * 2 * 2 * 2 * 10
    assert result["kv_fp16_bytes_per_token"] == fp16
    # 20 codes a token and tensor: 4 bytes at L=3 (5 in 8 bits), 5 at L=4; two fp16 norms; a flag bit
    assert 2 * 2 * (4 + 4) < result["kv_bytes_per_token"] < 2 * 2 * (5 + 4) + 1
    assert 0.05 < result["kv_high_fraction"] < 0.6
    assert {"delta_nll", "delta_nll_ci", "kv_reduction"} <= set(result)


def test_semkv_auto_follows_the_calibration(kv_calib, tiny_llama, tmp_path):
    calib, report = kv_calib
    recs = report["kv"]["recommendations"]
    if all(r is None for r in recs.values()):
        with pytest.raises(AccelError, match="no level count without detectable loss"):
            quantize_model(tiny_llama, tmp_path / "a", QuantizeSettings(kv="semkv", calib=str(calib)))
        return
    quantize_model(tiny_llama, tmp_path / "a", QuantizeSettings(kv="semkv:auto", calib=str(calib)))
    p = read_maps(Artifact(tmp_path / "a"))["kv"].params
    best = min((r for r in recs.values() if r), key=lambda r: r["bits_per_value"])
    assert (p["base"], p["levels"], p["frac"]) == (best["base"], best["levels"], best["frac"])


@pytest.mark.parametrize("spec,message", [
    ("semkv:zstd:4/5@0.5", "unknown base quantizer 'zstd'"),
    ("semkv:5/4@0.5", "LHI must exceed LLO"),
    ("semkv:1/2@0.5", "KV levels must lie in 2..256"),
    ("semkv:4/300@0.5", "KV levels must lie in 2..256"),
    ("semkv:4/5@1.5", "FRAC must lie in"),
    ("semkv:4/5", "expected LLO/LHI@FRAC"),
])
def test_bad_semkv_specs_are_refused(kv_calib, tiny_llama, tmp_path, spec, message):
    with pytest.raises(AccelError, match=message):
        quantize_model(tiny_llama, tmp_path / "x", QuantizeSettings(kv=spec, calib=str(kv_calib[0])))
    assert not (tmp_path / "x").exists()


def _edit_report(calib, mutate):
    """Change kv/report.json and record its new SHA-256 in calibration.json, as a calibrate that wrote such a
    report would: the report's own checks are what these tests reach, past the hash check."""
    import hashlib

    path = calib / "kv" / "report.json"
    report = json.loads(path.read_text())
    mutate(report)
    path.write_text(json.dumps(report))
    manifest = json.loads((calib / "calibration.json").read_text())
    manifest["files"]["kv/report.json"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (calib / "calibration.json").write_text(json.dumps(manifest))


def test_a_kv_report_changed_after_calibrate_is_refused(kv_calib, tiny_llama, tmp_path):
    """A changed report that is still a valid one (a recommendation's level count, say) would give another map
    without a word: calibration.json's SHA-256 of it sees the change."""
    import shutil

    changed = tmp_path / "c"
    shutil.copytree(kv_calib[0], changed)
    path = changed / "kv" / "report.json"
    path.write_text(path.read_text() + " ")
    with pytest.raises(AccelError, match="kv/report.json changed since calibrate wrote it"):
        quantize_model(tiny_llama, tmp_path / "x", QuantizeSettings(kv="semkv", calib=str(changed)))
    assert not (tmp_path / "x").exists()


def test_verify_checks_a_calibration(kv_calib, tmp_path, capsys):
    """`accel verify CALIB_DIR`: its recorded JSON files and every container's checksums and decode."""
    import shutil

    def verify(path, *extra):
        code = main(["verify", str(path), "--json", *extra])
        out, err = capsys.readouterr()
        return code, (json.loads(out) if out.strip() else None), err

    code, report, _ = verify(kv_calib[0])
    assert code == 0 and report["ok"] and report["kind"] == "calibration" and report["tensors"] > 0
    broken = tmp_path / "c"
    shutil.copytree(kv_calib[0], broken)
    (broken / "kv" / "report.json").write_text((broken / "kv" / "report.json").read_text() + " ")
    container = broken / "kv" / "model.safetensors"
    raw = bytearray(container.read_bytes())
    raw[-3] ^= 1  # in the last stored tensor's bytes
    container.write_bytes(bytes(raw))
    code, report, _ = verify(broken)
    assert code == 1 and len(report["errors"]) == 2
    assert report["errors"][0].startswith("kv/report.json: changed since calibrate wrote it")
    assert report["errors"][1].startswith("kv/model.safetensors: tensor ") and "checksum mismatch" in report["errors"][1]
    (broken / "calibration.json").write_text("{")
    code, report, _ = verify(broken)
    assert code == 1 and report["errors"][0] == "calibration.json: cannot be read (JSONDecodeError)"
    code, _, err = verify(kv_calib[0], "--reference", "smollm2-135m")
    assert code == 2 and "is a calibration" in err and len(err.strip().splitlines()) == 1


def test_semkv_needs_a_kv_calibration_of_this_model(tiny_llama, tmp_path, kv_calib):
    with pytest.raises(AccelError, match="needs --calib"):
        quantize_model(tiny_llama, tmp_path / "x", QuantizeSettings(kv="semkv"))
    (tmp_path / "nokv").mkdir()
    with pytest.raises(AccelError, match="no KV calibration"):
        quantize_model(tiny_llama, tmp_path / "x", QuantizeSettings(kv="semkv", calib=str(tmp_path / "nokv")))
    other = kv_calib[0].parent / "other"
    import shutil

    shutil.copytree(kv_calib[0], other)
    _edit_report(other, lambda r: r.update(model_shape=[30, 3, 64]))
    with pytest.raises(AccelError, match="calibrated on a different model"):
        quantize_model(tiny_llama, tmp_path / "x", QuantizeSettings(kv="semkv", calib=str(other)))


@pytest.mark.parametrize("damage", [
    lambda r: r.update(model_shape=3.5),
    lambda r: r.update(runtime_indicator=["key_norm"]),
    lambda r: r.pop("runtime_indicator"),
    lambda r: r.update(recommendations={"a": 1}),
    lambda r: r.update(recommendations={"turbo": {"levels": [1, 4], "frac": 0.5, "base": "turbo",
                                                  "bits_per_value": 2.0}}),
    lambda r: r.update(recommendations={"affine": {"levels": "tt", "frac": 0.5, "base": "affine",
                                                   "bits_per_value": 2.0}}),
    lambda r: r["options"].update(affine=["pre_rope"]),
    lambda r: r.update(smoothed=[]),
])
def test_a_damaged_kv_report_is_refused_in_one_line(kv_calib, tiny_llama, tmp_path, damage):
    """Found by fuzzing the report: each of these was a KeyError, TypeError, IndexError or ValueError traceback."""
    import shutil

    damaged = tmp_path / "c"
    shutil.copytree(kv_calib[0], damaged)
    _edit_report(damaged, damage)
    for spec in ("semkv", "semkv:turbo:4/6@0.5"):
        with pytest.raises(AccelError, match="is damaged"):
            quantize_model(tiny_llama, tmp_path / "x", QuantizeSettings(kv=spec, calib=str(damaged)))


CONFIG = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 40}


def _map(**changes):
    params = make_params("turbo", (4, 5), 0.5, "key_norm", 0, CONFIG)
    arrays = make_arrays(params, np.zeros(2))
    params.update(changes)
    return StoredMap("kv", "semkv", params, arrays)


@pytest.mark.parametrize("changes,message", [
    ({"layers": 3}, "made for a different model"),
    ({"kv_heads": 4}, "made for a different model"),
    ({"head_dim": 8}, "made for a different model"),
    ({"levels": [1, 5]}, "L = 1; KV levels must lie in 2..256"),
    ({"levels": [4, 257]}, "L = 257; KV levels must lie in 2..256"),
    ({"base": "lattice"}, "unknown base quantizer 'lattice'"),
    ({"indicator": "acc_attention"}, "not one the cache can compute"),
    ({"frac": 2.0}, "frac must lie in"),
    ({"window": -1}, "window must be a non-negative"),
    ({"sink": -2}, "sink must be a non-negative"),
    ({"pre_rope": 2}, "pre_rope must be 0 or 1"),
    ({"pre_rope": 1}, "rope_theta None is not the model's"),
    ({"pre_rope": 1, "rope_theta": 500000.0}, "rope_theta 500000.0 is not the model's"),
])
def test_bad_maps_are_refused(changes, message):
    check_kv_map(_map(), CONFIG)
    with pytest.raises(AccelError, match=message):
        check_kv_map(_map(**changes), CONFIG)


def test_sink_pre_rope_and_key_scale_round_trip_into_the_scheme():
    from accel.quantize.semkv import scheme_of

    params = make_params("turbo", (4, 5), 0.5, "key_norm", 0, CONFIG, sink=2, pre_rope=1)
    assert (params["sink"], params["pre_rope"], params["rope_theta"]) == (2, 1, 10000.0)
    scale = np.full((2, 2, 10), 0.5, np.float32)
    stored = StoredMap("kv", "semkv", params, {**make_arrays(params, np.zeros(2)), "key_scale": scale})
    check_kv_map(stored, CONFIG)
    scheme = scheme_of(stored)
    assert (scheme.sink, scheme.rope_theta) == (2, 10000.0) and scheme.key_scale is scale
    old = {k: v for k, v in make_params("turbo", (4, 5), 0.5, "key_norm", 0, CONFIG).items()
           if k not in ("sink", "pre_rope")}  # a map written before these options existed
    check_kv_map(StoredMap("kv", "semkv", old, make_arrays(old, np.zeros(2))), CONFIG)
    assert scheme_of(StoredMap("kv", "semkv", old, {})).sink == 0
    for bad, message in ((np.zeros((2, 2, 10), np.float32), "finite and positive"),
                         (np.ones((2, 2, 8), np.float32), "key_scale is \\[2, 2, 8\\]")):
        stored.arrays["key_scale"] = bad
        with pytest.raises(AccelError, match=message):
            check_kv_map(stored, CONFIG)
    affine = make_params("affine", (4, 5), 0.5, "key_norm", 0, CONFIG)
    with pytest.raises(AccelError, match="only the turbo base"):
        check_kv_map(StoredMap("kv", "semkv", affine, {"thresholds": np.zeros(2, np.float32), "key_scale": scale}),
                     CONFIG)
    scaled = {**CONFIG, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}
    with pytest.raises(AccelError, match="plain"):
        make_params("affine", (4, 5), 0.5, "key_norm", 0, scaled, pre_rope=1)
    with pytest.raises(AccelError, match="plain RoPE"):
        check_kv_map(StoredMap("kv", "semkv", params, make_arrays(params, np.zeros(2))), scaled)


def test_thresholds_must_be_one_per_layer():
    stored = _map()
    stored.arrays["thresholds"] = np.array([0.0, np.nan], np.float32)
    with pytest.raises(AccelError, match="one threshold per layer"):
        check_kv_map(stored, CONFIG)
    stored.arrays["thresholds"] = np.zeros(3, np.float32)
    with pytest.raises(AccelError, match="one threshold per layer"):
        check_kv_map(stored, CONFIG)


def test_a_codebook_that_is_not_lloyd_max_is_refused():
    stored = _map()
    stored.arrays["codebook_low"] = stored.arrays["codebook_low"] * 1.1
    with pytest.raises(FormatError, match="not the Lloyd-Max codebook"):
        check_kv_map(stored, CONFIG)


def test_eval_refuses_a_map_for_a_model_with_other_heads(kv_calib, tiny_llama, tmp_path, text_file):
    out = tmp_path / "d"
    quantize_model(tiny_llama, out, QuantizeSettings(kv="semkv:affine:4/5@0.5", calib=str(kv_calib[0])))
    cfg = json.loads((out / "config.json").read_text())
    cfg["num_key_value_heads"] = 4
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(AccelError, match="made for a different model"):
        evaluate(out, EvalSettings(data=text_file, windows=1, seq_len=16))


@pytest.mark.parametrize("spec", ["fp16", "affine:6", "turbo:4,window=4", "kivi", "quanto:4", "quanto:2", "hqq:4",
                                  "hqq:2"])
def test_baselines_run_in_the_same_harness(tiny_llama, text_file, spec):
    if spec.startswith("quanto"):
        pytest.importorskip("optimum.quanto")
    result = evaluate(tiny_llama, EvalSettings(data=text_file, windows=1, seq_len=40, kv=spec,
                                               reference=str(tiny_llama)))
    assert result["kv_fp16_bytes_per_token"] == 160 and result["kv_bytes_per_token"] > 0
    if spec == "fp16":
        assert result["kv_bytes_per_token"] == 160 and abs(result["delta_nll"]) < 1e-4
    else:
        assert result["kv_bytes_per_token"] < 160


@pytest.mark.parametrize("spec,message", [
    ("affine", "needs a level count"), ("turbo:x", "must be an integer"), ("affine:300", "2..256"),
    ("turbo:4,depth=3", "unknown option 'depth'"), ("quanto:3", "choose from 2, 4"), ("fp16:2", "takes no"),
    ("semkv", "needs calibration"),
    ("quanto:4,residual=0", "residual:0: choose from 1 to 4096$"),  # listed all 4096 (23 KB on one line) until
])                                                                 # 2026-12-06
def test_bad_eval_specs_are_refused(tiny_llama, text_file, spec, message):
    method, arg = parse_spec("kv", spec)
    with pytest.raises(AccelError, match=message):
        method.from_eval_spec(arg, CONFIG)


@pytest.mark.parametrize("kv", ["affine:6", "turbo:5", "kivi:2"])
def test_eval_decodes_windows_side_by_side_with_the_same_bytes(tiny_llama, text_file, kv):
    """--batch 2 decodes 3 windows as batches of 2 and 1, each window through its own cache rows: the same
    measured bytes per token and, up to float32 summation order, the same per-window NLL."""
    settings = {"data": text_file, "windows": 3, "seq_len": 40, "kv": kv}
    one = evaluate(tiny_llama, EvalSettings(**settings))
    two = evaluate(tiny_llama, EvalSettings(batch=2, **settings))
    assert two["kv_bytes_per_token"] == one["kv_bytes_per_token"]
    np.testing.assert_allclose(two["window_nll"], one["window_nll"], atol=1e-4)  # measured: < 1e-7
    with pytest.raises(AccelError, match="--batch must be at least 1"):
        evaluate(tiny_llama, EvalSettings(batch=0, **settings))
