"""QuantLinear against the float64 reference, and a quantized model served through it against the dense decode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from accel.formats.tensor import encode_tensor
from accel.kernels import _build

pytestmark = pytest.mark.skipif(not _build.compiler_available(), reason="no C compiler for the accel CPU kernels")


def _layer(rng, codec, shape, **params):
    from accel.kernels import kernel_weight
    from accel.kernels.quant_linear import QuantLinear
    from accel.kernels.reference import reference_weight

    entry, arrays = encode_tensor("w", rng.standard_normal(shape), codec, **params)
    parts = {p: arrays[n] for p, n in entry.parts.items()}
    bias = torch.from_numpy(rng.standard_normal(shape[0]).astype(np.float32))
    return QuantLinear(kernel_weight(entry, parts), bias), reference_weight(entry, parts), bias.double().numpy()


@pytest.mark.parametrize("codec,params", [
    ("affine", {"levels": 16, "group": 64}),
    ("affine", {"levels": 3, "group": 32, "layout": "base"}),
    ("leech", {"shells": (13,), "layout": "planes", "seed_in": 3, "seed_out": 4}),
    ("leech", {"shells": (13, 3), "layout": "onehot", "seed_in": 3, "seed_out": 4}),
], ids=["int4", "base3", "leech2-planes", "leech3-onehot"])
@pytest.mark.parametrize("lead", [(1,), (1, 1), (7,), (2, 5)], ids=["vec", "1x1", "7", "2x5"])
@pytest.mark.parametrize("path", ["matvec", "tiles"])
def test_quant_linear_matches_reference(rng, codec, params, lead, path):
    shape = (45, 70)
    layer, w, b = _layer(rng, codec, shape, **params)
    layer.tile_rows = 16  # several tiles, the last one short
    layer.matvec_rows = 0 if path == "tiles" else 32  # rows through the decoded tiles, or one fused matvec each
    x = torch.from_numpy(rng.standard_normal((*lead, shape[1])).astype(np.float32))
    y = layer(x)
    assert y.shape == (*lead, shape[0]) and y.dtype == torch.float32
    ref = x.double().numpy() @ w.T + b
    err = np.linalg.norm(y.double().numpy() - ref) / np.linalg.norm(ref)
    assert err < 1e-5


def test_one_row_in_every_form_gives_the_fast_paths_result(rng):
    """A float32 contiguous row goes straight to the kernel; a strided, bfloat16 or grad-tracking row takes the
    converting path: the same numbers (bf16 rounded once on the way out), and never a graph for autograd."""
    layer, _, _ = _layer(rng, "leech", (45, 72), shells=(13,), layout="planes", seed_in=3, seed_out=4)
    x = torch.from_numpy(rng.standard_normal((1, 1, 72)).astype(np.float32))
    fast = layer(x)
    strided = torch.zeros(1, 1, 144)
    strided[..., ::2] = x
    assert torch.equal(layer(strided[..., ::2]), fast)
    half = layer(x.bfloat16())
    assert half.dtype == torch.bfloat16 and torch.equal(half, layer(x.bfloat16().float()).bfloat16())
    tracked = layer(x.clone().requires_grad_(True))
    assert torch.equal(tracked, fast) and not tracked.requires_grad


def test_quant_linear_rejects_wrong_width(rng):
    layer, _, _ = _layer(rng, "affine", (8, 16), levels=16, group=8)
    with pytest.raises(ValueError, match="16 input features"):
        layer(torch.zeros(1, 15))


@pytest.fixture(scope="module")
def quantized_tiny(tiny_llama, tmp_path_factory):
    from accel.quantize.pipeline import QuantizeSettings, quantize_model

    out = {}
    for method, layout in (("rtn4", None), ("leech2", None), ("leech3", "onehot")):
        path = tmp_path_factory.mktemp("kernels") / f"{method}-{layout}"
        quantize_model(str(tiny_llama), path, QuantizeSettings(weights=method, layout=layout), jobs=1)
        out[method] = path
    return out


@pytest.mark.parametrize("method", ["rtn4", "leech2", "leech3"])
def test_model_through_kernels_matches_dense_decode(quantized_tiny, text_file, method):
    from accel.eval.load import load_causal_lm
    from accel.kernels.quant_linear import QuantLinear

    kern = load_causal_lm(quantized_tiny[method], kernels=True)
    dense = load_causal_lm(quantized_tiny[method])
    layers = [m for m in kern.model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 14  # 2 blocks x (q, k, v, o, gate, up, down)
    ids = kern.tokenizer(text_file.read_text()[:400], return_tensors="pt").input_ids[:, :48]
    with torch.inference_mode():
        a, b = kern.model(input_ids=ids).logits, dense.model(input_ids=ids).logits  # tiled path
        assert float((a - b).abs().max()) < 1e-4
        out = kern.model(input_ids=ids[:, :5], use_cache=True)  # then one token at a time: the fused matvec
        step = kern.model(input_ids=ids[:, 5:6], cache=out.cache, use_cache=True).logits
        ref = dense.model(input_ids=ids[:, :6]).logits[:, -1:]
        assert float((step - ref).abs().max()) < 1e-4


def test_eval_with_kernels_matches_dense(quantized_tiny, text_file, capsys):
    import json

    from accel.cli.main import main

    results = {}
    for method in ("rtn4", "leech2"):
        for flags in ((), ("--kernels",)):
            argv = ["eval", str(quantized_tiny[method]), "--data", str(text_file), "--windows", "3", "--seq-len",
                    "64", "--json", *flags]
            assert main(argv) == 0
            results[method, flags] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        dense, kern = results[method, ()], results[method, ("--kernels",)]
        assert kern["ppl"] == pytest.approx(dense["ppl"], rel=1e-5)
        assert kern["windows"] == dense["windows"] == 3


def _on_a_q8_grid(weight):
    """Put a 2-D parameter's rows on a Q8_0-like grid (one group a row) in place; returns that grid."""
    d = (weight.detach().abs().amax(dim=1, keepdim=True) / 127).numpy().astype(np.float16)
    q = np.rint(weight.detach().numpy() / d.astype(np.float32)).clip(-128, 127) + 0.0  # no -0.0: GGUF's q are ints
    with torch.no_grad():
        weight.copy_(torch.from_numpy(d.astype(np.float32) * q.astype(np.float32)))
    return {"levels": 256, "group": weight.shape[1], "scale": d,
            "offset": (d.astype(np.float32) * -128).astype(np.float16)}


def test_a_tied_head_over_coded_embeddings_runs_through_quant_linear(tiny_llama, text_file, tmp_path, monkeypatch):
    """Embeddings kept on their source's own grid (as a Q8_0 GGUF stores them): the tied LM head multiplies by the
    stored codes through QuantLinear, the lookup keeps dense rows, the embeddings come back bit for bit, and the
    logits match the dense decode."""
    import shutil

    from transformers import LlamaForCausalLM

    from accel.converters.hf_dir import HFDirSource
    from accel.eval.load import load_causal_lm
    from accel.kernels.quant_linear import QuantLinear
    from accel.quantize.pipeline import QuantizeSettings, quantize_model

    model = LlamaForCausalLM.from_pretrained(tiny_llama)
    model.config.tie_word_embeddings = True
    emb = model.model.embed_tokens.weight
    grids = {"model.embed_tokens.weight": _on_a_q8_grid(emb)}
    model.lm_head.weight = emb
    source_dir = tmp_path / "tied"
    model.save_pretrained(source_dir, safe_serialization=True)
    for f in tiny_llama.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, source_dir / f.name)
    monkeypatch.setattr(HFDirSource, "native_grid", lambda self, name: grids.get(name))
    out = tmp_path / "out"
    quantize_model(str(source_dir), out, QuantizeSettings(weights="rtn4"), jobs=1)

    kern = load_causal_lm(out, kernels=True)
    dense = load_causal_lm(out)
    assert isinstance(kern.model.lm_head, QuantLinear) and not isinstance(dense.model.lm_head, QuantLinear)
    assert sum(isinstance(m, QuantLinear) for m in kern.model.modules()) == 15  # 14 quantized linears and the head
    assert torch.equal(dense.model.model.embed_tokens.weight, emb)  # kept bit for bit
    ids = kern.tokenizer(text_file.read_text()[:400], return_tensors="pt").input_ids[:, :32]
    with torch.inference_mode():
        a, b = kern.model(input_ids=ids).logits, dense.model(input_ids=ids).logits
        assert float((a - b).abs().max()) < 1e-4
        out5 = kern.model(input_ids=ids[:, :5], use_cache=True)
        step = kern.model(input_ids=ids[:, 5:6], cache=out5.cache, use_cache=True).logits
        assert float((step - dense.model(input_ids=ids[:, :6]).logits[:, -1:]).abs().max()) < 1e-4
