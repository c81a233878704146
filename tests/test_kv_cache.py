"""The packed KV cache: what it stores, what it serves, and that the parallel simulation equals decoding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from accel.eval.data import read_text, token_windows
from accel.eval.load import load_causal_lm
from accel.eval.perplexity import decode_nll, window_nll
from accel.formats.bitpack import base_levels_nbytes
from accel.quantize import kv_affine
from accel.runtime.kv_cache import KVScheme, PackedKVCache, rope_rotate, rope_theta_of, simulate


@pytest.fixture(scope="module")
def tiny(tiny_llama, text_file):
    torch.set_num_threads(1)
    loaded = load_causal_lm(tiny_llama)
    windows = token_windows(loaded.tokenizer, read_text(text_file), 70, 2)
    return loaded.model, windows


def _median_thresholds(model, windows, indicator):
    """Per-layer median of the write-time score, so that about half of the tokens go high."""
    seen = {}

    def observe(layer, q, k, v, scale):
        from accel.runtime.kv_cache import token_score

        seen.setdefault(layer, []).append(token_score(indicator, k.numpy(), v.numpy()))

    with simulate(model, None, observer=observe):
        window_nll(model, windows)
    return tuple(float(np.median(np.concatenate(seen[i]))) for i in sorted(seen))


SCHEMES = {
    "fp16": {"base": "fp16", "levels": (16, 16)},
    "turbo-3": {"base": "turbo", "levels": (3, 3)},
    "turbo-4/5-window": {"base": "turbo", "levels": (4, 5), "window": 5, "indicator": "value_norm"},
    "affine-5": {"base": "affine", "levels": (5, 5), "key_block": 8, "value_group": 4},
    "affine-3/4-window": {"base": "affine", "levels": (3, 4), "key_block": 16, "value_group": 10, "window": 7},
    "affine-4/5-sink-prerope": {"base": "affine", "levels": (4, 5), "key_block": 16, "value_group": 10, "sink": 3,
                                "rope": True},
    "turbo-3/4-sink-prerope-smooth": {"base": "turbo", "levels": (3, 4), "window": 2, "sink": 2, "rope": True,
                                      "smooth": True},
}


def _scheme(model, windows, name):
    kwargs = dict(SCHEMES[name])
    if kwargs.pop("rope", False):
        kwargs["rope_theta"] = rope_theta_of(model.config)
    if kwargs.pop("smooth", False):  # arbitrary positive channel means and scales, one per layer
        rng = np.random.default_rng(5)
        shape = (2, model.config.num_key_value_heads, model.config.head_dim)
        kwargs["key_mean"] = rng.standard_normal(shape).astype(np.float32)
        kwargs["value_mean"] = rng.standard_normal(shape).astype(np.float32) * 0.1
        kwargs["key_scale"] = np.exp(rng.standard_normal(shape)).astype(np.float32)
    if kwargs["levels"][0] != kwargs["levels"][1]:
        kwargs["thresholds"] = _median_thresholds(model, windows, kwargs.get("indicator", "key_norm"))
    return KVScheme(**kwargs)


@pytest.mark.parametrize("name", list(SCHEMES))
def test_simulation_equals_token_by_token_decoding(tiny, name):
    model, windows = tiny
    scheme = _scheme(model, windows, name)
    decoded = decode_nll(model, windows, lambda: PackedKVCache(scheme, 2))
    with simulate(model, scheme) as record:
        simulated = window_nll(model, windows)
    np.testing.assert_allclose(decoded.nll, simulated.nll, atol=2e-6)
    if scheme.levels[0] != scheme.levels[1]:
        assert 0.2 < record.high.sum() / record.tokens.sum() < 0.8


@pytest.mark.parametrize("name", ["turbo-4/5-window", "affine-3/4-window", "affine-4/5-sink-prerope",
                                  "turbo-3/4-sink-prerope-smooth"])
def test_served_keys_and_values_are_what_the_stored_bytes_decode_to(tiny, name):
    model, windows = tiny
    scheme = _scheme(model, windows, name)
    cache = PackedKVCache(scheme, 2)
    pure = PackedKVCache(scheme, 2, shadow=False)  # decodes every read from the packed bytes
    ids = torch.from_numpy(windows[0])[None]
    with torch.inference_mode():
        for t in range(ids.shape[1]):
            model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True)
            model(input_ids=ids[:, t:t + 1], cache=pure, use_cache=True)
    for a, b in zip(cache.layers, pure.layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=0)
        torch.testing.assert_close(a.values, b.values, rtol=0, atol=0)
        k, v = a.materialize()
        torch.testing.assert_close(a.keys, k, rtol=0, atol=0)
        torch.testing.assert_close(a.values, v, rtol=0, atol=0)
    assert cache.stored_bytes() == pure.stored_bytes()


def test_a_prefill_chunk_stores_the_same_bytes_as_single_tokens(tiny):
    model, windows = tiny
    scheme = _scheme(model, windows, "affine-3/4-window")
    one, chunked = PackedKVCache(scheme, 2), PackedKVCache(scheme, 2)
    rng = np.random.default_rng(0)
    k = torch.from_numpy(rng.standard_normal((1, 2, 41, 10)).astype(np.float32))
    v = torch.from_numpy(rng.standard_normal((1, 2, 41, 10)).astype(np.float32))
    for t in range(41):
        one.update(k[:, :, t:t + 1], v[:, :, t:t + 1], 0)
    chunked.update(k[:, :, :20], v[:, :, :20], 0)
    chunked.update(k[:, :, 20:], v[:, :, 20:], 0)
    assert one.layers[0].stored_bytes() == chunked.layers[0].stored_bytes()
    torch.testing.assert_close(one.layers[0].keys, chunked.layers[0].keys, rtol=0, atol=0)


def test_byte_count_is_codes_side_data_and_fp16_exactly():
    rng = np.random.default_rng(1)
    heads, dim, tokens = 3, 64, 75
    k = torch.from_numpy(rng.standard_normal((1, heads, tokens, dim)).astype(np.float32))
    v = torch.from_numpy(rng.standard_normal((1, heads, tokens, dim)).astype(np.float32))
    for levels in (3, 5, 6, 16):
        turbo = PackedKVCache(KVScheme("turbo", (levels, levels)), 1)
        turbo.update(k, v, 0)
        per_token = 2 * (base_levels_nbytes(heads * dim, levels) + 2 * heads)  # codes + one fp16 norm a head
        assert turbo.stored_bytes() == {"codes": tokens * 2 * base_levels_nbytes(heads * dim, levels),
                                        "side": tokens * 2 * 2 * heads, "fp16": 0, "total": tokens * per_token}
    affine = PackedKVCache(KVScheme("affine", (5, 5), key_block=32, value_group=32, window=4), 1)
    affine.update(k, v, 0)
    closed = tokens // 32 * 32  # keys of the open block and values of the last 4 tokens stay fp16
    codes = (closed + tokens - 4) * base_levels_nbytes(heads * dim, 5)
    side = closed // 32 * 2 * 2 * heads * dim + (tokens - 4) * 2 * 2 * heads * 2
    fp16 = (tokens - closed) * heads * dim * 2 + 4 * heads * dim * 2
    assert affine.stored_bytes() == {"codes": codes, "side": side, "fp16": fp16, "total": codes + side + fp16}
    fp = PackedKVCache(KVScheme("fp16", (16, 16)), 1)
    fp.update(k, v, 0)
    assert fp.stored_bytes()["total"] == 2 * tokens * heads * dim * 2
    mixed = PackedKVCache(KVScheme("turbo", (3, 4), thresholds=(-1.0,)), 1)  # every token scores above: high
    mixed.update(k, v, 0)
    assert mixed.high_fraction() == 1.0
    assert mixed.stored_bytes()["side"] == tokens * 2 * 2 * heads + (tokens + 7) // 8  # plus one flag bit a token


@pytest.mark.parametrize("levels", [2, 3, 5, 9, 16])
def test_affine_codes_stay_within_half_a_step(levels):
    rng = np.random.default_rng(levels)
    x = (rng.standard_normal((40, 2, 24)) * 3).astype(np.float32)
    lv = np.full(40, levels)
    codes, lo, hi = kv_affine.token_group_encode(x, lv, 8)
    assert codes.max() <= levels - 1 and lo.shape == (40, 2, 3)
    xh = kv_affine.token_group_decode(codes, lv, lo, hi, 8)
    step = (hi.astype(np.float32) - lo.astype(np.float32)) / (levels - 1)
    slack = np.abs(x).max() * 2e-3  # lo and hi are rounded to fp16
    assert np.all(np.abs(xh - x).reshape(40, 2, 3, 8) <= step[..., None] / 2 + slack)
    mixed = np.where(np.arange(40) < 20, levels, levels + 3)
    kc, klo, khi = kv_affine.channel_block_encode(x, mixed)  # one channel range, two precisions
    assert klo.shape == (2, 24) and kc[:20].max() <= levels - 1 and kc[20:].max() <= levels + 2
    err = np.abs(kv_affine.channel_block_decode(kc, mixed, klo, khi) - x)
    assert err[20:].mean() < err[:20].mean()
    flat = np.ones((3, 1, 8), np.float32)
    c, lo1, hi1 = kv_affine.token_group_encode(flat, np.full(3, levels), 8)
    assert np.all(c == 0) and np.all(kv_affine.token_group_decode(c, np.full(3, levels), lo1, hi1, 8) == 1)


def test_generation_runs_through_the_cache(tiny):
    model, windows = tiny
    scheme = KVScheme("turbo", (5, 5))
    cache = PackedKVCache(scheme, 2)
    ids = torch.from_numpy(windows[0, :12])[None]
    out = model.generate(ids, cache=cache, max_new_tokens=6, do_sample=False)
    assert out.shape == (1, 18) and cache.get_seq_length() == 17
    assert cache.stored_bytes()["codes"] > 0


def test_pre_rope_rotation_is_transformers_rope_and_its_exact_inverse(tiny):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model, _ = tiny
    theta = rope_theta_of(model.config)
    assert theta == model.config.rope_parameters["rope_theta"]
    x = torch.randn(1, 2, 300, model.config.head_dim, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(300)[None]
    cos, sin = model.model.rotary_emb(x, positions)
    _, expected = apply_rotary_pos_emb(x, x, cos, sin)
    mine = rope_rotate(x[0].transpose(0, 1).numpy(), np.arange(300), theta)
    np.testing.assert_array_equal(mine, expected[0].transpose(0, 1).numpy())
    back = rope_rotate(mine, np.arange(300), theta, inverse=True)
    np.testing.assert_allclose(back, x[0].transpose(0, 1).numpy(), atol=2e-6)
    assert rope_theta_of({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}) is None
    assert rope_theta_of({"rope_theta": 5e5, "partial_rotary_factor": 0.5}) is None
    assert rope_theta_of({"rope_theta": 5e5}) == 5e5


def test_sink_tokens_stay_fp16_and_are_counted():
    rng = np.random.default_rng(2)
    heads, dim, tokens = 3, 64, 75
    k = torch.from_numpy(rng.standard_normal((1, heads, tokens, dim)).astype(np.float32)).half().float()
    v = torch.from_numpy(rng.standard_normal((1, heads, tokens, dim)).astype(np.float32)).half().float()
    plain = PackedKVCache(KVScheme("turbo", (5, 5)), 1)
    sunk = PackedKVCache(KVScheme("turbo", (5, 5), sink=4), 1)
    plain.update(k, v, 0)
    sunk.update(k, v, 0)
    torch.testing.assert_close(sunk.layers[0].keys[:, :, :4], k[:, :, :4], rtol=0, atol=0)
    torch.testing.assert_close(sunk.layers[0].values[:, :, :4], v[:, :, :4], rtol=0, atol=0)
    torch.testing.assert_close(sunk.layers[0].keys[:, :, 4:], plain.layers[0].keys[:, :, 4:], rtol=0, atol=0)
    per_token_coded = 2 * (base_levels_nbytes(heads * dim, 5) + 2 * heads)
    assert sunk.stored_bytes()["fp16"] == 4 * 2 * heads * dim * 2
    assert sunk.stored_bytes()["total"] == (tokens - 4) * per_token_coded + 4 * 2 * heads * dim * 2
    affine = PackedKVCache(KVScheme("affine", (5, 5), key_block=32, sink=4), 1)
    affine.update(k, v, 0)  # key blocks start after the sink: tokens 4..35 and 36..67 closed, 68..74 open
    b = base_levels_nbytes(heads * dim, 5)
    assert affine.stored_bytes()["codes"] == (64 + tokens - 4) * b
    assert affine.stored_bytes()["fp16"] == (4 + 7) * heads * dim * 2 + 4 * heads * dim * 2


def test_pre_rope_keys_fit_per_channel_ranges_better():
    """Keys with a constant per-channel offset before RoPE: coded pre-RoPE their per-channel ranges are narrow."""
    rng = np.random.default_rng(3)
    heads, dim, tokens = 2, 32, 64
    pre = (rng.standard_normal((tokens, heads, dim)) * 0.2 + rng.standard_normal((1, heads, dim)) * 4)
    post = rope_rotate(pre.astype(np.float32), np.arange(tokens), 10000.0)
    post16 = torch.from_numpy(np.ascontiguousarray(post.transpose(1, 0, 2)))[None].half().float()
    errors = {}
    for theta in (0.0, 10000.0):
        cache = PackedKVCache(KVScheme("affine", (5, 5), key_block=32, rope_theta=theta), 1)
        cache.update(post16, post16, 0)
        errors[theta] = float((cache.layers[0].keys - post16).abs().mean())
    assert errors[10000.0] < 0.5 * errors[0.0]


# found by a black-box audit of the runtime caches (2026-12-07)

def test_hqq_group_size_and_a_model_none_fits():
    """`--kv hqq:2` on 1 KV head of 10 channels was a traceback (max() of nothing): refused, naming why."""
    from accel.errors import AccelError
    from accel.quantize.maps import parse_spec
    from accel.runtime.kv_baselines import hqq_group

    assert hqq_group(3, 64, 4) == 32 and hqq_group(3, 64, 2) == 16 and hqq_group(1, 10, 2) is None
    pytest.importorskip("hqq")
    config = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
              "hidden_size": 40}
    method, arg = parse_spec("kv", "hqq:2")
    with pytest.raises(AccelError, match="HQQ packs 4 groups in a row, and no group size"):
        method.from_eval_spec(arg, config)
    assert method.from_eval_spec("4", config).params["bits"] == 4  # 2 groups a row: a head of 10 in groups of 5


def test_quanto_bytes_per_sequence_do_not_depend_on_the_batch():
    """quanto packs 2-bit rows four to a byte across the whole batch, so the padding a sequence pays depended on
    how many were decoded beside it (eval --batch): counted per sequence."""
    pytest.importorskip("optimum.quanto")
    from transformers import LlamaConfig, QuantizedCache

    from accel.runtime.kv_baselines import tensor_bytes

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                         vocab_size=10)
    per_sequence = []
    for batch in (1, 2, 3):
        cache = QuantizedCache("quanto", config, nbits=2, axis_key=0, axis_value=0, q_group_size=16,
                               residual_length=4)
        keys = torch.randn(batch, 2, 9, 16, generator=torch.Generator().manual_seed(0))
        cache.update(keys, keys, 0)
        quantized = cache.layers[0]._quantized_keys
        per_sequence.append(tensor_bytes(quantized, batch) / batch)
        if batch > 1:  # the batch's own packing pads once for all sequences: fewer bytes than each alone
            assert tensor_bytes(quantized) < tensor_bytes(quantized, batch)
    assert per_sequence[0] == per_sequence[1] == per_sequence[2]


@pytest.mark.parametrize("spec,message", [
    ("turbo:8,sink=1,sink=2", "option sink is given twice"),
    ("affine:8,window=4,window=4", "option window is given twice"),
    ("quanto:4,residual=8,residual=16", "option residual is given twice"),
])
def test_a_kv_option_given_twice_is_refused(spec, message):
    """The last one won silently."""
    pytest.importorskip("optimum.quanto")
    from accel.errors import AccelError
    from accel.quantize.maps import parse_spec

    config = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "hidden_size": 64}
    method, arg = parse_spec("kv", spec)
    with pytest.raises(AccelError, match=message):
        method.from_eval_spec(arg, config)


def test_a_damp_option_given_twice_is_refused():
    from accel.errors import AccelError
    from accel.quantize.damp import parse_damp_arg

    with pytest.raises(AccelError, match="option rank is given twice"):
        parse_damp_arg("9.5,rank=energy,rank=persistence")
