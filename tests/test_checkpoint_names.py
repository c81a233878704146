"""Checkpoints in their published names: per-expert tensors merged and Kimi-Linear's renames, as transformers'
own from_pretrained applies them, and everything accel does on such a checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_tiny_llama
from test_cli import run

from accel.converters.checkpoint_names import name_map, to_model_shapes
from accel.errors import AccelError


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Path:
    """A tiny Mixtral saved by transformers: its file has the published per-expert names (block_sparse_moe.experts.
    <i>.w1/w2/w3), which the model it builds has not (mlp.experts.gate_up_proj / down_proj)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    out = tmp_path_factory.mktemp("models") / "mixtral"
    tokenizer_source = make_tiny_llama(tmp_path_factory.mktemp("models") / "tok")
    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=320, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=256, tie_word_embeddings=False)
    MixtralForCausalLM(config).save_pretrained(out)
    for f in tokenizer_source.glob("tokenizer*"):
        shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def kimi_published(tmp_path_factory) -> Path:
    """The tiny-kda fixture as transformers saves it: Kimi-Linear's published names (self_attn.f_a_proj, q/k/v_conv1d
    apart, block_sparse_moe.*), where accel's fixture holds the model's own."""
    from accel.converters.aliases import resolve_alias
    from accel.eval.load import load_causal_lm

    out = tmp_path_factory.mktemp("models") / "kimi"
    load_causal_lm("tiny-kda").model.save_pretrained(out)
    for f in Path(resolve_alias("tiny-kda")).glob("tokenizer*"):
        shutil.copy(f, out / f.name)
    return out


def _names(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "np") as f:
        return list(f.keys())


def _assert_builds_as_transformers_loads_it(path: Path) -> None:
    """build_transformers_model on the checkpoint's own tensors gives from_pretrained's logits, bit for bit."""
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    from accel.converters import build_transformers_model

    config = json.loads((path / "config.json").read_text())
    ours = build_transformers_model(config, load_file(str(path / "model.safetensors")))
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, 320, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, theirs(ids).logits)


def test_mixtral_builds_as_transformers_loads_it(mixtral):
    assert any(".experts.3.w2.weight" in n for n in _names(mixtral))
    _assert_builds_as_transformers_loads_it(mixtral)


def test_the_name_map(mixtral):
    shapes = {}
    from safetensors import safe_open

    with safe_open(str(mixtral / "model.safetensors"), "np") as f:
        shapes = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}  # noqa: SIM118
    names = name_map("mixtral", shapes)
    merged = names.merged["model.layers.1.mlp.experts.gate_up_proj"][1]
    assert merged == [[f"model.layers.1.block_sparse_moe.experts.{i}.w{k}.weight" for i in range(4)] for k in (1, 3)]
    assert names.model_name("model.layers.0.block_sparse_moe.gate.weight") == "model.layers.0.mlp.gate.weight"
    assert names.model_name("model.layers.0.block_sparse_moe.experts.0.w1.weight") is None
    model_shapes = to_model_shapes("mixtral", shapes)
    assert model_shapes["model.layers.0.mlp.experts.gate_up_proj"] == (4, 128, 48)
    assert model_shapes["model.layers.0.mlp.experts.down_proj"] == (4, 48, 64)
    assert to_model_shapes("mixtral", model_shapes) == model_shapes  # the model's own names pass unchanged
    assert to_model_shapes("llama", shapes) == shapes  # no mapping for the type: nothing changes

    gap = {n: s for n, s in shapes.items() if ".experts.2." not in n}
    with pytest.raises(AccelError, match="numbered"):
        name_map("mixtral", gap)
    no_up = {n: s for n, s in shapes.items() if not n.endswith(".w3.weight")}
    with pytest.raises(AccelError, match="missing tensors"):
        name_map("mixtral", no_up)


def test_a_mixtral_checkpoint_through_the_cli(capsys, mixtral, tmp_path, text_file):
    """It was refused ('unexpected tensor ... experts.0.w1.weight'): quantize, verify, eval with and without the
    kernels (the experts decoded into the merged parameter, the other layers on QuantLinear), generate."""
    out = tmp_path / "q"
    code, stdout, err = run(capsys, "quantize", mixtral, "--weights", "rtn4", "--out", out, "--json")
    assert code == 0, err
    from accel.formats.artifact import Artifact

    art = Artifact(out)
    assert sorted(art.model_shapes()) == sorted(_names(mixtral))  # the output keeps the checkpoint's names
    art.close()
    code, stdout, _ = run(capsys, "verify", out, "--reference", mixtral, "--json")
    assert code == 0 and json.loads(stdout)["max_rel_error"] < 0.2
    args = ["--data", text_file, "--windows", "2", "--seq-len", "48", "--json"]
    code, stdout, err = run(capsys, "eval", out, "--reference", mixtral, *args)
    assert code == 0, err
    dense = json.loads(stdout)
    assert abs(dense["delta_nll"]) < 0.05
    code, stdout, err = run(capsys, "eval", out, "--kernels", *args)
    assert code == 0, err
    assert json.loads(stdout)["nll"] == pytest.approx(dense["nll"], rel=1e-5)
    assert run(capsys, "generate", out, "--prompt", "The for", "--tokens", "4", "--kernels")[0] == 0


def test_each_expert_gets_the_hessian_of_the_tokens_routed_to_it(mixtral):
    """Experts are slices of one fused parameter that transformers multiplies by with F.linear, per routed token
    group: calibration records xᵀx of exactly those tokens for gate/up, and of act(gate)·up for down."""
    from accel.calibrate.hessians import collect_hessians, expert_key
    from accel.eval.load import load_causal_lm

    model = load_causal_lm(mixtral).model
    window = np.random.default_rng(0).integers(0, 320, (1, 40))
    experts = model.model.layers[1].mlp.experts
    seen = {}

    def grab(_module, args):
        seen["hidden"], seen["routes"] = args[0].detach().clone(), args[1].detach().clone()

    handle = experts.register_forward_pre_hook(grab)
    try:
        hessians, key_of = collect_hessians(model, window)
    finally:
        handle.remove()
    hidden, routes = seen["hidden"].double(), seen["routes"]
    checked = 0
    for e in range(4):
        rows = (routes == e).any(dim=-1)
        key = expert_key("model.layers.1.mlp.experts.gate_up_proj", e)
        if not rows.any():
            assert key not in key_of
            continue
        x = hidden[rows]
        ref = (x.T @ x).numpy() / 40  # float64; the recording multiplies in float32 as for every layer
        np.testing.assert_allclose(hessians[key_of[key]], ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())
        gate, up = (x @ experts.gate_up_proj[e].double().T).chunk(2, dim=-1)
        mid = torch.nn.functional.silu(gate) * up
        down = hessians[key_of[expert_key("model.layers.1.mlp.experts.down_proj", e)]]
        ref = (mid.T @ mid).numpy() / 40
        np.testing.assert_allclose(down, ref, rtol=1e-4, atol=1e-6 * np.abs(ref).max())
        checked += 1
    assert checked >= 2
    assert torch.nn.functional.linear is torch._C._nn.linear  # the wrapper is gone


def test_gptq_and_leech_on_a_mixture_of_experts(capsys, mixtral, tmp_path, text_file):
    """They were refused: calibration recorded nn.Linear inputs only. Routers stay in source precision."""
    calib = tmp_path / "cal"
    assert run(capsys, "calibrate", mixtral, "--for", "weights", "--data", text_file, "--out", calib,
               "--samples", "4", "--seq-len", "64")[0] == 0
    args = ["--data", text_file, "--windows", "2", "--seq-len", "48", "--reference", mixtral, "--json"]
    for weights in ("gptq4", "leech2"):
        out = tmp_path / weights
        code, stdout, err = run(capsys, "quantize", mixtral, "--weights", weights, "--calib", calib, "--out", out,
                                "--json")
        assert code == 0, err
        code, stdout, err = run(capsys, "inspect", out, "--json")
        tensors = {t["name"]: t for t in json.loads(stdout)["tensors"]}
        assert tensors["model.layers.0.block_sparse_moe.gate.weight"]["codec"] == "raw"
        assert tensors["model.layers.0.block_sparse_moe.experts.3.w2.weight"]["codec"] != "raw"
        code, stdout, err = run(capsys, "eval", out, *args)
        assert code == 0 and abs(json.loads(stdout)["delta_nll"]) < 0.05, err
    code, _, err = run(capsys, "quantize", mixtral, "--weights", "leech2", "--calib", calib, "--tune-steps", "1",
                       "--out", tmp_path / "tuned")  # a traceback after the whole quantization
    assert code == 2 and "Traceback" not in err and "drop --tune-steps" in err
    assert not (tmp_path / "tuned").exists()


def test_an_expert_without_calibration_inputs_is_named():
    from accel.converters.checkpoint_names import name_map
    from accel.quantize.pipeline import QuantizeSettings, _hessian_name

    shapes = {f"model.layers.0.mlp.experts.{e}.{p}.weight": (8, 4) for e in range(2)
              for p in ("gate_proj", "up_proj", "down_proj")}
    names = name_map("qwen2_moe", shapes)
    recorded = {"model.layers.0.mlp.experts.gate_up_proj.0": "k"}
    assert _hessian_name("model.layers.0.mlp.experts.0.up_proj.weight", names, QuantizeSettings(weights="gptq4"),
                         recorded) == "model.layers.0.mlp.experts.gate_up_proj.0"
    # expert 1 was never routed to: rounded to nearest; down_proj has no expert recorded (an old calibration): refused
    assert _hessian_name("model.layers.0.mlp.experts.1.gate_proj.weight", names, QuantizeSettings(weights="gptq4"),
                         recorded) == "unreached:model.layers.0.mlp.experts.gate_up_proj.1"
    with pytest.raises(AccelError, match=r"expert 1 of model.layers.0.mlp.experts.down_proj\): no calibration"):
        _hessian_name("model.layers.0.mlp.experts.1.down_proj.weight", names, QuantizeSettings(weights="gptq4"),
                      recorded)


def test_experts_no_token_reached_are_rounded_to_nearest(capsys, tmp_path, text_file):
    """gptq/leech refused a model whose calibration left an expert without routed tokens (common with many
    experts and few samples); such an expert is now quantized with an identity Hessian (round to nearest: its
    layer's pooled Hessians measured worse, docs/architecture.md), said once on stderr, and the output verifies and
    evaluates."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from accel.calibrate.hessians import HessianStore, recorded_experts

    model = tmp_path / "mixtral8"
    torch.manual_seed(1)
    config = MixtralConfig(vocab_size=320, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=1,
                           max_position_embeddings=256)
    MixtralForCausalLM(config).save_pretrained(model)
    for f in make_tiny_llama(tmp_path / "tok").glob("tokenizer*"):
        shutil.copy(f, model / f.name)
    calib = tmp_path / "cal"  # 4 tokens, top-1 of 8 experts: at least 4 experts of each layer never reached
    assert run(capsys, "calibrate", model, "--for", "weights", "--data", text_file, "--out", calib, "--samples", "1",
               "--seq-len", "4")[0] == 0
    store = HessianStore(calib)
    param = "model.layers.1.mlp.experts.gate_up_proj"
    reached = recorded_experts(param, store.key_of)
    assert 1 <= len(reached) <= 4
    unreached = next(e for e in range(8) if f"{param}.{e}" not in reached)
    np.testing.assert_array_equal(store.get(f"unreached:{param}.{unreached}", 48), np.eye(48))
    out = tmp_path / "q"
    code, stdout, err = run(capsys, "quantize", model, "--weights", "gptq3", "--calib", calib, "--out", out, "--json")
    assert code == 0, err
    assert "got no calibration token" in err and "rounded to nearest" in err
    assert any("got no calibration token" in w for w in json.loads(stdout)["warnings"])
    code, stdout, _ = run(capsys, "inspect", out, "--json")
    tensors = {t["name"]: t for t in json.loads(stdout)["tensors"]}
    assert tensors[f"model.layers.1.block_sparse_moe.experts.{unreached}.w1.weight"]["codec"] != "raw"
    code, stdout, err = run(capsys, "verify", out, "--reference", model, "--json")
    assert code == 0 and json.loads(stdout)["ok"], err
    code, stdout, err = run(capsys, "eval", out, "--data", text_file, "--windows", "2", "--seq-len", "32",
                            "--reference", model, "--json")
    assert code == 0 and np.isfinite(json.loads(stdout)["delta_nll"]), err


def test_kimi_linear_in_its_published_names(capsys, kimi_published, tmp_path, text_file):
    """Renamed (forget_gate.*), joined (conv1d from q/k/v_conv1d) and its MLPs under block_sparse_moe: the same
    model as accel's fixture, and a calibration's Hessians found by the model's names for gptq."""
    names = _names(kimi_published)
    assert "model.layers.0.self_attn.f_a_proj.weight" in names and "model.layers.0.self_attn.q_conv1d.weight" in names
    args = ["--data", text_file, "--windows", "2", "--seq-len", "48", "--json"]
    code, stdout, err = run(capsys, "eval", kimi_published, "--reference", "tiny-kda", *args)
    assert code == 0, err
    assert json.loads(stdout)["delta_nll"] == 0.0
    calib = tmp_path / "cal"
    assert run(capsys, "calibrate", kimi_published, "--for", "weights", "--data", text_file, "--out", calib,
               "--samples", "2", "--seq-len", "32")[0] == 0
    out = tmp_path / "g"
    code, _, err = run(capsys, "quantize", kimi_published, "--weights", "gptq4", "--calib", calib, "--out", out)
    assert code == 0, err
    code, stdout, err = run(capsys, "eval", out, *args)
    dense = json.loads(stdout)
    code, stdout, err = run(capsys, "eval", out, "--kernels", *args)
    assert code == 0, err
    assert json.loads(stdout)["nll"] == pytest.approx(dense["nll"], rel=1e-5)
    assert np.isfinite(dense["nll"])


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory) -> Path:
    """A tiny Qwen3-Next (Gated DeltaNet with joint qkvz / ba projections, mixture-of-experts MLPs) as transformers
    saves it: per-expert tensors."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    out = tmp_path_factory.mktemp("models") / "qwen3-next"
    tokenizer_source = make_tiny_llama(tmp_path_factory.mktemp("models") / "tok")
    torch.manual_seed(0)
    config = Qwen3NextConfig(vocab_size=320, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                             shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                             linear_value_head_dim=16, max_position_embeddings=256, full_attention_interval=4,
                             tie_word_embeddings=False)
    Qwen3NextForCausalLM(config).save_pretrained(out)
    for f in tokenizer_source.glob("tokenizer*"):
        shutil.copy(f, out / f.name)
    return out


def test_qwen3_next_decay_input_is_the_models_own_split(qwen3_next):
    """DAMP's persistence reads the decay input a; Qwen3-Next computes it from a joint b/a projection."""
    from accel.calibrate.state import decay_input_of_ba
    from accel.eval.load import load_causal_lm

    mixer = load_causal_lm(qwen3_next).model.model.layers[0].linear_attn
    hidden = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        qkvz, ba = mixer.in_proj_qkvz(hidden), mixer.in_proj_ba(hidden)
        *_, a = mixer.fix_query_key_value_ordering(qkvz, ba)
        assert torch.equal(decay_input_of_ba(mixer, ba), a)


def test_a_qwen3_next_checkpoint_through_damp(capsys, qwen3_next, tmp_path, text_file):
    """calibrate --for state found no Gated DeltaNet module (it looked for Qwen3.5's in_proj_a), and the checkpoint's
    experts were refused before that."""
    _assert_builds_as_transformers_loads_it(qwen3_next)
    calib, out = tmp_path / "cal", tmp_path / "q"
    assert run(capsys, "calibrate", qwen3_next, "--for", "state", "--data", text_file, "--out", calib,
               "--samples", "2", "--seq-len", "40")[0] == 0
    code, _, err = run(capsys, "quantize", qwen3_next, "--weights", "rtn4", "--state", "damp", "--calib", calib,
                       "--out", out)
    assert code == 0, err
    code, stdout, err = run(capsys, "eval", out, "--reference", qwen3_next, "--data", text_file, "--windows", "2",
                            "--seq-len", "32", "--json")
    assert code == 0, err
    report = json.loads(stdout)
    assert 9 < report["state_bits_per_value"] < 10 and abs(report["delta_nll"]) < 0.05


def test_a_tensor_held_twice_is_refused():
    """Under its checkpoint name and its model name, or per expert and merged: one copy won silently."""
    shapes = {"model.layers.0.block_sparse_moe.gate.weight": (4, 8), "model.layers.0.mlp.gate.weight": (4, 8)}
    with pytest.raises(AccelError, match="holds it twice"):
        name_map("mixtral", shapes)
    experts = {f"model.layers.0.mlp.experts.{e}.{p}.weight": (8, 4) for e in range(2)
               for p in ("gate_proj", "up_proj", "down_proj")}
    with pytest.raises(AccelError, match="holds it twice"):
        name_map("qwen2_moe", {**experts, "model.layers.0.mlp.experts.down_proj": (2, 4, 8)})


def test_a_router_is_known_by_its_model_name():
    """GraniteMoE's router is router.layer.weight in its checkpoints: it was quantized, and gptq then asked for a
    Hessian calibration never records."""
    from accel.quantize.methods import is_quantizable

    name = "model.layers.0.block_sparse_moe.router.layer.weight"
    model = name_map("granitemoe", {name: (4, 32)}).model_name(name)
    assert model == "model.layers.0.block_sparse_moe.router.weight"
    assert is_quantizable(name, (4, 32)) and not is_quantizable(model, (4, 32))
