"""DAMP end to end: calibrate --for state, quantize --state damp, eval through the mixed-precision state cache."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_cli import assert_one_line_error, run, run_json

import accel.fixtures
from accel.calibrate.state import persistence, rank, read_state_stats, spearman, top_share
from accel.errors import AccelError
from accel.eval.load import load_causal_lm
from accel.formats.artifact import Artifact
from accel.quantize.damp import (
    WATER_BITS,
    Damp,
    DampSpec,
    damp_map,
    parse_damp_arg,
    risk_score,
    select_channels,
    water_fill,
)
from accel.quantize.maps import StoredMap, read_maps
from accel.runtime.state_cache import StateScheme
from accel.runtime.state_shapes import StateShape, state_shape


def test_damp_arguments():
    assert parse_damp_arg(None) == DampSpec(9.9, "both", None, None)
    assert parse_damp_arg("9.5,rank=energy,high=bf16") == DampSpec(9.5, "energy", "bf16", None)
    assert parse_damp_arg("rank=persistence") == DampSpec(9.9, "persistence", None, None)
    assert DampSpec(9.9).formats(32) == ("fp16", "int8")
    assert DampSpec(6.5).formats(32) == ("int8", "int4")  # below INT8's own bits: the adjacent tiers
    assert parse_damp_arg("9.5,alloc=water") == DampSpec(9.5, "sensitivity", None, None, "water")
    assert parse_damp_arg("alloc=water,rank=both") == DampSpec(9.9, "both", None, None, "water")
    for bad, msg in (("x", "not a number"), ("rank=loud", "choose from"), ("high=int4", "choose from"),
                     ("9,frac=1", "unknown option"), ("low=int99", "unknown state format"), ("-1", "positive"),
                     ("alloc=fill", "choose from"), ("alloc=water,high=fp16", "high= and low= are for")):
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
    with pytest.raises(AccelError, match="above fp16 for every channel"):  # was capped at 16 without a word
        select_channels(score, shape, 100.0, "fp16", "int8")


_GDN_CONFIG = json.loads((Path(accel.fixtures.__file__).parent / "tiny-gdn" / "config.json").read_text())


def _stats(shape: StateShape, seed: int = 0) -> dict:
    """Calibration-like statistics: lognormal energies on a 4^-K curve, persistence and sensitivity."""
    rng = np.random.default_rng(seed)
    dims = (len(shape.layers), shape.heads, shape.d_k)
    e8 = rng.lognormal(0, 1.5, dims)
    return {"energy": e8, "persistence": rng.uniform(1, 50, dims), "sensitivity": rng.lognormal(0, 1, dims),
            "energy_tiers": np.stack([e8 * 4.0 ** (8 - k) for k in WATER_BITS])}


def test_water_fill_matches_brute_force_on_a_small_instance():
    rng = np.random.default_rng(3)
    for trial in range(4):
        r = rng.lognormal(0, 2, 4)  # four channels, loss r_c 4^-K at K = 2..7
        loss = r[:, None] * 4.0 ** -np.arange(2, 8)[None, :]
        grid = np.stack(np.meshgrid(*[np.arange(6)] * 4, indexing="ij"), -1).reshape(-1, 4)
        totals = loss[np.arange(4)[None], grid].sum(1)
        for steps in range(4 * 5 + 1):
            taken = water_fill(loss, steps)
            assert taken.sum() == steps and taken.min() >= 0 and taken.max() <= 5
            best = totals[grid.sum(1) <= steps].min()
            assert loss[np.arange(4), taken].sum() == pytest.approx(best, rel=1e-12), (trial, steps)
    # the closed form: K_c = K̄ + ½ log2(r_c / geomean(r)), here integers (K̄ = 8, geomean 64)
    r = np.array([1.0, 16.0, 256.0, 4096.0])
    taken = water_fill(r[:, None] * 4.0 ** -np.arange(2, 17)[None, :], 4 * 6)
    assert (2 + taken).tolist() == [5, 7, 9, 11]


def test_water_fill_takes_a_channels_steps_in_order():
    # a curve that falls to K = 12, then rises (the float16-scale floor) and falls a little: the late gain must
    # not pull the channel past the rise while other channels still gain
    k = np.arange(2, 17)
    bumpy = 4.0 ** -np.minimum(k, 12)
    bumpy[k == 13], bumpy[k == 14] = 4.0**-9, 4.0**-10
    loss = np.stack([bumpy, 4.0 ** -k.astype(float), 4.0 ** -k.astype(float)])
    taken = water_fill(loss, 10 + 9 + 9)  # enough for int12 on the first channel
    assert taken.sum() == 28 and 2 + taken[0] <= 12


def test_water_fill_is_monotone_in_the_budget():
    rng = np.random.default_rng(1)
    loss = np.sort(rng.lognormal(0, 2, (60, 15)), axis=1)[:, ::-1]  # decreasing, not convex
    loss[::7, 5] = loss[::7, 4]  # flat steps, for ties
    prev = water_fill(loss, 0)
    for steps in range(1, 60 * 14 + 1, 7):
        taken = water_fill(loss, steps)
        assert (taken >= prev).all() and taken.sum() == steps
        prev = taken
    shape = StateShape("kda", (0, 1), 2, 16, 32)
    stats = _stats(shape)
    widths = [damp_map(stats, shape, parse_damp_arg(f"{b},alloc=water")).arrays["bits"] for b in
              np.arange(2.5, 16.51, 0.25)]
    assert all((b >= a).all() for a, b in itertools.pairwise(widths))
    assert widths[0].max() == 2 and widths[-1].min() == 16


@pytest.mark.parametrize("d_v", [32, 128])
def test_water_map_budget_is_exact_in_measured_bytes(d_v):
    shape = StateShape("gdn", (0, 1, 2), 4, 32, d_v)
    stats = _stats(shape, seed=d_v)
    for bits in (5.5, 6.5, 9.5, 9.9, 10.5):
        stored = damp_map(stats, shape, parse_damp_arg(f"{bits},alloc=water"))
        widths = stored.arrays["bits"]
        scheme = StateScheme(shape, low="int8", row_formats={
            layer: [f"int{k}" for k in widths[i].reshape(-1)] for i, layer in enumerate(shape.layers)})
        state = torch.randn(1, shape.heads, shape.d_k, d_v)
        nbytes = sum(scheme.store(layer, state).nbytes for layer in shape.layers)
        measured = 8.0 * nbytes / shape.values
        assert measured == stored.params["bits_per_value"] == scheme.bits_per_value()
        assert bits - 1.0 / shape.channels < measured <= bits + 1e-12  # the most the budget allows
        assert len(stored.params["widths"]) > 2  # more than two tiers
    top = 16 + 16 / d_v
    assert damp_map(stats, shape, parse_damp_arg(f"{top},alloc=water")).params["bits_per_value"] == top
    with pytest.raises(AccelError, match="above int16 for every channel"):
        damp_map(stats, shape, parse_damp_arg(f"{top + 0.5},alloc=water"))


def test_water_map_check_refuses_bad_widths():
    config = _GDN_CONFIG
    shape = state_shape(config)
    assert (len(shape.layers), shape.heads, shape.d_k) == (3, 4, 64)
    stored = damp_map(_stats(shape), shape, parse_damp_arg("6.5,alloc=water"))
    Damp().check(stored, config)
    bad = {"bits": stored.arrays["bits"].copy()}
    bad["bits"][0, 0, 0] = 17
    with pytest.raises(AccelError, match="each must be an INT-K width in 2..16"):
        Damp().check(StoredMap("state", "damp", stored.params, bad), config)
    with pytest.raises(AccelError, match=r"channel widths are \(3, 4, 16\), the model needs \(3, 4, 64\)"):
        Damp().check(StoredMap("state", "damp", stored.params, {"bits": stored.arrays["bits"][..., :16]}), config)
    params = {**stored.params, "bits_per_value": 7.0}
    with pytest.raises(AccelError, match="records 7.0 bits per value but its channel widths give 6.500000"):
        Damp().check(StoredMap("state", "damp", params, stored.arrays), config)
    with pytest.raises(AccelError, match="allocation 'wild' is unknown"):
        Damp().check(StoredMap("state", "damp", {**stored.params, "alloc": "wild"}, stored.arrays), config)


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
    assert rep["arch"] == "kda" and (rep["layers"], rep["heads"], rep["d_k"]) == ([0, 1, 2], 4, 64)
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
    manifest = json.loads((out / "accel.json").read_text())
    stored = set(Artifact(out).names)
    assert set(manifest["tensors"]) == stored and rep["tensors"] == len(stored)  # the map's tensors included
    assert {"maps.state.high", "maps.state.score"} <= stored
    doc = manifest["maps"]["state"]
    assert doc["params"]["high"] == "fp16" and doc["params"]["low"] == "int8"
    assert doc["params"]["bits_per_value"] <= 9.9
    ev = run_json(capsys, "eval", out, "--data", text_file, "--windows", "1", "--seq-len", "48",
                  "--reference", "tiny-gdn")
    assert ev["state"]["method"] == "damp"
    assert ev["state_bits_per_value"] == pytest.approx(doc["params"]["bits_per_value"], abs=0.02)
    assert abs(ev["delta_nll"]) < 0.02
    code, printed, _ = run(capsys, "eval", out, "--data", text_file, "--windows", "1", "--seq-len", "24")
    assert code == 0 and "bits per value" in printed
    one = run_json(capsys, "eval", out, "--data", text_file, "--windows", "3", "--seq-len", "24")
    two = run_json(capsys, "eval", out, "--data", text_file, "--windows", "3", "--seq-len", "24", "--batch", "2")
    assert two["state_bytes"] == one["state_bytes"] and two["state_bits_per_value"] == one["state_bits_per_value"]
    np.testing.assert_allclose(two["window_nll"], one["window_nll"], atol=1e-3)
    code, _, err = run(capsys, "eval", out, "--data", text_file, "--windows", "1", "--seq-len", "24", "--batch", "0")
    assert_one_line_error(code, err, 2, "--batch must be at least 1")
    # --kernels on an OUT_DIR whose weights are all kept ran densely and reported "kernels": true (audit, 2026-12-07)
    code, _, err = run(capsys, "generate", out, "--prompt", "hi", "--tokens", "2", "--kernels")
    assert_one_line_error(code, err, 2, "holds none (its weights are kept in source precision)")


def _assert_refused_with_other_heads(capsys, out, text_file):
    """Edit OUT's config so the map describes a model with other heads: eval must refuse it (exit 2)."""
    cfg = json.loads((out / "config.json").read_text())
    cfg["linear_num_value_heads"] = 8
    (out / "config.json").write_text(json.dumps(cfg))
    code, _, err = run(capsys, "eval", out, "--data", text_file, "--windows", "1", "--seq-len", "16")
    assert_one_line_error(code, err, 2, "the state map is for 3 linear-attention layers x 4 heads x 64 channels")


def test_mismatched_map_and_calibration_are_refused(capsys, gdn_calib, tmp_path, text_file):
    out = tmp_path / "d"
    run_json(capsys, "quantize", "tiny-gdn", "--state", "damp:9.0,rank=energy", "--calib", gdn_calib, "--out", out)
    _assert_refused_with_other_heads(capsys, out, text_file)
    code, _, err = run(capsys, "quantize", "tiny-kda", "--state", "damp", "--calib", gdn_calib,
                       "--out", tmp_path / "k")
    assert_one_line_error(code, err, 2, "was recorded on another model: its state statistics are for")
    code, _, err = run(capsys, "quantize", "tiny-gdn", "--state", "damp", "--out", tmp_path / "n")
    assert_one_line_error(code, err, 2, "needs --calib")


def test_water_map_round_trip_and_refusals(capsys, gdn_calib, tmp_path, text_file):
    out = tmp_path / "w"
    rep = run_json(capsys, "quantize", "tiny-gdn", "--state", "damp:6.5,alloc=water", "--calib", gdn_calib,
                   "--out", out)
    assert rep["maps"] == {"state": "damp"}
    manifest = json.loads((out / "accel.json").read_text())
    stored = set(Artifact(out).names)
    assert set(manifest["tensors"]) == stored and rep["tensors"] == len(stored)  # the map's tensors included
    assert {"maps.state.bits", "maps.state.score"} <= stored
    doc = manifest["maps"]["state"]
    assert doc["params"]["alloc"] == "water" and doc["params"]["rank"] == "sensitivity"
    assert doc["params"]["bits_per_value"] == 6.5
    arrays, _ = read_state_stats(gdn_calib)
    shape = state_shape(load_causal_lm("tiny-gdn").config)
    expected = damp_map(arrays, shape, parse_damp_arg("6.5,alloc=water")).arrays["bits"]
    art = Artifact(out)
    stored = read_maps(art)["state"]
    art.close()
    np.testing.assert_array_equal(stored.arrays["bits"], expected)  # the widths survive the container
    ev = run_json(capsys, "eval", out, "--data", text_file, "--windows", "1", "--seq-len", "40",
                  "--reference", "tiny-gdn")
    assert ev["state_bits_per_value"] == 6.5  # measured from the stored bytes
    assert abs(ev["delta_nll"]) < 0.05
    # a model whose heads differ is refused before decoding (a tampered map: test_water_map_check_refuses_…)
    _assert_refused_with_other_heads(capsys, out, text_file)
    code, _, err = run(capsys, "quantize", "tiny-gdn", "--state", "damp:2,alloc=water", "--calib", gdn_calib,
                       "--out", tmp_path / "low")
    assert_one_line_error(code, err, 2, "is below int2 alone (2.25 bits per value")
