"""The mixed-precision recurrent-state cache: row formats, byte accounting, decoding through transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from accel.errors import AccelError
from accel.eval.evaluate import EvalSettings, evaluate
from accel.eval.load import load_causal_lm
from accel.eval.perplexity import decode_nll, window_nll
from accel.fixtures.corpus import heldout_text
from accel.formats.bitpack import pack_bits
from accel.kernels import state_update
from accel.runtime.state_cache import (
    QuantizedStateCache,
    StateRuntime,
    StateScheme,
    decode_rows,
    decode_rows_torch,
    encode_rows,
    encode_rows_torch,
    pack_codes,
    quantize_rows,
    row_bits,
    unpack_codes,
)
from accel.runtime.state_shapes import StateShape, state_shape


@pytest.mark.parametrize("width", [3, 4, 5, 8, 9, 12])
def test_torch_bit_packing_is_the_format_librarys(width):
    codes = np.random.default_rng(width).integers(0, 2**width, size=101 if width != 4 else 102)
    stream = pack_codes(torch.from_numpy(codes), width)
    np.testing.assert_array_equal(stream.numpy(), pack_bits(codes, width))
    np.testing.assert_array_equal(unpack_codes(stream, width, codes.size).numpy(), codes)


@pytest.mark.skipif(not state_update.available(), reason="needs gcc for the C row coder")
@pytest.mark.parametrize("k", [2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15, 16])
def test_c_row_coder_is_the_torch_definition_bit_for_bit(k):
    """The cache codes INT-K rows in C (numpy's packing was most of a decode step); the parts and the decoded
    rows are those of the torch/numpy definition in every bit, at d_v 64 and 24,
    with all-zero rows, ties at half a step and values past the clamp."""
    rng = np.random.default_rng(k)
    for dv in (64, 24):
        rows = torch.from_numpy((rng.normal(size=(300, dv)) * rng.uniform(0, 20, size=(300, 1))).astype(np.float32))
        rows[0] = 0.0
        rows[1, :4] = torch.tensor([0.5, 1.5, -2.5, 1e-30])  # ties round to even; a tiny value next to them
        rows[1, 4:] = 0.0
        rows[1, 5] = 2.0 ** (k - 1) - 1
        fmt = f"int{k}"
        mine, ref = encode_rows(rows, fmt), encode_rows_torch(rows, fmt)
        assert torch.equal(mine["codes"], ref["codes"])
        assert torch.equal(mine["scales"].view(torch.int16), ref["scales"].view(torch.int16))
        assert torch.equal(decode_rows(mine, fmt, 300, dv), decode_rows_torch(ref, fmt, 300, dv))
    bad = rows.clone()
    bad[7, 3] = float("nan")  # non-finite rows take the torch path (whatever it does with them)

    def outcome(encode):
        try:
            return encode(bad, f"int{k}")["codes"]
        except ValueError as exc:
            return str(exc)

    mine, ref = outcome(encode_rows), outcome(encode_rows_torch)
    assert mine == ref if isinstance(ref, str) else torch.equal(mine, ref)


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "bf16", "fp8", "int8", "int4", "int6", "int10"])
def test_row_formats_round_trip_within_their_step(fmt):
    rows = torch.from_numpy(np.random.default_rng(0).normal(size=(24, 32)).astype(np.float32))
    rows[3] = 0.0  # an all-zero row must not divide by zero
    parts = encode_rows(rows, fmt)
    back = decode_rows(parts, fmt, 24, 32)
    assert 8 * sum(t.numel() * t.element_size() for t in parts.values()) == pytest.approx(
        row_bits(fmt, 32) * rows.numel(), abs=8)
    absmax = rows.abs().amax(-1, keepdim=True)
    if fmt.startswith("int"):
        k = int(fmt[3:])
        bound = absmax / (2 ** (k - 1) - 1) * 0.5 * 1.002 + 1e-9
    elif fmt == "fp8":
        bound = absmax * 2.0**-4
    else:
        bound = rows.abs() * torch.finfo({"fp32": torch.float32, "fp16": torch.float16,
                                          "bf16": torch.bfloat16}[fmt]).eps
    assert ((back - rows).abs() <= bound).all()
    assert (back[3] == 0).all()


def test_scheme_splits_channels_and_counts_bits():
    shape = StateShape("kda", (0, 2), 2, 8, 16)
    mask = torch.zeros(16, dtype=torch.bool)
    mask[[1, 5, 9]] = True
    scheme = StateScheme(shape, low="int8", high="fp32", masks={0: mask})
    state = torch.randn(3, 2, 8, 16)
    stored = scheme.store(0, state)
    back = scheme.load(0, stored).reshape(3, 16, 16)
    assert torch.equal(back[:, mask], state.reshape(3, 16, 16)[:, mask])  # fp32 channels are exact
    assert stored.nbytes == 3 * (3 * 16 * 4 + 13 * (16 + 2))
    assert scheme.bits_per_value() == pytest.approx((3 * 32 + 13 * 9 + 16 * 9) / 32)
    with pytest.raises(AccelError, match="scheme is for 2x8x16"):
        scheme.store(0, torch.randn(1, 2, 8, 8))


def test_scheme_with_a_format_per_row():
    shape = StateShape("gdn", (1,), 2, 8, 32)
    fmts = [f"int{k}" for k in (2, 3, 16, 5, 5, 9, 8, 12, 3, 3, 7, 16, 2, 4, 6, 11)]
    scheme = StateScheme(shape, low="int8", row_formats={1: fmts})
    state = torch.randn(2, 2, 8, 32)
    stored = scheme.store(1, state)
    back = scheme.load(1, stored).reshape(2, 16, 32)
    rows = state.reshape(2, 16, 32)
    for i, fmt in enumerate(fmts):  # each row exactly as its own format stores it
        assert torch.equal(back[:, i], quantize_rows(rows[:, i], fmt))
    assert stored.nbytes == 2 * sum(4 * int(f[3:]) + 2 for f in fmts)  # K bits x 32 values + a float16 scale
    assert scheme.bits_per_value() == pytest.approx(np.mean([int(f[3:]) for f in fmts]) + 0.5)
    assert 8 * stored.nbytes / (2 * 16 * 32) == scheme.bits_per_value()
    with pytest.raises(AccelError, match="15 row formats for 16 rows"):
        StateScheme(shape, low="int8", row_formats={1: fmts[:15]})
    with pytest.raises(AccelError, match="unknown state format 'int17'"):
        StateScheme(shape, low="int8", row_formats={1: fmts[:15] + ["int17"]})
    with pytest.raises(AccelError, match="more than two tiers"):
        scheme.split(1)


@pytest.mark.parametrize("fixture", ["tiny-gdn", "tiny-kda"])
def test_fp32_state_cache_decodes_exactly_like_the_model(fixture):
    loaded = load_causal_lm(fixture)
    text = "def f(x):\n    return x + 1\n\nThe with statement is used to wrap the execution of a block."
    windows = np.asarray(loaded.tokenizer(text)["input_ids"][:48], dtype=np.int64)[None]
    plain = window_nll(loaded.model, windows)
    shape = state_shape(loaded.config)
    caches = []

    def make():
        caches.append(QuantizedStateCache(loaded.model.config, StateScheme(shape, low="fp32")))
        return caches[-1]

    decoded = decode_nll(loaded.model, windows, make)
    np.testing.assert_allclose(decoded.nll, plain.nll, rtol=1e-5)
    assert set(caches[0].stored) == set(shape.layers) and caches[0].stores == len(shape.layers) * 47
    assert caches[0].state_nbytes() == 4 * shape.values


def test_batched_decode_matches_window_by_window_and_counts_bytes_per_sequence():
    """Windows decoded side by side read only their own states: an fp32 state gives each window's teacher-forced
    NLL, and a quantized cache's report counts bytes per sequence, not per batch."""
    loaded = load_causal_lm("tiny-gdn")
    ids = np.asarray(loaded.tokenizer(heldout_text()[:4000])["input_ids"], dtype=np.int64)
    windows = ids[: 5 * 40].reshape(5, 40)
    plain = window_nll(loaded.model, windows)
    shape = state_shape(loaded.config)
    fp32 = StateRuntime(loaded.model, StateScheme(shape, low="fp32"))
    batched = decode_nll(loaded.model, windows, fp32.make_cache, batch=2)  # batches of 2, 2 and 1
    np.testing.assert_allclose(batched.nll, plain.nll, rtol=1e-5)
    assert [c.sequences() for c in fp32.caches] == [2, 2, 1]
    for batch in (1, 3):
        int8 = StateRuntime(loaded.model, StateScheme(shape, low="int8"))
        nll = decode_nll(loaded.model, windows, int8.make_cache, batch=batch).nll
        assert np.abs(nll - plain.nll).max() < 0.05
        report = int8.report()
        assert report["state_bytes"] == 3 * 4 * 64 * 64 * 8.25 / 8 and report["state_bits_per_value"] == 8.25
    with pytest.raises(ValueError, match="batch must be at least 1"):
        decode_nll(loaded.model, windows, fp32.make_cache, batch=0)


def test_uniform_baselines_through_eval(text_file):
    settings = {"data": text_file, "windows": 1, "seq_len": 32}
    int8 = evaluate("tiny-gdn", EvalSettings(state="int8", **settings))
    assert int8["state_bits_per_value"] == pytest.approx(8.25)  # 8-bit codes + a float16 scale per 64 values
    assert int8["state_bytes"] == 3 * 4 * 64 * 64 * 8.25 / 8 and int8["state_fp32_bytes"] == 3 * 4 * 64 * 64 * 4
    int6 = evaluate("tiny-kda", EvalSettings(state="int:6", **settings))
    assert int6["state_bits_per_value"] == pytest.approx(6.25) and int6["state"]["method"] == "int"
    plain = evaluate("tiny-gdn", EvalSettings(**settings))
    assert abs(int8["nll"] - plain["nll"]) < 0.05
    with pytest.raises(AccelError, match="unknown --state method 'int7'"):
        evaluate("tiny-gdn", EvalSettings(state="int7", **settings))
    with pytest.raises(AccelError, match="needs a bit width"):
        evaluate("tiny-gdn", EvalSettings(state="int", **settings))


def test_model_without_recurrent_state_is_refused(tiny_llama, text_file):
    with pytest.raises(AccelError, match="has no recurrent state"):
        evaluate(tiny_llama, EvalSettings(data=text_file, windows=1, seq_len=16, state="int8"))
