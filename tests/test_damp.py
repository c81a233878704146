"""DAMP end to end: calibrate --for state, quantize --state damp, eval through the mixed-precision state cache."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_cli import assert_one_line_error, run, run_json

from accel.calibrate.state import persistence, rank, spearman, top_share
from accel.errors import AccelError
from accel.quantize.damp import DampSpec, parse_damp_arg, risk_score, select_channels
from accel.runtime.state_shapes import StateShape


def test_damp_arguments():
    assert parse_damp_arg(None) == DampSpec(9.9, "both", None, None)
    assert parse_damp_arg("9.5,rank=energy,high=bf16") == DampSpec(9.5, "energy", "bf16", None)
    assert parse_damp_arg("rank=persistence") == DampSpec(9.9, "persistence", None, None)
    assert DampSpec(9.9).formats(32) == ("fp16", "int8")
    assert DampSpec(6.5).formats(32) == ("int8", "int4")  # below INT8's own bits: the adjacent tiers
    for bad, msg in (("x", "not a number"), ("rank=loud", "choose from"), ("high=int4", "choose from"),
                     ("9,frac=1", "unknown option"), ("low=int99", "unknown state format"), ("-1", "positive")):
        with pytest.raises(AccelError, match=msg):
            parse_damp_arg(bad)


def test_selection_hits_the_budget_with_scales_counted():
    shape = StateShape("gdn", (0, 1, 2), 4, 32, 32)
    rng = np.random.default_rng(0)
    energy, pers = rng.random((3, 4, 32)), rng.random((3, 4, 32))
    score = risk_score(energy, pers, "both")
    mask, bits = select_channels(score, shape, 9.9, "fp16", "int8")
    n = int(mask.sum())
    assert bits <= 9.9 < (bits + (16 - 8.5) / shape.channels)  # the most channels the budget allows
    assert bits == pytest.approx((n * 16 + (384 - n) * 8.5) / 384)
    kept = score.reshape(-1)[mask.reshape(-1) == 1]
    assert kept.min() >= score.reshape(-1)[mask.reshape(-1) == 0].max()  # the top-ranked channels
    with pytest.raises(AccelError, match="below int8 alone"):
        select_channels(score, shape, 8.0, "fp16", "int8")
    assert select_channels(score, shape, 16.0, "fp16", "int8")[0].all()


def test_statistics_helpers():
    assert rank(np.array([3.0, 1.0, 3.0, 2.0])).tolist() == [2.5, 0.0, 2.5, 1.0]
    assert spearman(np.arange(10), np.arange(10) ** 3) == pytest.approx(1.0)
    assert top_share(np.array([9.0] + [1.0 / 9] * 9)) == pytest.approx(0.9)
    p = persistence(np.array([1.0, 0.25, 0.0]), 100)
    assert p[0] == 100 and p[1] == pytest.approx(4.0 / 3.0) and p[2] == 1.0


@pytest.fixture(scope="module")
def gdn_calib(tmp_path_factory, text_file):
    out = tmp_path_factory.mktemp("calib") / "gdn"
    from accel.cli.main import main

    assert main(["calibrate", "tiny-gdn", "--for", "state", "--data", str(text_file), "--out", str(out),
                 "--samples", "6", "--seq-len", "96"]) == 0
    return out


def test_calibrate_state_writes_table_plots_and_stability(capsys, tmp_path, text_file):
    rep = run_json(capsys, "calibrate", "tiny-kda", "--for", "state", "--data", text_file, "--out",
                   tmp_path / "c", "--samples", "4", "--seq-len", "64")["state"]
    assert rep["arch"] == "kda" and (rep["layers"], rep["heads"], rep["d_k"]) == ([0, 1, 2], 4, 32)
    assert rep["snapshots"] == 4 * 2 and 0 < rep["top10_energy_share"] <= 1
    for key in ("energy_rank_corr", "persistence_rank_corr", "score_rank_corr"):
        assert -1 <= rep[key] <= 1
    out = tmp_path / "c" / "state"
    assert "| layer | head |" in (out / "table.md").read_text()
    if rep["plots"]:
        assert all((out / p).read_bytes()[:4] == b"\x89PNG" for p in rep["plots"])


def test_quantize_and_eval_damp_map(capsys, gdn_calib, tmp_path, text_file):
    out = tmp_path / "d"
    rep = run_json(capsys, "quantize", "tiny-gdn", "--state", "damp", "--calib", gdn_calib, "--out", out)
    assert rep["maps"] == {"state": "damp"}
    doc = json.loads((out / "accel.json").read_text())["maps"]["state"]
    assert doc["params"]["high"] == "fp16" and doc["params"]["low"] == "int8"
    assert doc["params"]["bits_per_value"] <= 9.9
    ev = run_json(capsys, "eval", out, "--data", text_file, "--windows", "1", "--seq-len", "48",
                  "--reference", "tiny-gdn")
    assert ev["state"]["method"] == "damp"
    assert ev["state_bits_per_value"] == pytest.approx(doc["params"]["bits_per_value"], abs=0.02)
    assert abs(ev["delta_nll"]) < 0.02
    code, printed, _ = run(capsys, "eval", out, "--data", text_file, "--windows", "1", "--seq-len", "24")
    assert code == 0 and "bits per value" in printed


def test_mismatched_map_and_calibration_are_refused(capsys, gdn_calib, tmp_path, text_file):
    out = tmp_path / "d"
    run_json(capsys, "quantize", "tiny-gdn", "--state", "damp:9.0,rank=energy", "--calib", gdn_calib, "--out", out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["linear_num_value_heads"] = 8  # the map now describes a model with other heads
    (out / "config.json").write_text(json.dumps(cfg))
    code, _, err = run(capsys, "eval", out, "--data", text_file, "--windows", "1", "--seq-len", "16")
    assert_one_line_error(code, err, 2, "the state map is for 3 linear-attention layers x 4 heads x 32 channels")
    code, _, err = run(capsys, "quantize", "tiny-kda", "--state", "damp", "--calib", gdn_calib,
                       "--out", tmp_path / "k")
    assert_one_line_error(code, err, 2, "was recorded on another model: its state statistics are for")
    code, _, err = run(capsys, "quantize", "tiny-gdn", "--state", "damp", "--out", tmp_path / "n")
    assert_one_line_error(code, err, 2, "needs --calib")
