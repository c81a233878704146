"""The map plumbing shared by SemKV and DAMP: written by quantize, read back by eval, checked against the model."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import DynamicCache

from accel.errors import AccelError
from accel.eval.evaluate import EvalSettings, evaluate
from accel.formats.artifact import Artifact
from accel.quantize.maps import MapMethod, Runtime, StoredMap, parse_spec, read_maps
from accel.quantize.pipeline import QuantizeSettings, quantize_model


class _FullPrecisionRuntime(Runtime):
    def __init__(self, model):
        self.model, self.caches = model, 0

    def make_cache(self):
        self.caches += 1
        return DynamicCache(config=self.model.config)

    def report(self):
        return {"test_caches": self.caches}


class _TestMap(MapMethod, kind="kv", name="_test_fp"):
    """A map with one int and one float array per layer; its runtime is the full-precision cache."""

    def build(self, arg, ctx):
        layers = ctx.config["num_hidden_layers"]
        return StoredMap("kv", self.name, {"arg": arg, "layers": layers},
                         {"levels": np.arange(layers) % 7, "weights": np.linspace(0, 1, layers)})

    def from_eval_spec(self, arg, config):
        return self.build(arg, type("Ctx", (), {"config": config})())

    def check(self, stored, config):
        if stored.params["layers"] != config["num_hidden_layers"]:
            raise AccelError(f"the kv map is for {stored.params['layers']} layers, the model has "
                             f"{config['num_hidden_layers']}")

    def runtime(self, stored, model):
        return _FullPrecisionRuntime(model)


def test_parse_spec_names_method_and_arg():
    method, arg = parse_spec("kv", "_test_fp:5/6@0.25")
    assert method.name == "_test_fp" and arg == "5/6@0.25"
    with pytest.raises(AccelError, match="unknown --kv method 'nope'|--kv is not available yet"):
        parse_spec("kv", "nope")


def test_map_round_trips_through_quantize_and_eval(tiny_llama, tmp_path, text_file):
    out = tmp_path / "d"
    report = quantize_model(tiny_llama, out, QuantizeSettings(kv="_test_fp:x"))
    assert report["maps"] == {"kv": "_test_fp"} and report["bits_per_weight"] is None
    art = Artifact(out)
    maps = read_maps(art)
    assert maps["kv"].params == {"arg": "x", "layers": 2}
    assert maps["kv"].arrays["levels"].tolist() == [0, 1]
    np.testing.assert_array_equal(maps["kv"].arrays["weights"], np.float32([0, 1]))
    assert {t for t in art.names if art.entry(t).role == "map"} == {"maps.kv.levels", "maps.kv.weights"}

    settings = EvalSettings(data=text_file, windows=2, seq_len=24)
    decoded = evaluate(out, settings)
    plain = evaluate(tiny_llama, settings)
    assert decoded["kv"]["method"] == "_test_fp" and decoded["test_caches"] == 2
    np.testing.assert_allclose(decoded["window_nll"], plain["window_nll"], rtol=1e-5)
    via_flag = evaluate(tiny_llama, EvalSettings(data=text_file, windows=2, seq_len=24, kv="_test_fp"))
    np.testing.assert_allclose(via_flag["window_nll"], plain["window_nll"], rtol=1e-5)


def test_map_for_another_model_is_refused(tiny_llama, tmp_path, text_file):
    out = tmp_path / "d"
    quantize_model(tiny_llama, out, QuantizeSettings(kv="_test_fp"))
    cfg = Artifact(out).config
    cfg["num_hidden_layers"] = 3  # the map now describes a model with a different depth
    (out / "config.json").write_text(__import__("json").dumps(cfg))
    with pytest.raises(AccelError, match="the kv map is for 2 layers, the model has 3"):
        evaluate(out, EvalSettings(data=text_file, windows=1, seq_len=16))
