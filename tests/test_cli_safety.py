"""What the CLI must never do (overwrite an input, wipe the working directory, print a traceback) and the exit
codes of the failures a user meets: found by a black-box audit of the contract (2026-12-03)."""

from __future__ import annotations

import json
import shutil
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import make_tiny_llama
from test_cli import assert_one_line_error, run

from accel.formats.tensor import decode_parts, encode_tensor


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("safety") / "m")


def _snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_force_never_replaces_the_model_however_the_out_path_is_spelled(capsys, model, tmp_path, monkeypatch):
    before = _snapshot(model)
    (tmp_path / "empty").mkdir()
    link = tmp_path / "link"
    link.symlink_to(model)
    spelled = [tmp_path / "empty" / ".." / ".." / model.parent.name / model.name]  # through ..
    for model_arg, out in [(model, spelled[0]), (link, model), (model, link)]:
        code, _, err = run(capsys, "quantize", model_arg, "--weights", "rtn4", "--out", out, "--force")
        assert_one_line_error(code, err, 2, "would overwrite the input")
    assert _snapshot(model) == before


def test_force_never_replaces_the_calibration(capsys, model, tmp_path, text_file):
    calib = tmp_path / "calib"
    assert run(capsys, "calibrate", model, "--for", "weights", "--data", text_file, "--out", calib,
               "--samples", "2", "--seq-len", "32")[0] == 0
    before = _snapshot(calib)
    code, _, err = run(capsys, "quantize", model, "--weights", "gptq4", "--calib", calib, "--out", calib, "--force")
    assert_one_line_error(code, err, 2, "would overwrite the input")
    assert _snapshot(calib) == before


@pytest.mark.parametrize("out", ["", "."])
def test_the_working_directory_is_never_an_output(capsys, model, tmp_path, monkeypatch, out):
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    (work / "precious.txt").write_text("keep")
    monkeypatch.chdir(work)
    code, _, err = run(capsys, "quantize", model, "--weights", "rtn4", "--out", out, "--force")
    assert_one_line_error(code, err, 2, "--out must name a directory")
    monkeypatch.chdir(work / "sub")
    code, _, err = run(capsys, "quantize", model, "--weights", "rtn4", "--out", work, "--force")
    assert_one_line_error(code, err, 2, "working directory")
    assert (work / "precious.txt").read_text() == "keep"


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs /proc (Linux)")
def test_an_unwritable_parent_is_refused_before_any_work(capsys, model):
    code, out, err = run(capsys, "quantize", model, "--weights", "rtn4", "--out", "/proc/accel-out", "--json")
    assert_one_line_error(code, err, 2, "cannot write in /proc")
    assert json.loads(out)["ok"] is False


@pytest.mark.parametrize("argv", [["eval", "m", "--data", "t", "--seed", "-1"],
                                  ["quantize", "m", "--out", "o", "--seed", str(2**64)],
                                  ["calibrate", "m", "--for", "state", "--data", "t", "--out", "o", "--seed", "-5"]])
def test_seeds_out_of_range_are_usage_errors(capsys, argv):
    code, out, err = run(capsys, *argv, "--json")
    assert code == 2 and "Traceback" not in err and "--seed" in err
    assert json.loads(out) == {"ok": False, "error": json.loads(out)["error"]} and "--seed" in json.loads(out)["error"]


def test_usage_errors_keep_the_json_contract(capsys):
    code, out, _ = run(capsys, "eval", "m", "--json")
    assert code == 2 and json.loads(out) == {"ok": False, "error": "Missing option '--data'."}


def test_a_manifest_that_is_not_an_object_is_one_line(capsys, model, tmp_path):
    out = tmp_path / "q"
    assert run(capsys, "quantize", model, "--weights", "rtn4", "--out", out)[0] == 0
    (out / "accel.json").write_text("[1, 2]")
    code, _, err = run(capsys, "inspect", out)
    assert_one_line_error(code, err, 2, "accel.json: not a JSON object")


def test_an_output_without_its_manifest_is_named_as_such(capsys, model, tmp_path, text_file):
    out = tmp_path / "q"
    assert run(capsys, "quantize", model, "--weights", "rtn4", "--out", out)[0] == 0
    (out / "accel.json").unlink()
    code, _, err = run(capsys, "eval", out, "--data", text_file, "--windows", "1", "--seq-len", "32")
    assert_one_line_error(code, err, 2, "an accel output without its accel.json")


def test_an_inconsistent_config_is_one_line(capsys, tmp_path, text_file):
    import accel.fixtures

    broken = tmp_path / "gdn"
    shutil.copytree(Path(accel.fixtures.__file__).parent / "tiny-gdn", broken)
    config = json.loads((broken / "config.json").read_text())
    config["num_hidden_layers"] = 2  # its layer_types list four layers
    (broken / "config.json").write_text(json.dumps(config))
    code, _, err = run(capsys, "eval", broken, "--data", text_file, "--windows", "1", "--seq-len", "32")
    assert_one_line_error(code, err, 2, "is not a valid 'qwen3_5_text' config")
    config["model_type"] = "no_such_model"
    (broken / "config.json").write_text(json.dumps(config))
    code, _, err = run(capsys, "eval", broken, "--data", text_file, "--windows", "1", "--seq-len", "32")
    assert_one_line_error(code, err, 2, "model type 'no_such_model' is not known to transformers")
    assert len(err) < 200


@pytest.mark.parametrize("key,value", [("hidden_size", 0), ("num_attention_heads", 0), ("head_dim", 0),
                                       ("intermediate_size", -1)])
def test_a_size_that_is_not_positive_is_named(capsys, tmp_path, text_file, key, value):
    """hidden_size 0 built a model of empty layers (a torch warning a layer) and failed later on every tensor's
    shape; the size itself is named now, before anything is built."""
    import accel.fixtures

    broken = tmp_path / "gdn"
    shutil.copytree(Path(accel.fixtures.__file__).parent / "tiny-gdn", broken)
    config = json.loads((broken / "config.json").read_text())
    config[key] = value
    (broken / "config.json").write_text(json.dumps(config))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        code, _, err = run(capsys, "eval", broken, "--data", text_file, "--windows", "1", "--seq-len", "32")
    assert_one_line_error(code, err, 2, f"config's {key} is {value!r}: it must be a positive integer")


def test_sliding_layers_without_a_window_are_one_line(capsys, model, tmp_path, text_file):
    """A Qwen3 config with use_sliding_window false (so no window) whose layer_types lists sliding layers: transformers
    builds the model, then fails in its cache (a TypeError traceback from eval, a ValueError from calibrate)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    source = tmp_path / "qwen3"
    config = Qwen3Config(vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, use_sliding_window=False,
                         sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    Qwen3ForCausalLM(config).save_pretrained(source)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model / name, source / name)
    capsys.readouterr()
    message = "layer_types makes layers 0 sliding_attention but its sliding_window is unset (use_sliding_window is"
    for command in (("eval", source, "--data", text_file, "--windows", "1", "--seq-len", "32"),
                    ("calibrate", source, "--for", "weights,kv", "--data", text_file, "--samples", "2",
                     "--seq-len", "32", "--out", tmp_path / "c"),
                    ("quantize", source, "--weights", "rtn4", "--out", tmp_path / "q")):
        code, _, err = run(capsys, *command)
        assert_one_line_error(code, err, 2, message)
    assert not (tmp_path / "q").exists() and not (tmp_path / "c").exists()


def test_a_non_finite_nll_fails_the_eval(capsys, tmp_path, text_file):
    poisoned = make_tiny_llama(tmp_path / "nan", poison="lm_head.weight")
    capsys.readouterr()
    code, out, err = run(capsys, "eval", poisoned, "--data", text_file, "--windows", "1", "--seq-len", "32",
                         "--json")
    assert code == 1 and json.loads(out)["nll"] is None
    assert "not finite" in err and "Traceback" not in err


def test_compact_is_written_as_the_packed_layout_it_names(capsys, model, tmp_path):
    assert run(capsys, "quantize", model, "--weights", "rtn4", "--layout", "compact", "--out", tmp_path / "c")[0] == 0
    assert run(capsys, "quantize", model, "--weights", "rtn4", "--out", tmp_path / "p")[0] == 0
    compact, packed = _snapshot(tmp_path / "c"), _snapshot(tmp_path / "p")
    del compact["accel.json"], packed["accel.json"]  # they record the --layout asked for
    assert compact == packed
    doc = json.loads((tmp_path / "c" / "accel.json").read_text())
    assert {t["layout"] for t in doc["tensors"].values() if t["role"] == "quantized"} == {"packed"}


def test_a_group_wider_than_the_row_is_the_row(rng):
    x = rng.standard_normal((6, 50))
    wide, wide_arrays = encode_tensor("w", x, "affine", levels=16, group=10**6)
    row, row_arrays = encode_tensor("w", x, "affine", levels=16, group=50)
    assert wide.params["group"] == 10**6  # stored as asked
    assert all(np.array_equal(wide_arrays[k], row_arrays[k]) for k in row_arrays)
    parts = {p: wide_arrays[n] for p, n in wide.parts.items()}
    assert np.array_equal(decode_parts(wide, parts), decode_parts(row, {p: row_arrays[n] for p, n in row.parts.items()}))


@pytest.mark.parametrize("change,message", [
    ({"num_key_value_heads": 4}, "has shape (20, 40), the model expects (40, 40)"),
    ({"mlp_bias": "yes"}, "not a valid 'llama' config"),
    ({"head_dim": 0}, "config's head_dim is 0: it must be a positive integer"),
])
def test_a_source_whose_config_does_not_describe_its_tensors_is_refused_before_any_work(
        capsys, model, tmp_path, change, message):
    """quantize wrote such outputs in full, and eval refused them only then (head_dim 0 was a traceback there)."""
    import shutil

    source = tmp_path / "m"
    shutil.copytree(model, source)
    config = json.loads((source / "config.json").read_text())
    config.update(change)
    (source / "config.json").write_text(json.dumps(config))
    code, _, err = run(capsys, "quantize", source, "--weights", "rtn4", "--out", tmp_path / "q")
    assert_one_line_error(code, err, 2, message)
    assert not (tmp_path / "q").exists()


def test_a_calibration_of_other_weights_with_the_same_shapes_is_refused(capsys, model, tmp_path, text_file):
    calib = tmp_path / "calib"
    assert run(capsys, "calibrate", model, "--for", "weights", "--data", text_file, "--out", calib,
               "--samples", "2", "--seq-len", "32")[0] == 0
    twin = make_tiny_llama(tmp_path / "twin", seed=1)  # same shapes, other weights
    capsys.readouterr()
    code, _, err = run(capsys, "quantize", twin, "--weights", "gptq4", "--calib", calib, "--out", tmp_path / "x")
    assert_one_line_error(code, err, 2, "was recorded on a different model: its sha256 of model.safetensors differs")
    assert run(capsys, "quantize", model, "--weights", "gptq4", "--calib", calib, "--out", tmp_path / "y")[0] == 0
    manifest = calib / "calibration.json"
    for damaged, message in [(manifest.read_bytes()[:-40], "calibration.json cannot be read (JSONDecodeError)"),
                             (b"[1, 2]", "calibration.json is not a JSON object"), (None, "no calibration.json")]:
        if damaged is None:  # a copy of the calibration without it was taken for the twin (audit, 2026-12-07)
            manifest.unlink()
        else:
            manifest.write_bytes(damaged)  # the model check must not be skipped quietly
        for target in (model, twin):
            code, _, err = run(capsys, "quantize", target, "--weights", "gptq4", "--calib", calib, "--out",
                               tmp_path / "z")
            assert_one_line_error(code, err, 2, message)
            assert not (tmp_path / "z").exists()


def test_data_and_calib_that_are_not_what_they_should_be_are_named(capsys, model, tmp_path):
    code, _, err = run(capsys, "eval", model, "--data", tmp_path)
    assert_one_line_error(code, err, 2, ": a directory; give a UTF-8 text file")
    code, _, err = run(capsys, "eval", model, "--data", "/dev/null")
    assert_one_line_error(code, err, 2, "not a regular file")
    code, _, err = run(capsys, "quantize", model, "--weights", "gptq4", "--calib", tmp_path / "nocal", "--out",
                       tmp_path / "x")
    assert_one_line_error(code, err, 2, "nocal: no such directory")
    (tmp_path / "afile").write_text("x")
    code, _, err = run(capsys, "quantize", model, "--weights", "gptq4", "--calib", tmp_path / "afile", "--out",
                       tmp_path / "x")
    assert_one_line_error(code, err, 2, "afile: not a directory")


def test_a_termination_a_finalizer_swallowed_stops_at_the_next_progress_step(capsys, model, tmp_path, monkeypatch):
    """SIGTERM raises where the main thread is; inside a __del__ Python drops the exception, and the run went on to
    write its output. The handler's flag is checked again at every progress step."""
    from accel.cli import common
    from accel.quantize import pipeline

    monkeypatch.setitem(common.SIGTERM_SEEN, "seen", False)  # restored after the test
    real = pipeline.keep_tensor

    def keep_then_swallow(*args, **kwargs):
        common.SIGTERM_SEEN["seen"] = True  # the handler ran; its exception was lost
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "keep_tensor", keep_then_swallow)
    code, _, err = run(capsys, "quantize", model, "--weights", "rtn4", "--out", tmp_path / "o")
    assert code == 143 and "terminated" in err
    assert list(tmp_path.iterdir()) == []  # nothing written, no temporary directory left


def test_eval_arguments_are_checked_before_the_model_loads(capsys, model, text_file, monkeypatch):
    from accel.eval import evaluate

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(evaluate, "load_causal_lm", no_loading)
    for argv, message in [(["--windows", "0"], "--windows must be at least 1"),
                          (["--seq-len", "1"], "--seq-len must be at least 2"),
                          (["--kernels"], "--kernels serves an accel OUT_DIR's quantized weights")]:
        code, _, err = run(capsys, "eval", model, "--data", text_file, *argv)
        assert_one_line_error(code, err, 2, message)


def test_a_kv_map_for_a_hybrid_model_is_refused_for_what_it_is(capsys, tmp_path):
    """It said the --calib had no KV calibration and to run `calibrate --for kv`, which refuses this model."""
    (tmp_path / "calib").mkdir()
    code, _, err = run(capsys, "quantize", "tiny-gdn", "--kv", "semkv", "--calib", tmp_path / "calib", "--out",
                       tmp_path / "o")
    assert_one_line_error(code, err, 2, "need a model whose every layer is full attention")


def test_a_calibration_writes_the_same_bytes_twice(capsys, model, tmp_path, text_file):
    """report.json and calibration.json held wall-clock timings, so no two runs wrote the same bytes."""
    for name in ("a", "b"):
        code, out, _ = run(capsys, "calibrate", model, "--for", "weights,kv", "--data", text_file, "--out",
                           tmp_path / name, "--samples", "2", "--seq-len", "32", "--json")
        assert code == 0 and "seconds" in json.loads(out)["kv"]  # printed, not written
    assert _snapshot(tmp_path / "a") == _snapshot(tmp_path / "b")


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_a_closed_stdout_exits_quietly_as_sigpipe(capsys, model, tmp_path, json_flag):
    """`accel inspect OUT | head`: rich's default and click's both exited 1 ("a check failed")."""
    import signal
    import subprocess
    import sys

    out = tmp_path / "q"
    assert run(capsys, "quantize", model, "--weights", "rtn4", "--out", out)[0] == 0
    proc = subprocess.Popen([sys.executable, "-c", "from accel.cli.main import run; run()", "inspect", str(out),
                             *json_flag], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the first write
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 128 + signal.SIGPIPE and err == ""


# found by a second black-box audit of the contract (2026-12-06)

def test_a_prompt_that_is_not_utf8_is_bad_input(capsys, model):
    """Bytes the locale cannot decode reach Python as lone surrogates; the tokenizer's TypeError was a traceback."""
    for json_flag in ((), ("--json",)):
        code, out, err = run(capsys, "generate", model, "--prompt", "ab\udcff", "--tokens", "2", *json_flag)
        assert_one_line_error(code, err, 2, "--prompt is not valid UTF-8 text")
        assert not json_flag or json.loads(out)["error"]


def test_a_reference_with_a_non_finite_nll_fails_the_eval(capsys, model, tmp_path, text_file):
    """The eval passed (exit 0) with a ΔNLL of null when the reference, not the model, gave NaN."""
    poisoned = make_tiny_llama(tmp_path / "nan", poison="lm_head.weight")
    code, out, err = run(capsys, "eval", model, "--data", text_file, "--windows", "2", "--seq-len", "32",
                         "--reference", poisoned, "--json")
    assert code == 1 and json.loads(out)["delta_nll"] is None
    assert "reference's NLL is not finite" in err and "Traceback" not in err


def test_calibrating_non_finite_weights_is_refused(capsys, tmp_path, text_file):
    """The calibration was written (exit 0), its Hessians NaN, and verify refused it afterwards."""
    poisoned = make_tiny_llama(tmp_path / "nan", poison="model.layers.0.self_attn.q_proj.weight")
    capsys.readouterr()
    code, _, err = run(capsys, "calibrate", poisoned, "--for", "weights", "--data", text_file, "--samples", "1",
                       "--seq-len", "32", "--out", tmp_path / "cal")
    assert_one_line_error(code, err, 2, "'model.layers.0.self_attn.q_proj.weight' holds NaN or Inf values")
    assert not (tmp_path / "cal").exists()


def test_a_source_without_a_tokenizer_is_quantized_with_a_warning(capsys, model, tmp_path):
    """The output was written without one, silently, and its own verify and eval refused it. It is still written
    (export-ane needs no tokenizer), with a warning on stderr and in the JSON report, and verify says why."""
    bare = tmp_path / "bare"
    shutil.copytree(model, bare)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (bare / name).unlink(missing_ok=True)
    code, out, err = run(capsys, "quantize", bare, "--weights", "rtn4", "--out", tmp_path / "q", "--json")
    assert code == 0 and "warning:" in err and "no tokenizer file in the directory" in err
    assert "eval, generate and verify refuse it" in json.loads(out)["warnings"][0]
    code, out, _ = run(capsys, "verify", tmp_path / "q", "--json")
    assert code == 1 and any("no tokenizer file" in e for e in json.loads(out)["errors"])
    code, out, err = run(capsys, "quantize", model, "--weights", "rtn4", "--out", tmp_path / "q2", "--json")
    assert code == 0 and json.loads(out)["warnings"] == [] and "warning" not in err


def test_verify_of_something_that_is_no_accel_output_is_bad_input(capsys, model, tmp_path):
    """A source model, a text file or an empty directory were reported as faults (exit 1), as a damaged output is."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("hello, these are notes\n")
    for path, message in [(model, "not an accel file"), (tmp_path / "notes.txt", "not a safetensors file"),
                          (tmp_path / "empty", "not an accel output directory")]:
        code, _, err = run(capsys, "verify", path)
        assert_one_line_error(code, err, 2, message)


def test_a_container_damaged_past_its_header_length_is_a_fault_in_an_output(capsys, model, tmp_path):
    """A byte flipped where the JSON header begins made the container read as 'not a safetensors file', and verify
    of the output directory exited 2 (bad input) as for a text file: accel.json marks the directory as an output,
    so its unreadable container is damage (exit 1). A lone container cannot be told from another file (exit 2)."""
    out = tmp_path / "q"
    assert run(capsys, "quantize", model, "--weights", "rtn4", "--out", out)[0] == 0
    weights = out / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[8] = ord("x")
    weights.write_bytes(bytes(raw))
    code, stdout, _ = run(capsys, "verify", out, "--json")
    assert code == 1 and json.loads(stdout)["ok"] is False
    assert "not a safetensors file" in json.loads(stdout)["errors"][0]
    code, _, err = run(capsys, "verify", weights)
    assert_one_line_error(code, err, 2, "not a safetensors file")


def test_a_damaged_calibration_is_named_by_its_path(capsys, model, tmp_path, text_file):
    """The message said 'model.safetensors: ...', the name of the source model's own weights file as well."""
    calib = tmp_path / "cal"
    assert run(capsys, "calibrate", model, "--for", "weights", "--data", text_file, "--out", calib,
               "--samples", "2", "--seq-len", "32")[0] == 0
    weights = calib / "weights" / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    start, _ = json.loads(raw[8 : 8 + n])["model.layers.0.self_attn.q_proj.weight"]["data_offsets"]
    raw[8 + n + start + 5] ^= 0x40  # inside a Hessian gptq reads
    weights.write_bytes(bytes(raw))
    code, _, err = run(capsys, "quantize", model, "--weights", "gptq4", "--calib", calib, "--out", tmp_path / "q")
    assert_one_line_error(code, err, 2, f"{weights}: tensor")


def test_windows_longer_than_the_model_positions_are_refused(capsys, model, tmp_path, text_file):
    """eval and calibrate ran past max_position_embeddings (512 here) without a word; generate refused."""
    code, _, err = run(capsys, "eval", model, "--data", text_file, "--windows", "1", "--seq-len", "1024")
    assert_one_line_error(code, err, 2, "--seq-len 1024 is longer than the model's 512 positions")
    code, _, err = run(capsys, "calibrate", model, "--for", "weights", "--data", text_file, "--samples", "1",
                       "--seq-len", "1024", "--out", tmp_path / "cal")
    assert_one_line_error(code, err, 2, "--seq-len 1024 is longer than the model's 512 positions")


def test_an_output_inside_an_input_directory_is_refused(capsys, model, tmp_path, text_file):
    """Nothing was overwritten, but the input changed: the model's directory, or the calibration verify then read
    with the nested output in it."""
    before = _snapshot(model)
    code, _, err = run(capsys, "quantize", model, "--weights", "rtn4", "--out", model / "q4")
    assert_one_line_error(code, err, 2, "lies inside the input")
    calib = tmp_path / "cal"
    assert run(capsys, "calibrate", model, "--for", "weights", "--data", text_file, "--out", calib,
               "--samples", "2", "--seq-len", "32")[0] == 0
    code, _, err = run(capsys, "quantize", model, "--weights", "gptq4", "--calib", calib, "--out", calib / "q")
    assert_one_line_error(code, err, 2, "lies inside the input")
    code, _, err = run(capsys, "calibrate", model, "--for", "weights", "--data", text_file, "--out", model / "c",
                       "--samples", "2", "--seq-len", "32")
    assert_one_line_error(code, err, 2, "lies inside the input")
    assert _snapshot(model) == before and not (calib / "q").exists()


def test_eval_quality_gate(capsys, model, text_file):
    """design.md: a CI job fails loudly when a quality gate is missed; `--max-delta-nll` is that gate (the docs
    promised exit 1 for it while no command had one, 2026-12-06 audit)."""
    args = ("eval", model, "--data", text_file, "--windows", "3", "--seq-len", "32", "--reference", model)
    code, out, err = run(capsys, *args, "--max-delta-nll", "0.01", "--json")
    gate = json.loads(out)["gate"]
    assert code == 0 and gate["passed"] and gate["measure"] == "upper 95% bound" and gate["measured"] == 0.0
    code, out, err = run(capsys, *args, "--max-delta-nll", "-0.5", "--json")
    assert code == 1 and not json.loads(out)["gate"]["passed"] and "quality gate missed" in err
    code, _, err = run(capsys, *args[:-2], "--max-delta-nll", "0.01")
    assert_one_line_error(code, err, 2, "--max-delta-nll needs --reference")


def test_eval_says_when_the_text_holds_fewer_windows_than_asked(capsys, model, text_file):
    """It evaluated fewer without a word (the JSON's `windows` said how many; 2026-12-06 audit)."""
    code, out, err = run(capsys, "eval", model, "--data", text_file, "--windows", "100000", "--seq-len", "256",
                         "--json")
    doc = json.loads(out)
    assert code == 0 and doc["windows"] < 100000 and f"evaluated {doc['windows']}" in doc["warnings"][0]
    assert "warning: the text holds" in err
    code, out, err = run(capsys, "eval", model, "--data", text_file, "--windows", "2", "--seq-len", "32", "--json")
    assert code == 0 and json.loads(out)["warnings"] == [] and "warning" not in err


def _interrupt_after_a_bar(monkeypatch, terminated: bool):
    """quantize_model that draws a bar on an animated terminal, then stops as Ctrl-C or SIGTERM's handler stops it."""
    from accel.cli import common
    from accel.quantize import pipeline

    monkeypatch.setattr(common, "stderr_animates", lambda: True)

    def stopped(model, out, settings, force=False, progress=None, jobs=None, ray=None):
        progress.stage("quantizing", 10)
        progress.advance()
        if terminated:
            common.SIGTERM_SEEN["seen"] = True  # what accel.cli.main._on_sigterm does
            raise common.Terminated()
        raise KeyboardInterrupt()

    monkeypatch.setattr(pipeline, "quantize_model", stopped)


@pytest.mark.parametrize("terminated", [False, True])
def test_an_interrupt_takes_the_bar_down_and_says_so(capsys, monkeypatch, model, tmp_path, terminated):
    """Ctrl-C left the bar drawn and the cursor hidden (rich's live display was never stopped), printed nothing and,
    under --json, no error object; SIGTERM printed 'terminated' and then the bar again."""
    from accel.cli import common
    from accel.cli.main import main

    _interrupt_after_a_bar(monkeypatch, terminated)
    code = main(["quantize", str(model), "--weights", "rtn4", "--out", str(tmp_path / "q"), "--json"])
    out, err = capsys.readouterr()
    word = "terminated" if terminated else "interrupted"
    assert code == (143 if terminated else 130)
    assert json.loads(out) == {"ok": False, "error": word}
    assert err.strip().splitlines()[-1] == word and err.count(word) == 1
    assert not common.BarProgress._live


def test_a_failing_stdout_under_json_is_one_line(monkeypatch, capsys):
    """`accel models --json > /dev/full`: the error report on the same stdout failed again, two chained tracebacks
    and exit 1."""
    from accel.cli import common

    def full(text):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(common, "write_stdout", full)
    from accel.cli.main import main

    code = main(["models", "--json"])
    _, err = capsys.readouterr()
    assert_one_line_error(code, err, 2, "No space left on device")


def test_no_command_prints_the_help_without_an_empty_error(capsys):
    from accel.cli.main import main

    assert main([]) == 2
    out, err = capsys.readouterr()
    assert "Usage" in out and "error" not in err


def test_a_copy_that_fails_is_one_line_with_the_first_file(monkeypatch):
    """copytree's Error (a full disk under export-ane's package copy) printed a list of tuples, 2.5 KB."""
    from accel.cli.main import _os_message

    failures = [("/tmp/a/x", "/out/.p.tmp/x", "[Errno 28] No space left on device: '/tmp/a/x' -> '/out/.p.tmp/x'"),
                ("/tmp/a/y", "/out/.p.tmp/y", "[Errno 28] No space left on device: '/tmp/a/y' -> '/out/.p.tmp/y'")]
    assert _os_message(shutil.Error(failures)) == "No space left on device: /out/.p.tmp/x (and 1 more files)"


def test_a_full_disk_names_the_output(monkeypatch, tmp_path):
    from accel.formats.atomic import output_dir

    with pytest.raises(OSError) as caught, output_dir(tmp_path / "out") as tmp, open(tmp / "w", "wb"):
        raise OSError(28, "No space left on device")
    assert caught.value.filename == str((tmp_path / "out").absolute())
    assert not list(tmp_path.iterdir())


def test_force_over_a_link_replaces_the_link_and_leaves_nothing(capsys, model, tmp_path, monkeypatch):
    """The renamed link was handed to rmtree, which refuses links: a hidden .NAME.old-PID link was left behind."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to("target")
    assert run(capsys, "quantize", model, "--weights", "rtn4", "--out", "link", "--force")[0] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "target"]
    assert (tmp_path / "link").is_dir() and not (tmp_path / "link").is_symlink()


def test_a_dash_path_comes_back_usable(capsys, model, tmp_path, monkeypatch):
    """The report's `out` was '-q' for --out ./-q: passed on, the next command took it for an option."""
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(capsys, "quantize", model, "--weights", "rtn4", "--out", "./-q", "--json")
    assert code == 0 and json.loads(out)["out"] == "./-q"
    assert run(capsys, "inspect", json.loads(out)["out"])[0] == 0


@pytest.mark.parametrize("tty, env, animates", [(True, {"TERM": "xterm"}, True), (True, {"TERM": "dumb"}, False),
                                                (False, {"FORCE_COLOR": "1", "TERM": "xterm"}, False)])
def test_bars_redraw_only_where_the_terminal_can(monkeypatch, tty, env, animates):
    """FORCE_COLOR made rich take a pipe for a terminal: the bar redrew itself into the CI log (19 KB of carriage
    returns and cursor codes); TERM=dumb got neither a bar nor the stage lines."""
    from accel.cli import common

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(common.os, "isatty", lambda fd: tty)
    monkeypatch.setattr(common.sys, "stderr", type("S", (), {"fileno": lambda self: 2})())
    assert common.stderr_animates() is animates


def test_an_encoding_without_the_output_characters_is_not_a_traceback(tmp_path):
    """PYTHONIOENCODING=latin-1: the Δ of ΔNLL raised UnicodeEncodeError (exit 1)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONIOENCODING="latin-1", COLUMNS="200")
    proc = subprocess.run([sys.executable, "-c", "from accel.cli.main import run; run()", "eval", "-h"],
                          capture_output=True, env=env, check=False)
    assert proc.returncode == 0 and b"Traceback" not in proc.stderr and b"?NLL" in proc.stdout


def test_outputs_get_ordinary_permissions_all_the_way_down(tmp_path):
    """coremltools wrote a package's model.mlmodel 0600 and weights/ 0700: unreadable to the other users of a
    shared machine, where every other output file is 0644 (umask 022)."""
    import os

    from accel.formats.atomic import output_dir

    old = os.umask(0o022)
    try:
        with output_dir(tmp_path / "out") as tmp:
            (tmp / "Data" / "weights").mkdir(parents=True)
            os.chmod(tmp / "Data" / "weights", 0o700)
            fd = os.open(tmp / "Data" / "model.mlmodel", os.O_WRONLY | os.O_CREAT, 0o600)
            os.close(fd)
            fd = os.open(tmp / "Data" / "run.sh", os.O_WRONLY | os.O_CREAT, 0o700)
            os.close(fd)
    finally:
        os.umask(old)
    modes = {p.relative_to(tmp_path / "out").as_posix(): p.stat().st_mode & 0o777
             for p in (tmp_path / "out").rglob("*")}
    assert modes == {"Data": 0o755, "Data/weights": 0o755, "Data/model.mlmodel": 0o644, "Data/run.sh": 0o755}


def test_verify_against_another_models_reference_is_bad_input(capsys, model, tmp_path):
    """verify OUT_DIR --reference OTHER listed every tensor's shape as a fault (exit 1), where eval and the package
    verify refuse the wrong model named (exit 2); a reference of the same config is still compared."""
    out = tmp_path / "q"
    assert run(capsys, "quantize", model, "--weights", "rtn4", "--out", out)[0] == 0
    other = make_tiny_llama(tmp_path / "wide", hidden=48)
    capsys.readouterr()  # transformers' save progress
    for json_flag in ((), ("--json",)):
        code, stdout, err = run(capsys, "verify", out, "--reference", other, *json_flag)
        assert_one_line_error(code, err, 2, "--reference has hidden_size=48, the output 40: not the model")
        assert not json_flag or json.loads(stdout)["error"]
    same_shape = make_tiny_llama(tmp_path / "seed1", seed=1)
    capsys.readouterr()
    code, stdout, _ = run(capsys, "verify", out, "--reference", same_shape, "--json")
    report = json.loads(stdout)
    assert code == 0 and report["ok"] and report["max_rel_error"] > 0.5  # other weights: compared, far off


# found by a black-box audit of calibrate and the calibrated maps (2026-12-07)

def test_verify_names_a_calibration_kind_whose_container_is_gone(capsys, model, tmp_path, text_file):
    """verify said ok with weights/model.safetensors removed (quantize then refused the calibration)."""
    calib = tmp_path / "calib"
    assert run(capsys, "calibrate", model, "--for", "weights,kv", "--data", text_file, "--out", calib,
               "--samples", "2", "--seq-len", "32")[0] == 0
    (calib / "weights" / "model.safetensors").unlink()
    code, out, _ = run(capsys, "verify", calib, "--json")
    report = json.loads(out)
    assert code == 1 and report["errors"] == [
        "weights/: no container (*.safetensors), though calibration.json lists --for weights"]


def test_quantize_options_that_would_change_nothing_are_refused(capsys, model, tmp_path, text_file):
    """They were recorded in accel.json as if applied."""
    calib = tmp_path / "calib"
    assert run(capsys, "calibrate", model, "--for", "weights", "--data", text_file, "--out", calib,
               "--samples", "2", "--seq-len", "32")[0] == 0
    out = tmp_path / "o"
    for argv, message in [(["--weights", "rtn4", "--calib", calib], "reads no calibration"),
                          (["--weights", "leech2", "--group", "32"], "drop --group"),
                          (["--weights", "leech2", "--group", "64"], "drop --group"),  # the default, given
                          (["--kv", "semkv", "--layout", "planes", "--calib", calib], "--layout shapes quantized"),
                          (["--kv", "semkv", "--group", "32", "--calib", calib], "--group shapes quantized")]:
        code, _, err = run(capsys, "quantize", model, *argv, "--out", out)
        assert_one_line_error(code, err, 2, message)
        assert not out.exists()
    assert run(capsys, "quantize", model, "--weights", "leech2", "--calib", calib, "--out", out)[0] == 0
    assert json.loads((out / "accel.json").read_text())["settings"]["group"] is None  # Leech reads no group
    assert run(capsys, "quantize", model, "--weights", "rtn4", "--out", out, "--force")[0] == 0
    assert json.loads((out / "accel.json").read_text())["settings"]["group"] == 64  # the default, recorded


def test_a_state_calibration_of_windows_that_never_read_the_state_is_refused(capsys, tmp_path, text_file):
    """--seq-len 33 recorded all-zero sensitivities (NaN in calibration.json), and a water map ranked by them cost
    0.5 nats a token; a map is also refused from statistics that rank nothing."""
    import numpy as np

    from accel.errors import AccelError
    from accel.quantize.damp import parse_damp_arg, risk_score, water_weights

    code, _, err = run(capsys, "calibrate", "tiny-gdn", "--for", "state", "--data", text_file, "--out",
                       tmp_path / "c", "--samples", "2", "--seq-len", "33")
    assert_one_line_error(code, err, 2, "--seq-len must be at least 34, got 33")
    energy, persistence = np.ones((1, 2, 4)), np.ones((1, 2, 4))
    with pytest.raises(AccelError, match="sensitivities are all zero"):
        water_weights({"energy": energy, "persistence": persistence, "sensitivity": np.zeros((1, 2, 4))},
                      "sensitivity")
    with pytest.raises(AccelError, match="error energies hold NaN"):
        risk_score(np.full((1, 2, 4), np.nan), persistence, "both")
    assert parse_damp_arg("6.25,alloc=water").rank == "sensitivity"  # the ranking the zero sensitivities fed


def test_inspect_shows_a_kv_maps_levels():
    """The text line left out every list parameter, SemKV's LLO/LHI among them (--json had them)."""
    from accel.cli.inspect_cmd import _param_text

    assert _param_text([4, 8]) == "4/8" and _param_text(0.5) == "0.5" and _param_text(list(range(9))) is None
