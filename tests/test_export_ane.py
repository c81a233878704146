"""accel export-ane: the ANE Llama, encodings, packages, placement, the MIL interpreter and `accel verify PKG`."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from accel.cli.main import main
from accel.converters import build_transformers_model, open_model
from accel.converters.coreml.ane_llama import build_ane_llama, llama_dims, logits_from_pieces
from accel.converters.coreml.encodings import decode_arrays, encoding_names, get_encoding
from accel.converters.coreml.export import (
    ExportSettings,
    canonicalize_package,
    export_ane,
    inspect_package,
    read_manifest,
)
from accel.converters.coreml.mil_interp import SUPPORTED_OPS, Interpreter
from accel.converters.coreml.placement import (
    ANE,
    CPU,
    GPU_OR_CPU,
    OpFacts,
    PlacementReport,
    TensorFacts,
    predict,
)
from accel.converters.coreml.verify import FP16_TOLERANCE, verify_package
from accel.errors import AccelError

# Relative Frobenius error of the decoded weights against the source, per encoding, on random Gaussian weights
# (k-means LUTs: ~0.11 at 4 bits, ~0.35 at 2 bits; TWN ternary ~0.45); a wrong decode lands far above.
WEIGHT_ERROR_BOUND = {"fp16": 1e-3, "int8": 2e-2, "lut4": 0.2, "lut2": 0.5, "ternary": 0.6}


def make_llama(out: Path, *, seed: int = 0, tied: bool = False, vocab: int = 96, hidden: int = 32,
               layers: int = 2, heads: int = 4, kv_heads: int = 2, max_positions: int = 256,
               model_type: str = "llama") -> Path:
    """A random Llama (random RMSNorm weights too) saved as a Hugging Face directory, no tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden + 16,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=max_positions, tie_word_embeddings=tied, rms_norm_eps=1e-5)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    model.save_pretrained(out, safe_serialization=True)
    if model_type != "llama":  # the same tensors under another architecture's name
        cfg = json.loads((out / "config.json").read_text())
        cfg["model_type"], cfg["architectures"] = model_type, [f"{model_type.capitalize()}ForCausalLM"]
        (out / "config.json").write_text(json.dumps(cfg))
    return out


# Llama-family variants export-ane serves: projection biases (Llama's attention_bias/mlp_bias, Qwen2's q/k/v,
# Qwen3's attention_bias), Qwen3's per-head q/k RMSNorm, and sliding-window layers (Mistral's on every layer,
# Qwen2/Qwen3's on the layers from max_window_layers on), windows short enough to matter within 10 tokens.
FAMILY = {
    "mistral": {"sliding_window": 4},
    "qwen2": {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
    "qwen3": {"head_dim": 16, "attention_bias": True, "use_sliding_window": True, "sliding_window": 3,
              "max_window_layers": 1},
    "llama-biases": {"attention_bias": True, "mlp_bias": True},
}


def make_family_model(out: Path, variant: str) -> Path:
    """A random 3-layer model of one FAMILY variant (random norms and biases), saved as a Hugging Face directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(3)
    config = AutoConfig.for_model(variant.split("-")[0], vocab_size=96, hidden_size=32, intermediate_size=80,
                                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=256, rms_norm_eps=1e-5, **FAMILY[variant])
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn_like(p))
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def untied(tmp_path_factory) -> Path:
    return make_llama(tmp_path_factory.mktemp("m") / "untied")


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> Path:
    # 40 000 rows: the head is split in 3 pieces of at most 16 384, and the pieces double as the embedding
    return make_llama(tmp_path_factory.mktemp("m") / "tied", seed=1, tied=True, vocab=40000, hidden=16,
                      layers=1, heads=2, kv_heads=1)


@pytest.fixture(scope="module")
def packages(untied, tmp_path_factory) -> dict[str, Path]:
    """One package per encoding from the untied model (the fp16 one with the naive baseline)."""
    root = tmp_path_factory.mktemp("pkg")
    out = {}
    for enc in encoding_names():
        out[enc] = root / f"{enc}.mlpackage"
        export_ane(untied, out[enc], ExportSettings(encoding=enc, context=64, prefill=8, naive=enc == "fp16"))
    return out


def run_cli(capsys, *argv):
    capsys.readouterr()  # drop what fixtures printed (transformers' save progress)
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code, err, contains):
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and contains in lines[0] and "Traceback" not in err, err


# ------------------------------------------------------------------------------------------- the ANE Llama
def _reference(path: Path):
    src = open_model(path)
    ref = build_transformers_model(src.config, {n: src.load_tensor(n) for n in src.tensor_names()},
                                   attn_implementation="eager")
    return src, ref


IDS = torch.tensor([[5, 9, 77, 3, 60, 12, 8, 1, 33, 2]])


def _ane_logits(model, ids: torch.Tensor = IDS) -> list[np.ndarray]:
    """The ANE model's logits for `ids` three ways: one prefill, token-by-token decode, two chunks (6 + rest)."""
    n = ids.shape[1]
    with torch.no_grad():
        full = logits_from_pieces(model(ids.int(), torch.arange(n, dtype=torch.int32)[None]))
        model.reset_cache()
        steps = [logits_from_pieces(model(ids[:, i:i + 1].int(), torch.tensor([[i]], dtype=torch.int32)))
                 for i in range(n)]
        model.reset_cache()
        first = logits_from_pieces(model(ids[:, :6].int(), torch.arange(6, dtype=torch.int32)[None]))
        rest = logits_from_pieces(model(ids[:, 6:].int(), torch.arange(6, n, dtype=torch.int32)[None]))
    return [full, np.concatenate(steps), np.concatenate([first, rest])]


@pytest.mark.parametrize("which", ["untied", "tied"])
def test_ane_llama_matches_transformers_prefill_decode_and_chunks(request, which):
    src, ref = _reference(request.getfixturevalue(which))
    model = build_ane_llama(llama_dims(src.config), 32, src.load_tensor)
    with torch.no_grad():
        want = ref(IDS).logits[0].numpy()
    for got in _ane_logits(model):
        assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("variant", sorted(FAMILY))
def test_llama_family_variants_match_transformers(tmp_path, variant):
    """Biases, q/k norms and sliding windows as transformers computes them: prefill, decode steps and chunks;
    and the windows matter (the same model with full attention everywhere is far off)."""
    import dataclasses

    src, ref = _reference(make_family_model(tmp_path / variant, variant))
    dims = llama_dims(src.config)
    expect = {"mistral": ((), False, (4, 4, 4)), "qwen2": (("q", "k", "v"), False, (None, 4, 4)),
              "qwen3": (("q", "k", "v", "o"), True, (None, 3, 3)),
              "llama-biases": (("q", "k", "v", "o", "gate", "up", "down"), False, (None, None, None))}
    assert (dims.biases, dims.qk_norm, dims.windows) == expect[variant]
    model = build_ane_llama(dims, 32, src.load_tensor)
    unwindowed = build_ane_llama(dataclasses.replace(dims, windows=()), 32, src.load_tensor)
    with torch.no_grad():
        want = ref(IDS).logits[0].numpy()
        no_window = logits_from_pieces(unwindowed(IDS.int(), torch.arange(10, dtype=torch.int32)[None]))
    scale = np.abs(want).max()
    for got in _ane_logits(model):
        assert np.abs(got - want).max() < 1e-5 * scale
    assert (np.abs(no_window - want).max() > 1e-4 * scale) == any(dims.windows)  # 10x the agreement above


LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [4.0 + i for i in range(4)],
            "original_max_position_embeddings": 16}


@pytest.mark.parametrize("rope,context", [
    ({"rope_type": "dynamic", "factor": 4.0}, 32),   # context = max_position_embeddings: the table must not scale
    (LONGROPE, 16),                                    # context = the longrope switch: short factors throughout
    ({"rope_type": "linear", "factor": 2.0}, 32),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8}, 32),
])
def test_rotary_tables_are_transformers_for_every_sequence_the_package_takes(tmp_path, rope, context):
    """The tables were computed for context + 1 positions (the padding row): dynamic NTK scaling and longrope pick
    their frequencies by the sequence's length, so every row came out scaled (2e-3 of the logit range off, and
    verify passed it). A context past the longrope switch is refused: no fixed table follows transformers there."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from accel.converters.coreml.export import check_ane_shapes

    torch.manual_seed(5)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=80, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=32,
                         rms_norm_eps=1e-5, rope_scaling=rope)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # sharp attention, so that positions matter
        for name, p in model.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(8.0)
    model.save_pretrained(tmp_path / "m")
    src, ref = _reference(tmp_path / "m")
    dims = llama_dims(src.config)
    check_ane_shapes(dims, context, 8)
    with torch.no_grad():
        want = ref(IDS).logits[0].numpy()
    for got in _ane_logits(build_ane_llama(dims, context, src.load_tensor)):
        assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()
    if rope is LONGROPE:
        with pytest.raises(AccelError, match="past the model's longrope switch"):
            check_ane_shapes(dims, context + 1, 8)


def test_a_sliding_window_of_no_keys_is_refused():
    """sliding_window 0 masked every key (attention spread over empty cache slots); verify's reference crashed."""
    config = {"model_type": "mistral", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
              "num_hidden_layers": 1, "num_attention_heads": 2, "sliding_window": 0}
    with pytest.raises(AccelError, match="sliding_window 0 must be at least 1"):
        llama_dims(config)


@pytest.mark.parametrize("variant", ["mistral", "qwen2", "qwen3"])
def test_cli_exports_and_verifies_llama_family_variants(capsys, tmp_path, variant):
    model = make_family_model(tmp_path / variant, variant)
    pkg = tmp_path / f"{variant}.mlpackage"
    code, out, err = run_cli(capsys, "export-ane", model, "--out", pkg, "--encoding", "int8", "--context", "32",
                             "--prefill", "8", "--json")
    exported = json.loads(out)
    assert code == 0 and exported["residency"]["block_ops"] == 1.0, err
    # the naive conversion's blocks are found by their transformers layer type (Qwen3DecoderLayer, ...): its
    # decomposed RMSNorms are off the ANE
    assert 0.5 < exported["naive_residency"]["block_ops"] < 1.0
    code, out, err = run_cli(capsys, "verify", pkg, "--reference", model, "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"], err
    assert [c["call"] for c in report["calls"]][:2] == ["prefill", "decode[0]"] and report["max_rel_error"] < 5e-3
    manifest = read_manifest(pkg)
    dims = llama_dims(json.loads((model / "config.json").read_text()))
    assert manifest["architecture"] == f"{variant.capitalize()}ForCausalLM"
    assert manifest["weight_bytes"]["norms"] == 2 * dims.vector_count() and dims.param_count() == manifest["dims"][
        "params"] == sum(int(np.prod(s)) for s in open_model(model).tensor_shapes().values())


def test_padding_rows_write_nothing_to_the_cache(untied):
    src = open_model(untied)
    model = build_ane_llama(llama_dims(src.config), 16, src.load_tensor)
    with torch.no_grad():
        model(torch.tensor([[4, 5, 6]], dtype=torch.int32), torch.tensor([[0, 1, 16]], dtype=torch.int32))
    cache = model.k_cache_0.numpy()
    assert np.abs(cache[..., :2]).sum() > 0 and np.abs(cache[..., 2:]).sum() == 0


def test_head_pieces_never_exceed_the_ane_dimension_limit():
    for vocab, count in ((49152, 3), (40000, 3), (16384, 1), (16385, 2), (96, 1)):
        dims = llama_dims({"model_type": "llama", "vocab_size": vocab, "hidden_size": 8, "intermediate_size": 8,
                           "num_hidden_layers": 1, "num_attention_heads": 2})
        pieces = dims.head_pieces
        assert len(pieces) == count and pieces[0][0] == 0 and pieces[-1][1] == vocab
        assert all(b - a <= 16384 for a, b in pieces) and all(p[1] == q[0] for p, q in itertools.pairwise(pieces))


@pytest.mark.parametrize("config,named", [
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
    ({"model_type": "granite", "architectures": ["GraniteForCausalLM"]}, "GraniteForCausalLM"),
    ({"model_type": "llama", "architectures": ["MistralForCausalLM"]}, "MistralForCausalLM"),
    ({"model_type": "llama", "hidden_act": "gelu"}, "gelu"),
])
def test_unsupported_architectures_are_refused_by_name(config, named):
    with pytest.raises(AccelError, match=named):
        llama_dims({"vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
                    "num_attention_heads": 2, **config})


# -------------------------------------------------------------------------------------------- encodings
@pytest.mark.parametrize("name", encoding_names())
def test_encoding_decode_is_what_coremltools_reconstructs(name, rng):
    from coremltools.converters.mil.mil.ops.defs.iOS18.compression import (
        constexpr_blockwise_shift_scale,
        constexpr_lut_to_dense,
    )

    w = (rng.standard_normal((48, 96)) * 0.05).astype(np.float32)
    enc = get_encoding(name).encode(w)
    got = enc.decode()
    if enc.kind == "lut":
        want = constexpr_lut_to_dense.decompress(enc.arrays["indices"], enc.arrays["lut"], None)
    elif enc.kind == "shift_scale":
        want = constexpr_blockwise_shift_scale.decompress(enc.arrays["data"], enc.arrays["scale"], None)
    else:
        want = enc.arrays["values"]
    assert np.array_equal(got, np.asarray(want, dtype=np.float32))
    assert np.linalg.norm(got - w) / np.linalg.norm(w) < WEIGHT_ERROR_BOUND[name]
    assert enc.storage_bytes == get_encoding(name).predicted_bytes(*w.shape)


def test_ternary_lut_holds_minus_a_zero_a(rng):
    enc = get_encoding("ternary").encode(rng.standard_normal((32, 64)).astype(np.float32))
    lut = enc.arrays["lut"][..., 0]
    assert np.all(lut[:, 0, 1] == 0) and np.all(lut[:, 0, 0] == -lut[:, 0, 2]) and np.all(lut[:, 0, 2] > 0)
    assert set(np.unique(enc.arrays["indices"])) <= {0, 1, 2}


def test_affine_codes_map_onto_shift_scale_exactly(rng):
    """rtn-style affine codes (x = q*scale + offset per group) reused as blockwise shift-scale."""
    from accel.formats.codecs import get_codec

    w = rng.standard_normal((16, 128)).astype(np.float32)
    w[3, :64] = 0.25  # a constant group: scale 0
    codec = get_codec("affine")
    e = codec.encode(w, levels=16, group=64, symmetric=False)
    enc = get_encoding("lut4").from_codes("affine", e.params, e.codes, e.side, w.shape)
    assert enc is not None and enc.kind == "shift_scale" and enc.source == "codes" and enc.bits == 4
    exact = codec.decode(e.codes, e.side, e.params, w.shape)
    assert np.abs(enc.decode() - exact).max() <= 2e-3 * np.abs(exact).max()
    assert np.all(enc.decode()[3, :64] == np.float16(0.25))
    two = codec.encode(w, levels=4, group=64, symmetric=False)
    lut = get_encoding("lut2").from_codes("affine", two.params, two.codes, two.side, w.shape)
    assert lut.kind == "lut" and np.abs(lut.decode() - codec.decode(two.codes, two.side, two.params, w.shape)
                                        ).max() <= 1e-3 * np.abs(w).max()
    assert get_encoding("lut2").from_codes("affine", e.params, e.codes, e.side, w.shape) is None  # 16 > 4 levels


# --------------------------------------------------------------------------------------------- packages
def test_package_is_multifunction_stateful_and_carries_accel_items(packages):
    pkg = packages["lut4"]
    manifest = read_manifest(pkg)
    entries = json.loads((pkg / "Manifest.json").read_text())["itemInfoEntries"].values()
    assert {e["name"] for e in entries if e["author"] == "com.github.accel"} == {
        "accel-manifest.json", "placement.json", "probe_harness.py"}
    interp = Interpreter.from_package(pkg)
    assert sorted(interp.functions) == ["decode", "prefill"]
    for fname, seq in (("prefill", 8), ("decode", 1)):
        func = interp.program.functions[fname]
        assert tuple(func.inputs["input_ids"].shape) == (1, seq)
        state = interp.new_state(fname)
        assert sorted(state) == sorted(manifest["states"]["names"]) and all(
            s.dtype == np.float16 and list(s.shape) == manifest["states"]["shape"] for s in state.values())
        assert [v.name for v in func.outputs] == manifest["outputs"]
    assert manifest["functions"] == {"prefill": {"seq": 8}, "decode": {"seq": 1}}
    # the placement report names ops by the outputs the saved program has (what MLComputePlan captures carry);
    # coreml_update_state is saved as a write_state, which has no output
    placement = json.loads(_item(pkg, "placement.json"))["functions"]
    for fname, doc in placement.items():
        saved = {o.outputs[0].name: o.op_type for o in interp.program.functions[fname].operations}
        rows = [r for r in PlacementReport.from_json(doc).op_rows() if r["op"] != "coreml_update_state"]
        assert {(r["output"], r["op"]) for r in rows} <= set(saved.items())


@pytest.mark.parametrize("enc,op,index_bits", [("fp16", None, None), ("int8", "constexpr_blockwise_shift_scale", 8),
                                               ("lut4", "constexpr_lut_to_dense", 4),
                                               ("lut2", "constexpr_lut_to_dense", 2),
                                               ("ternary", "constexpr_lut_to_dense", 2)])
def test_weights_are_encoded_with_core_ml_constexpr_ops(packages, enc, op, index_bits):
    interp = Interpreter.from_package(packages[enc])
    func = interp.program.functions["decode"]
    kinds = {o.op_type for o in func.operations}
    assert kinds <= SUPPORTED_OPS
    constexprs = [o for o in func.operations if o.op_type.startswith("constexpr_")]
    if op is None:
        assert not constexprs
        return
    assert {o.op_type for o in constexprs} == {op}
    # every projection of the two blocks, the head and the untied embedding
    assert len(constexprs) == 2 * 7 + 1 + 1
    data = constexprs[0].indices if op.endswith("lut_to_dense") else constexprs[0].data
    assert data.dtype.get_bitwidth() == index_bits


def test_the_blocks_hold_no_gathers_no_integers_and_fp16_everywhere(packages):
    interp = Interpreter.from_package(packages["fp16"])
    report = json.loads(_item(packages["fp16"], "placement.json"))
    for fname in ("prefill", "decode"):
        block = [o for o in PlacementReport.from_json(report["functions"][fname]).op_rows() if o["in_block"]]
        assert block and all(o["op"] not in ("gather", "cast") for o in block)
    for func in interp.program.functions.values():
        for o in func.operations:
            for v in o.outputs:
                assert "fp32" not in str(v.dtype)


def _item(pkg: Path, name: str) -> bytes:
    return (pkg / "Data" / "com.github.accel" / name).read_bytes()


@pytest.mark.parametrize("enc", encoding_names())
def test_interpreter_matches_the_pytorch_reference_for_every_encoding(packages, untied, enc):
    report = verify_package(packages[enc], str(untied), steps=3)
    assert report["ok"], report["errors"]
    assert [c["call"] for c in report["calls"]] == ["prefill", "decode[0]", "decode[1]", "decode[2]"]
    assert report["max_rel_error"] < FP16_TOLERANCE and report["max_rel_error"] < 5e-3
    assert report["weight_rel_error"] < WEIGHT_ERROR_BOUND[enc]


@pytest.mark.parametrize("context,calls", [
    (8, ["prefill"] + [f"decode[{i}] from an empty cache" for i in range(3)]),
    (10, ["prefill", "decode[0]", "decode[1]", "decode[0] from an empty cache"]),
])
def test_verify_of_a_prefill_that_fills_the_context_decodes_inside_it(untied, tmp_path, context, calls):
    """Decode steps after an 8-token prefill stay inside the cache (they once ran past it: an index error); the
    steps that do not fit run from an empty cache, compared with the reference's first positions."""
    pkg = tmp_path / "full.mlpackage"
    export_ane(untied, pkg, ExportSettings(encoding="int8", context=context, prefill=8, naive=False))
    report = verify_package(pkg, str(untied), steps=3)
    assert report["ok"], report["errors"]
    assert [c["call"] for c in report["calls"]] == calls and report["max_rel_error"] < 5e-3


def test_verify_catches_a_package_that_is_not_the_reference(packages, tmp_path):
    other = make_llama(tmp_path / "other", seed=7)
    report = verify_package(packages["fp16"], str(other), steps=1)
    assert not report["ok"] and any("another model" in e or "differ from the reference" in e for e in report["errors"])


def test_manifest_predicts_bytes_per_token_for_every_encoding(packages):
    table = {}
    for enc, pkg in packages.items():
        m = read_manifest(pkg)
        assert set(m["predicted"]["weight_bytes_per_token_by_encoding"]) == set(encoding_names())
        # the package's own figure is its stored bytes (the embedding gives one row per token)
        assert m["predicted"]["weight_bytes_per_token"] == m["predicted"]["weight_bytes_per_token_by_encoding"][enc]
        table[enc] = m["predicted"]["weight_bytes_per_token"]
    assert table["fp16"] > table["int8"] > table["lut4"] > table["lut2"] == table["ternary"]


def test_weight_file_holds_each_weight_once_across_functions(packages):
    for enc, pkg in packages.items():
        m = read_manifest(pkg)
        stored = (pkg / "Data/com.apple.CoreML/weights/weight.bin").stat().st_size
        matrices = m["weight_bytes"]["matrices"]
        # blobs are 64-byte aligned with a header each; norms and rotary tables are small fp16 extras (~5 kB here);
        # a second copy of the matrices would add at least `matrices`
        assert matrices <= stored < matrices + min(matrices, 8000), enc


def _files(pkg: Path) -> dict[str, bytes]:
    return {p.relative_to(pkg).as_posix(): p.read_bytes() for p in sorted(pkg.rglob("*")) if p.is_file()}


def _scramble(pkg: Path) -> None:
    """Rewrite `pkg` as coremltools may write the same package in another process: the spec's map entries in
    another order (here the `functions` map reversed, a concatenation of messages that parses to an equal
    one) and random item identifiers in Manifest.json."""
    import uuid

    from coremltools.proto import Model_pb2

    spec_path = pkg / "Data/com.apple.CoreML/model.mlmodel"
    spec = Model_pb2.Model()
    spec.ParseFromString(spec_path.read_bytes())
    head = Model_pb2.Model()
    head.CopyFrom(spec)
    head.mlProgram.ClearField("functions")
    chunks = [head.SerializeToString()]
    for name in sorted(spec.mlProgram.functions, reverse=True):
        one = Model_pb2.Model()
        one.mlProgram.functions[name].CopyFrom(spec.mlProgram.functions[name])
        chunks.append(one.SerializeToString())
    scrambled = b"".join(chunks)
    again = Model_pb2.Model()
    again.ParseFromString(scrambled)
    assert again == spec and scrambled != spec_path.read_bytes()
    spec_path.write_bytes(scrambled)
    manifest = json.loads((pkg / "Manifest.json").read_text())
    ids = {old: str(uuid.uuid4()).upper() for old in manifest["itemInfoEntries"]}
    manifest["rootModelIdentifier"] = ids[manifest["rootModelIdentifier"]]
    manifest["itemInfoEntries"] = {ids[k]: v for k, v in reversed(manifest["itemInfoEntries"].items())}
    (pkg / "Manifest.json").write_text(json.dumps(manifest, indent=2))


def test_export_is_byte_deterministic_across_processes_and_canonicalization_keeps_the_model(untied, tmp_path):
    """The same export in two processes (other hash seeds, other protobuf map orders, other random item ids)
    writes byte-identical packages; the canonical form is a function of the package's content only."""
    import os
    import shutil
    import subprocess
    import sys

    from coremltools import libmodelpackage
    from coremltools.proto import Model_pb2

    code = "import sys; from accel.cli.main import main; sys.exit(main(sys.argv[1:]))"
    pkgs = []
    for seed in ("1", "2"):
        pkgs.append(tmp_path / f"seed{seed}.mlpackage")
        done = subprocess.run([sys.executable, "-c", code, "export-ane", str(untied), "--out", str(pkgs[-1]),
                               "--encoding", "lut4", "--context", "32", "--prefill", "4", "--no-naive"],
                              env={**os.environ, "PYTHONHASHSEED": seed}, capture_output=True, text=True,
                              check=False)
        assert done.returncode == 0, done.stderr
    first = _files(pkgs[0])
    assert first == _files(pkgs[1])
    # a package that differs only in map order and item ids canonicalizes to the same bytes
    other = tmp_path / "scrambled.mlpackage"
    shutil.copytree(pkgs[0], other)
    _scramble(other)
    assert _files(other) != first
    canonicalize_package(other)
    assert _files(other) == first
    # the manifest stays valid: libmodelpackage finds the root model and accel's items
    assert libmodelpackage.ModelPackage.isValid(str(other))
    pkg = libmodelpackage.ModelPackage(str(other))
    assert pkg.getRootModel().path().endswith("com.apple.CoreML/model.mlmodel")
    assert Path(pkg.findItemByNameAuthor("accel-manifest.json", "com.github.accel").path()).is_file()
    del pkg
    assert _files(other) == first and read_manifest(other)["encoding"] == "lut4"
    spec = Model_pb2.Model()
    spec.ParseFromString(first["Data/com.apple.CoreML/model.mlmodel"])
    assert sorted(spec.mlProgram.functions) == ["decode", "prefill"]


# ------------------------------------------------------------------------------------------- placement
def _facts(op_type, *shapes, dtype="fp16", const_first=False):
    ins = tuple(TensorFacts(dtype, s, const_first and i == 0) for i, s in enumerate(shapes[:-1]))
    return OpFacts(op_type, "x", ins, (TensorFacts(dtype, shapes[-1], False),))


def test_placement_rules_with_reasons():
    assert predict(_facts("conv", (1, 64, 1, 8), (1, 64, 1, 8))).device == ANE
    assert predict(_facts("gather", (100, 8), (4, 8))).name == "gather"
    rule = predict(_facts("equal", (1, 8), (1, 8), dtype="int32"))
    assert rule.device == CPU and "fp16" in rule.reason
    rule = predict(_facts("conv", (1, 64, 1, 8), (1, 20000, 1, 8)))
    assert (rule.name, rule.device) == ("dim-limit", GPU_OR_CPU) and "16384" in rule.reason
    assert predict(_facts("linear", (16385, 64), (1, 8, 64), (1, 8, 16385), const_first=True)).name == "dim-limit"
    assert predict(_facts("einsum", (1, 8), (1, 8))).name == "op-kind"
    assert predict(_facts("add", (1, 8), ("s", 8))).name == "dynamic-shape"


def test_blocks_are_fully_ane_resident_and_the_naive_conversion_stands_beside(packages):
    info = inspect_package(packages["fp16"])
    for fname in ("prefill", "decode"):
        assert info["residency"][fname]["block_ops"] == 1.0
        assert 0.9 < info["residency"][fname]["ops"] < 1.0  # the prologue's gathers and int ops are on the CPU
        assert {g["rule"] for g in info["off_ane"][fname]} <= {"gather", "dtype"}
        assert not any(g["in_block"] for g in info["off_ane"][fname])
    assert set(info["naive_residency"]) == {"ops", "block_ops", "flops", "weight_bytes"}
    # the plain trace's RMSNorm is the pow/mean/rsqrt chain: inside the naive blocks, off the ANE
    assert info["naive_residency"]["block_ops"] < 1.0
    assert {(g["op"], g["rule"]) for g in info["naive_off_ane"] if g["in_block"]} >= {
        ("pow", "decomposed-norm"), ("rsqrt", "decomposed-norm"), ("reduce_mean", "decomposed-norm")}


def test_naive_head_over_16384_is_predicted_off_the_ane(tied, tmp_path):
    pkg = tmp_path / "tied.mlpackage"
    result = export_ane(tied, pkg, ExportSettings(encoding="lut2", context=32, prefill=4))
    info = inspect_package(pkg)
    assert read_manifest(pkg)["head_pieces"] == [[0, 13334], [13334, 26668], [26668, 40000]]
    assert result["residency"]["block_ops"] == 1.0 and result["residency"]["flops"] > 0.99
    naive_off = {(g["op"], g["rule"]) for g in info["naive_off_ane"]}
    assert ("linear", "dim-limit") in naive_off and result["naive_residency"]["flops"] < 0.9
    assert "embed" not in read_manifest(pkg)["weights"]  # tied: the head pieces are the embedding table
    report = verify_package(pkg, str(tied), steps=2)
    assert report["ok"], report["errors"]


# ----------------------------------------------------------------------------------- accel OUT_DIR codes
@pytest.mark.parametrize("weights,enc,kind", [("rtn4", "lut4", "shift_scale"), ("rtn8", "int8", "shift_scale"),
                                              ("rtn2", "lut2", "lut"), ("rtn4", "lut2", "lut")])
def test_quantized_out_dir_is_encoded_from_its_codes(untied, tmp_path, weights, enc, kind):
    q = tmp_path / weights
    assert main(["quantize", str(untied), "--weights", weights, "--group", "16", "--out", str(q)]) == 0
    pkg = tmp_path / f"{weights}-{enc}.mlpackage"
    result = export_ane(q, pkg, ExportSettings(encoding=enc, context=32, prefill=4, naive=False))
    assert result["warnings"] == []
    weights_doc = read_manifest(pkg)["weights"]
    from_codes = {p for p, w in weights_doc.items() if w["from"] == "codes"}
    if weights == "rtn4" and enc == "lut2":  # 16 levels do not fit 2 bits: re-encoded from the float decode
        assert not from_codes
        return
    assert from_codes == {p for p in weights_doc if p.startswith("blocks.")} and result["weights_from_codes"] == 14
    assert {weights_doc[p]["kind"] for p in from_codes} == {kind}
    report = verify_package(pkg, str(q), steps=2)
    assert report["ok"], report["errors"]
    # the block matrices are the codes (up to fp16 rounding of the grid), not a re-quantization
    assert max(e for p, e in report["weight_rel_errors"].items() if p in from_codes) < 2e-3


def test_a_prefill_cut_to_the_context_is_said(capsys, untied, tmp_path):
    """--prefill longer than --context was cut to it without a word (2026-12-06 audit)."""
    code, out, err = run_cli(capsys, "export-ane", untied, "--out", tmp_path / "p.mlpackage", "--encoding", "int8",
                             "--context", "16", "--prefill", "32", "--no-naive", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["functions"]["prefill"] == 16 and "--prefill 32 is longer than --context 16" in doc["warnings"][0]
    assert "warning: --prefill 32" in err


# ------------------------------------------------------------------------------------------------- CLI
def test_cli_export_inspect_verify(capsys, untied, tmp_path):
    pkg = tmp_path / "m.mlpackage"
    code, out, err = run_cli(capsys, "export-ane", untied, "--out", pkg, "--encoding", "int8", "--context", "32",
                             "--prefill", "4", "--no-naive", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert {"package", "encoding", "residency", "predicted_weight_bytes_per_token"} <= set(doc)
    assert set(doc["residency"]) == {"block_ops", "ops", "flops", "weight_bytes"}
    assert all(0.0 <= v <= 1.0 for v in doc["residency"].values()) and doc["encoding"] == "int8"
    code, out, err = run_cli(capsys, "inspect", pkg, "--json")
    info = json.loads(out)
    assert code == 0 and info["encoding"] == "int8" and 8.0 < info["bits_per_weight"] < 8.6
    assert {"name", "codec", "layout", "bits_per_weight", "bytes"} <= set(info["tensors"][0])
    code, out, _ = run_cli(capsys, "inspect", pkg)
    assert code == 0 and "ops inside decoder blocks" in out and "rule gather" in out
    code, out, err = run_cli(capsys, "verify", pkg, "--reference", untied, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["ok"] and doc["errors"] == [] and doc["max_rel_error"] < FP16_TOLERANCE
    code, out, _ = run_cli(capsys, "verify", pkg)
    assert code == 0 and "ok:" in out
    code, _, err = run_cli(capsys, "export-ane", untied, "--out", pkg, "--context", "32")
    one_line_error(code, err, "already exists")


def test_cli_refuses_a_context_over_the_ane_limit_naming_the_limit(capsys, tmp_path):
    model = make_llama(tmp_path / "long", max_positions=65536)
    code, _, err = run_cli(capsys, "export-ane", model, "--out", tmp_path / "x.mlpackage", "--context", "20000")
    one_line_error(code, err, "16384")
    assert not (tmp_path / "x.mlpackage").exists()
    code, _, err = run_cli(capsys, "export-ane", model, "--out", tmp_path / "x.mlpackage", "--context", "65536",
                           "--json")
    assert code == 2 and "limit of 16384" in err


@pytest.mark.parametrize("change,message", [
    ({"rms_norm_eps": ""}, "not a valid 'llama' config"),
    ({"num_key_value_heads": 4}, "the model expects"),
    ({"architectures": 7}, "is not a list of class names"),
    ({"dtype": "silu"}, "wrote"),  # a load-time dtype is not the model's: ignored, as eval ignores it
])
def test_cli_export_of_a_source_whose_config_is_broken(capsys, untied, tmp_path, change, message):
    """Each was a traceback (ValueError, TypeError, AttributeError) before 2026-12-06: a fuzz of config.json."""
    import shutil

    source = tmp_path / "m"
    shutil.copytree(untied, source)
    config = json.loads((source / "config.json").read_text())
    config.update(change)
    (source / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli(capsys, "export-ane", source, "--out", tmp_path / "x.mlpackage", "--context", "16",
                           "--prefill", "4", "--no-naive")
    if message == "wrote":
        assert code == 0, err
    else:
        one_line_error(code, err, message)


def test_cli_refuses_unsupported_architecture_and_bad_arguments(capsys, tmp_path, untied):
    other = make_llama(tmp_path / "granite", model_type="granite")
    code, _, err = run_cli(capsys, "export-ane", other, "--out", tmp_path / "x.mlpackage")
    one_line_error(code, err, "GraniteForCausalLM")
    code, _, err = run_cli(capsys, "export-ane", untied, "--out", tmp_path / "x.mlpackage", "--encoding", "int3")
    one_line_error(code, err, "unknown encoding 'int3'")
    code, _, err = run_cli(capsys, "export-ane", untied, "--out", tmp_path / "x")
    one_line_error(code, err, ".mlpackage")
    code, _, err = run_cli(capsys, "export-ane", untied, "--out", tmp_path / "x.mlpackage", "--context", "300")
    one_line_error(code, err, "max_position_embeddings")


def test_cli_verify_and_inspect_reject_a_broken_package(capsys, packages, tmp_path):
    import shutil

    broken = tmp_path / "broken.mlpackage"
    shutil.copytree(packages["fp16"], broken)
    (broken / "Data/com.apple.CoreML/model.mlmodel").write_bytes(b"not a protobuf")
    code, out, _ = run_cli(capsys, "verify", broken, "--json")
    doc = json.loads(out)
    changed = "Data/com.apple.CoreML/model.mlmodel: changed since export wrote it (its SHA-256 differs from the manifest's)"
    assert code == 1 and doc["errors"] == [changed]
    manifest_path = broken / "Data/com.github.accel/accel-manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["files"]  # as packages exported before the hashes were recorded: the program reader finds it
    manifest_path.write_text(json.dumps(manifest))
    code, out, _ = run_cli(capsys, "verify", broken, "--json")
    doc = json.loads(out)
    assert code == 1 and not doc["ok"] and "cannot read the Core ML program" in doc["errors"][0]
    manifest_path.write_text("{")
    code, _, err = run_cli(capsys, "inspect", broken)
    one_line_error(code, err, "not valid JSON")


def test_verify_checks_every_file_of_the_package_against_the_manifest(capsys, packages, tmp_path):
    """A weight, the placement report or the probe harness changed after export still interprets (the weights
    are the reference's too), so only the recorded SHA-256s see it; a damaged manifest is named, not a traceback."""
    import shutil

    fine = tmp_path / "fine.mlpackage"
    shutil.copytree(packages["int8"], fine)
    recorded = read_manifest(fine)["files"]
    assert set(recorded) == {"com.apple.CoreML/model.mlmodel", "com.apple.CoreML/weights/weight.bin",
                             "com.github.accel/placement.json", "com.github.accel/probe_harness.py"}
    for name, damage, message in [
        ("com.apple.CoreML/weights/weight.bin", lambda p: p.write_bytes(p.read_bytes()[:-1] + b"\x01"), "changed"),
        ("com.github.accel/probe_harness.py", lambda p: p.write_text(p.read_text() + "#"), "changed"),
        ("com.github.accel/placement.json", lambda p: p.unlink(), "missing (export wrote it"),
        ("com.github.accel/notes.txt", lambda p: p.write_text("x"), "not written by export"),
        ("com.github.accel/.DS_Store", lambda p: p.write_text("x"), None),  # what macOS adds: not a fault
    ]:
        broken = tmp_path / f"{name.replace('/', '-')}.mlpackage"
        shutil.copytree(fine, broken)
        damage(broken / "Data" / name)
        code, out, _ = run_cli(capsys, "verify", broken, "--json")
        doc = json.loads(out)
        if message is None:
            assert code == 0 and doc["ok"], doc
            continue
        assert code == 1 and len(doc["errors"]) == 1 and doc["errors"][0].startswith(f"Data/{name}: {message}")
    manifest_path = fine / "Data/com.github.accel/accel-manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del next(iter(manifest["weights"].values()))["mil_name"]
    manifest_path.write_text(json.dumps(manifest))
    code, _, err = run_cli(capsys, "inspect", fine)
    one_line_error(code, err, "accel-manifest.json is damaged: weight ")
    code, out, _ = run_cli(capsys, "verify", fine, "--json")
    assert code == 1 and "accel-manifest.json is damaged: weight " in json.loads(out)["errors"][0]


def _edited_manifest(source: Path, out: Path, edit) -> Path:
    import shutil

    shutil.copytree(source, out)
    path = out / "Data/com.github.accel/accel-manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))
    return out


@pytest.mark.parametrize("edit,reference,message", [
    (lambda m: m["dims"].update(vocab=0), False, "'dims' is missing or not what export writes"),
    (lambda m: m.update(nominal_bits=0), False, "'nominal_bits' is missing or not what export writes"),
    (lambda m: m["functions"]["prefill"].update(seq=1000), False, "does not run as its manifest describes it"),
    (lambda m: m["dims"].update(vocab=100_000), False, "does not run as its manifest describes it"),
    (lambda m: next(iter(m["weights"].values())).update(mil_name="nope"), True, "has no op 'nope'"),
    (lambda m: next(iter(m["weights"].values())).update(source="nope.weight"), True, "KeyError"),
    (lambda m: next(iter(m["weights"].values())).update(rows=[0, 5]), True, "does not run as its manifest"),
])
def test_a_manifest_edited_past_its_type_checks_is_a_fault(capsys, packages, untied, tmp_path, edit, reference,
                                                           message):
    """The accel manifest is not covered by the package's file hashes; values of the right type that do not fit
    the program were tracebacks (ValueError, KeyError) or exit-2 errors from the interpreter (2026-12-06 audit)."""
    broken = _edited_manifest(packages["fp16"], tmp_path / "broken.mlpackage", edit)
    code, out, err = run_cli(capsys, "verify", broken, "--json", *(("--reference", untied) if reference else ()))
    assert code == 1 and "Traceback" not in err, err
    assert message in json.loads(out)["errors"][0]


def test_verify_reads_a_package_without_changing_it(capsys, packages, tmp_path):
    """coremltools' load_spec opened the package read-write and wrote its Manifest.json back (reformatted, a new
    mtime) on every verify."""
    import shutil

    pkg = tmp_path / "p.mlpackage"
    shutil.copytree(packages["int8"], pkg)
    files = sorted(p for p in pkg.rglob("*") if p.is_file())
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in files}
    assert run_cli(capsys, "verify", pkg)[0] == 0
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in files} == before
    assert sorted(p for p in pkg.rglob("*") if p.is_file()) == files


def test_verify_of_a_path_that_is_no_package_is_bad_input(capsys, tmp_path):
    (tmp_path / "empty.mlpackage").mkdir()
    for path, message in [(tmp_path / "nope.mlpackage", "no such package directory"),
                          (tmp_path / "empty.mlpackage", "no Manifest.json (not a Core ML package)")]:
        code, _, err = run_cli(capsys, "verify", path)
        one_line_error(code, err, message)


def test_damaged_package_files_are_faults_or_one_line_errors(capsys, packages, tmp_path):
    """Seeded byte damage to each file of a package (bits flipped, a byte set, a cut): inspect reports it or
    refuses it in one line; verify lists a fault (exit 1), never a traceback, and every damaged file that the
    manifest's hashes cover is one. A fuzz like this found inspect tracebacks and weight.bin changes that verify
    passed (2026-12-06)."""
    import random
    import shutil

    pick = random.Random(0)
    files = sorted(p.relative_to(packages["lut4"]) for p in packages["lut4"].rglob("*") if p.is_file())
    hashed = {f"Data/{n}" for n in read_manifest(packages["lut4"])["files"]}
    for case in range(24):
        broken = tmp_path / f"b{case}.mlpackage"
        shutil.copytree(packages["lut4"], broken)
        name = files[case % len(files)]
        raw = bytearray((broken / name).read_bytes())
        how = pick.choice(["flip", "set", "cut"])
        at = pick.randrange(len(raw))
        if how == "flip":
            raw[at] ^= 1 << pick.randrange(8)
        elif how == "set":
            raw[at] = (raw[at] + 1 + pick.randrange(255)) % 256
        else:
            del raw[at:]
        (broken / name).write_bytes(bytes(raw))
        code, _, err = run_cli(capsys, "inspect", broken)
        assert "Traceback" not in err and (code == 0 or code == 2 and len(err.strip().splitlines()) == 1), err
        code, out, err = run_cli(capsys, "verify", broken, "--json")
        assert "Traceback" not in err and code in (0, 1), (name, how, err)
        assert code == 1 or str(name) not in hashed, (name, how, json.loads(out))
        shutil.rmtree(broken)


def test_sweep_emits_variants_predictions_and_a_runner(tmp_path):
    from accel.converters.coreml.sweep import run_sweep

    chosen = ["proj_conv1x1", "head_20000_single", "head_20000_pieces", "cache_slice_update",
              "cache_onehot_write", "proj_conv1x1_lut4", "rmsnorm_fused", "rmsnorm_decomposed"]
    report = run_sweep(tmp_path / "sweep", only=chosen)
    by_name = {v["name"]: v for v in report["variants"]}
    assert set(by_name) == set(chosen)
    assert by_name["head_20000_single"]["residency"]["ops"] == 0.0
    assert by_name["head_20000_pieces"]["residency"]["ops"] == 1.0
    assert {o["rule"] for o in by_name["cache_slice_update"]["off_ane"]} == {"dtype"}
    assert by_name["rmsnorm_fused"]["residency"]["ops"] == 1.0
    assert by_name["rmsnorm_decomposed"]["residency"]["ops"] == 0.0
    slice_update = [o for o in by_name["cache_slice_update"]["predicted_ops"] if o["op"] == "slice_update"]
    onehot_block = [o for o in by_name["cache_onehot_write"]["predicted_ops"] if o["op"] in ("matmul", "add")]
    assert slice_update[0]["device"] != ANE and all(o["device"] == ANE for o in onehot_block)
    for v in by_name.values():
        assert (tmp_path / "sweep" / v["package"] / "Manifest.json").is_file()
        bound = 0.2 if v["encoding"] == "lut4" else 5e-3  # the LUT variant carries its quantization error
        assert v["interpreter_rel_error"] < bound
    runner = (tmp_path / "sweep" / "run_compute_plan.py").read_text()
    compile(runner, "run_compute_plan.py", "exec")
    assert "MLComputePlan" in runner and json.loads((tmp_path / "sweep" / "sweep.json").read_text())["variants"]


def test_interpreter_refuses_ops_it_does_not_know():
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 3), dtype=types.fp16)])
    def prog(x):
        return mb.floor(x=x)

    with pytest.raises(AccelError, match="floor"):
        Interpreter(prog).run("main", {"x": np.ones((2, 3))})


def test_decode_arrays_handles_per_block_luts():
    indices = np.array([[0, 1, 2, 3], [3, 2, 1, 0]], dtype=np.uint8)
    lut = np.arange(16, dtype=np.float16).reshape(2, 2, 4, 1)[:, :1]   # per row, one table across columns
    out = decode_arrays("lut", {"indices": indices, "lut": lut}, indices.shape)
    assert out.tolist() == [[0, 1, 2, 3], [11, 10, 9, 8]]


# ------------------------------------------------------------------------------------------------- slow
@pytest.mark.slow
def test_smollm2_ane_llama_matches_transformers():
    src, ref = _reference("smollm2-135m")
    model = build_ane_llama(llama_dims(src.config), 64, src.load_tensor)
    ids = torch.tensor([[1, 504, 3458, 314, 260, 3277, 2051, 30]])
    with torch.no_grad():
        want = ref(ids).logits[0].numpy()
        got = logits_from_pieces(model(ids.int(), torch.arange(8, dtype=torch.int32)[None]))
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()


@pytest.mark.slow
@pytest.mark.parametrize("enc", encoding_names())
def test_smollm2_every_encoding_exports_verifies_and_sizes(tmp_path, enc):
    pkg = tmp_path / f"smollm2-{enc}.mlpackage"
    result = export_ane("smollm2-135m", pkg, ExportSettings(encoding=enc, naive=enc == "fp16"))
    assert result["residency"]["block_ops"] == 1.0
    assert result["seconds"] < 180
    assert abs(result["size_ratio"] - 1) < 0.03
    report = verify_package(pkg, "smollm2-135m", steps=4)
    assert report["ok"], report["errors"]
