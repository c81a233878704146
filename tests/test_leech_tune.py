"""`accel quantize --tune-steps`: Leech row scales refit by KL to the source; codes untouched, deterministic."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from accel.calibrate.hessians import HessianStore
from accel.calibrate.run import CalibSettings, calibrate
from accel.converters import build_transformers_model, open_model
from accel.errors import AccelError
from accel.formats.artifact import Artifact
from accel.formats.tensor import decode_parts
from accel.quantize.leech_tune import TunedLeechLinear, _unit_scale_core, kl_to_reference, tune_leech_scales
from accel.quantize.pipeline import QuantizeSettings, quantize_model


@pytest.fixture(scope="module")
def calib(tiny_llama, text_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("tune") / "calib"
    calibrate(str(tiny_llama), text_file, out, ["weights"], CalibSettings(samples=6, seq_len=32))
    return out


def _source(model):
    with open_model(str(model)) as src:
        return dict(src.config), {n: src.load_tensor(n) for n in src.tensor_names()}


def _leech_arrays(out):
    from safetensors.numpy import load_file

    return load_file(str(out / "model.safetensors"))


def test_calibration_keeps_its_windows(calib):
    windows = HessianStore(calib).windows()
    assert windows.shape == (6, 32) and windows.dtype == np.int64 and windows.min() >= 0


def test_tuned_layer_matches_the_codec_decode(calib, tiny_llama, tmp_path):
    out = tmp_path / "l4"
    quantize_model(str(tiny_llama), out, QuantizeSettings(weights="leech4", calib=str(calib)), jobs=1)
    art = Artifact(out)
    name = "model.layers.0.mlp.down_proj.weight"
    entry = art.entry(name)
    arrays = _leech_arrays(out)
    layer = TunedLeechLinear(_unit_scale_core(entry, arrays), arrays[entry.parts["scale"]], entry.params["seed_out"])
    x = torch.randn(3, entry.shape[1])
    w = decode_parts(entry, {p: arrays[s] for p, s in entry.parts.items()})
    np.testing.assert_allclose(layer(x).detach().numpy(), x.numpy() @ w.T, rtol=1e-4, atol=1e-5)


def test_tuning_keeps_the_codes_lowers_the_kl_and_is_deterministic(calib, tiny_llama, tmp_path):
    plain, tuned, again = tmp_path / "plain", tmp_path / "tuned", tmp_path / "again"
    quantize_model(str(tiny_llama), plain, QuantizeSettings(weights="leech4", calib=str(calib)), jobs=1)
    report = quantize_model(str(tiny_llama), tuned, QuantizeSettings(weights="leech4", calib=str(calib),
                                                                     tune_steps=6), jobs=1)
    quantize_model(str(tiny_llama), again, QuantizeSettings(weights="leech4", calib=str(calib), tune_steps=6),
                   jobs=1)
    assert report["tune"]["steps"] == 6 and report["tune"]["tensors"] == 14
    a, b = _leech_arrays(plain), _leech_arrays(tuned)
    assert a.keys() == b.keys()
    moved = 0
    for key in a:
        if key.endswith(":scale"):
            moved += int(not np.array_equal(a[key], b[key]))
        else:
            assert np.array_equal(a[key], b[key]), key  # codes and kept tensors bit-identical
    assert moved > 0
    assert Artifact(plain).bits_per_weight() == Artifact(tuned).bits_per_weight()
    for f in sorted(p.name for p in tuned.iterdir()):  # same inputs and seed: same bytes
        assert (tuned / f).read_bytes() == (again / f).read_bytes(), f

    config, source = _source(tiny_llama)
    windows = torch.from_numpy(HessianStore(calib).windows())
    teacher = build_transformers_model(config, source)

    def kl(out):
        art = Artifact(out)
        tensors = dict(source)
        tensors.update({n: art.decode(n) for n in art.names if art.entry(n).role == "quantized"})
        with torch.no_grad():
            return float(kl_to_reference(teacher, build_transformers_model(config, tensors), windows))

    assert kl(tuned) < kl(plain)


def test_tuning_with_zero_steps_changes_nothing(calib, tiny_llama, tmp_path):
    out = tmp_path / "l2"
    quantize_model(str(tiny_llama), out, QuantizeSettings(weights="leech2", calib=str(calib)), jobs=1)
    art = Artifact(out)
    arrays = _leech_arrays(out)
    encoded = [(art.entry(n), {s: arrays[s] for s in art.entry(n).parts.values()}) for n in art.names]
    before = {k: v.copy() for k, v in arrays.items()}
    config, source = _source(tiny_llama)
    assert tune_leech_scales(config, source, encoded, HessianStore(calib).windows(), 0)["steps"] == 0
    assert all(np.array_equal(before[k], arrays[k]) for k in before)


@pytest.mark.parametrize("settings", [
    QuantizeSettings(weights="gptq4", calib="x", tune_steps=4),
    QuantizeSettings(weights="leech4", tune_steps=4),
    QuantizeSettings(weights="leech4", calib="x", tune_steps=-1),
])
def test_tune_steps_needs_leech_and_calibration(settings, tiny_llama, tmp_path):
    with pytest.raises(AccelError, match="tune-steps"):
        quantize_model(str(tiny_llama), tmp_path / "o", settings, jobs=1)
