"""Calibration's Hessians a decoder layer at a time: the same numbers as whole forward passes, bit for bit, with
only one layer's Hessians in memory, and with the weights read from the source a layer at a time (StreamedModel);
a decoder that does more between its layers than call them is detected and recorded whole."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from accel.calibrate import hessians as H

TINY = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
        "tie_word_embeddings": False}


def _model(arch: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {
        "llama": {},
        "llama-tied": {"tie_word_embeddings": True},
        "mistral": {"sliding_window": 5},  # the masks differ by layer type
        "qwen3": {"head_dim": 8, "layer_types": ["full_attention", "sliding_attention", "full_attention"],
                  "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
        "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},  # fused experts' F.linear hooks, per layer
        "qwen3_next": {"moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "num_experts": 4,
                       "num_experts_per_tok": 2, "head_dim": 8, "linear_num_value_heads": 4,
                       "linear_num_key_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                       "full_attention_interval": 3},  # Gated DeltaNet layers and their own mask
    }[arch]
    torch.manual_seed(0)
    config = AutoConfig.for_model(arch.removesuffix("-tied"), **{**TINY, **extra})
    return AutoModelForCausalLM.from_config(config).eval()


def _both_ways(model, windows, monkeypatch):
    """(layer-by-layer Hessians, whole-model Hessians, key tables, whether the layer-by-layer path ran)."""
    ran = []
    original = H._layer_by_layer
    monkeypatch.setattr(H, "_layer_by_layer", lambda *a, **k: (ran.append(True), original(*a, **k)))
    streamed, flushes = {}, []

    def sink(part):
        assert not set(part) & set(streamed)  # each Hessian handed over once, finished
        flushes.append(len(part))
        streamed.update(part)

    _, keys = H.collect_hessians(model, windows, sink=sink)
    whole, whole_keys = H.collect_hessians(model, windows, layer_by_layer=False)
    return streamed, whole, keys, whole_keys, bool(ran), flushes


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3", "mixtral", "qwen3_next"])
def test_layer_by_layer_hessians_are_the_whole_models_bit_for_bit(arch, monkeypatch):
    model = _model(arch)
    windows = np.random.default_rng(1).integers(0, 96, (3, 24))
    streamed, whole, keys, whole_keys, ran, flushes = _both_ways(model, windows, monkeypatch)
    assert ran, "the layer-by-layer path was not taken"
    assert keys == whole_keys and set(streamed) == set(whole) and whole
    for key, h in whole.items():
        assert np.array_equal(streamed[key], h), key
    assert len(flushes) == model.config.num_hidden_layers  # one layer's Hessians at a time


@pytest.mark.parametrize("alias", ["tiny-gdn", "tiny-kda"])
def test_layer_by_layer_on_the_trained_fixtures(alias, monkeypatch):
    from accel.eval.load import load_causal_lm

    model = load_causal_lm(alias).model
    windows = np.random.default_rng(2).integers(0, model.config.vocab_size, (2, 40))
    streamed, whole, keys, whole_keys, ran, _ = _both_ways(model, windows, monkeypatch)
    assert ran and keys == whole_keys and set(streamed) == set(whole)
    assert all(np.array_equal(streamed[k], whole[k]) for k in whole)


class ToyDecoderLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, hidden, scale=1.0):
        return self.proj(hidden) * scale


class ToyBody(torch.nn.Module):
    def __init__(self, doubles_between: bool):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleList([ToyDecoderLayer() for _ in range(3)])
        self.doubles_between = doubles_between

    def forward(self, input_ids, use_cache=False):
        hidden = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, scale=0.5 + i)
            if self.doubles_between:
                hidden = hidden * 2  # work the layer-by-layer pass cannot see
        return hidden


class Toy(torch.nn.Module):
    base_model_prefix = "model"

    def __init__(self, doubles_between: bool):
        super().__init__()
        torch.manual_seed(3)
        self.model = ToyBody(doubles_between)


@pytest.mark.parametrize("doubles_between", [False, True])
def test_a_decoder_with_work_between_its_layers_is_recorded_whole(doubles_between, monkeypatch):
    """Each layer's Hessian against its inputs captured directly: right both ways, and layer by layer only where
    that reproduces the decoder (a per-layer keyword argument, scale, is passed through)."""
    model = Toy(doubles_between)
    windows = np.random.default_rng(4).integers(0, 16, (2, 5))
    streamed, whole, _, _, ran, _ = _both_ways(model, windows, monkeypatch)
    assert ran != doubles_between
    inputs = {i: [] for i in range(3)}
    handles = [layer.proj.register_forward_pre_hook(lambda _m, args, i=i: inputs[i].append(args[0][0]))
               for i, layer in enumerate(model.model.layers)]
    with torch.inference_mode():
        for window in windows:
            model.model(torch.from_numpy(window)[None])
    for h in handles:
        h.remove()
    for i in range(3):
        x = torch.cat(inputs[i]).double().numpy()
        key = f"model.layers.{i}.proj.weight"
        np.testing.assert_allclose(whole[key], x.T @ x / windows.size, rtol=1e-5, atol=1e-7)  # float32 products
        assert np.array_equal(streamed[key], whole[key])


@pytest.mark.parametrize("arch", ["llama", "llama-tied", "mistral", "qwen3", "mixtral", "qwen3_next"])
def test_streamed_weights_give_the_resident_models_hessians(arch, tmp_path, monkeypatch):
    """The model saved as a checkpoint (Mixtral's and Qwen3-Next's experts under their per-expert checkpoint names)
    and calibrated from it with its weights read a layer at a time: the Hessians of the model in memory, bit for
    bit, and never two decoder layers' weights loaded at once."""
    from accel.converters import open_model
    from accel.converters.streamed import StreamedModel

    model = _model(arch)
    model.save_pretrained(tmp_path / "m")
    windows = np.random.default_rng(5).integers(0, 96, (3, 24))
    resident, resident_keys = H.collect_hessians(model, windows)
    layers_at_once = []
    with open_model(tmp_path / "m") as source:
        streamed = StreamedModel(source)
        load = streamed.load

        def load_and_count(within):
            load(within)
            loaded = {name.split(".")[2] for name, p in streamed.model.named_parameters()
                      if name.startswith("model.layers.") and p.device.type != "meta"}
            layers_at_once.append(len(loaded))

        monkeypatch.setattr(streamed, "load", load_and_count)
        hessians, keys = H.collect_hessians(streamed.model, windows, streamed=streamed)
        assert streamed.loaded_bytes() < sum(p.nbytes for p in model.parameters()) / 2  # the layers released
    assert keys == resident_keys and set(hessians) == set(resident) and resident
    assert all(np.array_equal(hessians[k], resident[k]) for k in resident)
    assert max(layers_at_once) == 1


def test_streamed_calibration_writes_the_same_files(tiny_llama, text_file, tmp_path, monkeypatch):
    """`accel calibrate --for weights` reads the weights a layer at a time; its weights/ files are the bytes of the
    same calibration with the model built whole."""
    import contextlib

    from accel.calibrate.run import CalibSettings, calibrate
    from accel.eval import load

    settings = CalibSettings(samples=3, seq_len=32)
    calibrate(str(tiny_llama), text_file, tmp_path / "streamed", ["weights"], settings)
    used = []

    @contextlib.contextmanager
    def whole(spec, progress, message):
        used.append(spec)
        yield load.load_causal_lm(spec, progress)

    monkeypatch.setattr(load, "streamed_causal_lm", whole)
    calibrate(str(tiny_llama), text_file, tmp_path / "whole", ["weights"], settings)
    assert used  # the second calibration built the model whole
    files = sorted(p.name for p in (tmp_path / "whole" / "weights").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "streamed" / "weights").iterdir())
    for name in files:
        assert (tmp_path / "whole" / "weights" / name).read_bytes() == \
            (tmp_path / "streamed" / "weights" / name).read_bytes()
