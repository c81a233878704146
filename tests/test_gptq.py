"""Incoherence transforms, error feedback (GPTQ / block LDLQ) and Hessian calibration."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from accel.calibrate.hessians import collect_hessians
from accel.quantize.gptq import damped_inverse_cholesky, error_feedback, proxy_loss
from accel.quantize.gptq_affine import gptq_affine
from accel.quantize.incoherence import (
    rht,
    split_size,
    transform_hessian,
    transform_weight,
    untransform_weight,
)


@pytest.mark.parametrize("n", [1, 7, 24, 64, 576, 1536, 4096, 14336])
def test_rht_is_orthogonal_for_any_size(n, rng):
    x = rng.standard_normal((3, n))
    y = rht(x, seed=11)
    assert np.allclose(np.linalg.norm(y, axis=1), np.linalg.norm(x, axis=1))
    assert np.allclose(rht(y, seed=11, inverse=True), x, atol=1e-12)
    assert not np.allclose(rht(x, seed=12), y) or n == 1


def test_rht_matches_its_dense_matrix(rng):
    n = 96  # 3 * 32
    q = rht(np.eye(n), seed=3)  # row i = Q e_i, i.e. Q^T
    assert np.allclose(q @ q.T, np.eye(n), atol=1e-12)
    x = rng.standard_normal(n)
    assert np.allclose(rht(x, seed=3), q.T @ x)
    assert split_size(576) == (9, 64) and split_size(14336) == (7, 2048)


def test_rht_spreads_an_outlier(rng):
    x = np.zeros(576)
    x[5] = 1.0
    assert np.abs(rht(x, seed=0)).max() < 0.5


def test_weight_transform_roundtrip_and_proxy_loss_invariance(rng):
    w = rng.standard_normal((48, 96))
    x = rng.standard_normal((500, 96)) * np.linspace(0.1, 3, 96)
    h = x.T @ x
    wt = transform_weight(w, seed_out=1, seed_in=2)
    assert np.allclose(untransform_weight(wt, 1, 2), w, atol=1e-12)
    e = rng.standard_normal(wt.shape) * 0.01
    original_space = untransform_weight(wt + e, 1, 2)
    assert proxy_loss(w, original_space, h) == pytest.approx(proxy_loss(wt, wt + e, transform_hessian(h, 2)))


def _classic_gptq(w, h, quant, damp=0.01):
    """Frantar et al.'s column loop, float64, no lazy batching: the reference for error_feedback."""
    w = w.copy()
    u = damped_inverse_cholesky(h, damp)
    q = np.zeros_like(w)
    for j in range(w.shape[1]):
        q[:, j] = quant(w[:, j])
        err = (w[:, j] - q[:, j]) / u[j, j]
        w[:, j + 1 :] -= np.outer(err, u[j, j + 1 :])
    return q


def _grid(col):
    return np.round(col * 4) / 4


def _correlated(rng, n=72):
    x = rng.standard_normal((400, n)) @ rng.standard_normal((n, n)) * 0.3
    return x.T @ x / 400


def test_error_feedback_equals_classic_gptq(rng):
    w, h = rng.standard_normal((16, 72)), _correlated(rng)
    ours = error_feedback(w, damped_inverse_cholesky(h), 1, lambda a, ahead: _grid(ahead[:, :1]), lazy=24)
    assert np.allclose(ours, _classic_gptq(w, h, _grid), atol=1e-9)


def test_block_feedback_with_sequential_inner_quantizer_equals_gptq(rng):
    w, h = rng.standard_normal((16, 72)), _correlated(rng)
    u = damped_inverse_cholesky(h)

    def inner(a, ahead):  # quantize the 24-column block column by column with feedback inside the block
        blk = ahead[:, :24].copy()
        out = np.zeros_like(blk)
        for j in range(24):
            out[:, j] = _grid(blk[:, j])
            err = (blk[:, j] - out[:, j]) / u[a + j, a + j]
            blk[:, j + 1 :] -= np.outer(err, u[a + j, a + j + 1 : a + 24])
        return out

    assert np.allclose(error_feedback(w, u, 24, inner, lazy=48), _classic_gptq(w, h, _grid), atol=1e-9)


def test_feedback_lowers_the_proxy_loss(rng):
    w, h = rng.standard_normal((64, 72)), _correlated(rng)
    rtn = _grid(w)
    fb = error_feedback(w, damped_inverse_cholesky(h), 1, lambda a, ahead: _grid(ahead[:, :1]))
    assert proxy_loss(w, fb, h) < 0.8 * proxy_loss(w, rtn, h)


def test_gptq_affine_values_lie_on_their_stored_grid(rng):
    w, h = rng.standard_normal((8, 100)), _correlated(rng, 100)
    q, scale, offset = gptq_affine(w, h, levels=8, group=32)
    assert q.shape == w.shape and scale.shape == (8, 4)
    s = np.repeat(scale.astype(np.float64), 32, axis=1)[:, :100]
    o = np.repeat(offset.astype(np.float64), 32, axis=1)[:, :100]
    codes = (q - o) / np.where(s > 0, s, 1)
    assert np.allclose(codes, np.rint(codes), atol=1e-6) and codes.min() > -1e-6 and codes.max() < 7 + 1e-6


def test_collect_hessians_matches_direct_inputs(tiny_llama):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    windows = np.random.default_rng(0).integers(0, model.config.vocab_size, size=(3, 20))
    hessians, key_of = collect_hessians(model, windows)
    assert key_of["model.layers.0.self_attn.k_proj.weight"] == "model.layers.0.self_attn.q_proj.weight"
    assert key_of["model.layers.1.mlp.up_proj.weight"] == "model.layers.1.mlp.gate_proj.weight"
    assert len(hessians) == 4 * model.config.num_hidden_layers
    captured = []
    layer = model.model.layers[1].mlp.down_proj
    handle = layer.register_forward_pre_hook(lambda m, args: captured.append(args[0].reshape(-1, args[0].shape[-1])))
    with torch.inference_mode():
        for window in windows:
            model(input_ids=torch.from_numpy(window)[None])
    handle.remove()
    x = torch.cat(captured).double().numpy()
    assert np.allclose(hessians["model.layers.1.mlp.down_proj.weight"], x.T @ x / x.shape[0], rtol=1e-5, atol=1e-8)


def test_hqq_arm_decodes_like_hqq_itself(rng):
    from hqq.core.quantize import Quantizer

    from accel.formats.tensor import decode_parts
    from accel.quantize.hqq_affine import _hqq
    from accel.quantize.methods import WeightSettings

    w = rng.standard_normal((16, 128)).astype(np.float32)
    entry, arrays = _hqq(3)("w", w, WeightSettings(group=64))
    ours = decode_parts(entry, {p: arrays[n] for p, n in entry.parts.items()})
    w_q, meta = Quantizer.quantize(torch.from_numpy(w), nbits=3, group_size=64, optimize=True, axis=1,
                                   bitpack=False, device="cpu", compute_dtype=torch.float32)
    meta["compute_dtype"] = torch.float32
    theirs = Quantizer.dequantize(w_q, meta).numpy()
    step = np.abs(w).max() / 7
    assert np.abs(ours - theirs).max() < 0.02 * step  # fp16 side data only
    assert entry.params["levels"] == 8


@pytest.mark.parametrize("cols", [32, 100, 70])
def test_hqq_rows_that_are_not_whole_groups(rng, cols):
    """Rows shorter than a group, or with a shorter last group (tiny-kda's MLA projection is 32 wide), were
    refused; the whole groups are HQQ's own, the last group is optimized on its own, as the codec stores it."""
    from hqq.core.quantize import Quantizer

    from accel.formats.tensor import decode_parts
    from accel.quantize.hqq_affine import _hqq
    from accel.quantize.methods import WeightSettings

    w = rng.standard_normal((8, cols)).astype(np.float32)
    entry, arrays = _hqq(3)("w", w, WeightSettings(group=64))
    ours = decode_parts(entry, {p: arrays[n] for p, n in entry.parts.items()})
    whole = cols - cols % 64
    for c0, c1 in ((0, whole), (whole, cols)):
        if c1 > c0:
            w_q, meta = Quantizer.quantize(torch.from_numpy(np.ascontiguousarray(w[:, c0:c1])), nbits=3,
                                           group_size=min(64, c1 - c0), optimize=True, axis=1, bitpack=False,
                                           device="cpu", compute_dtype=torch.float32)
            meta["compute_dtype"] = torch.float32
            theirs = Quantizer.dequantize(w_q, meta).numpy()
            # the same grid: equal up to the fp16 side data, but for the rare element that sits on a rounding
            # boundary and lands one step over (HQQ rounds with float32 scales, the codec with the stored fp16 ones)
            off = np.abs(ours[:, c0:c1] - theirs) > 0.02 * np.abs(w).max() / 7
            assert off.mean() < 0.02
            mine, hqq = np.abs(ours[:, c0:c1] - w[:, c0:c1]).mean(), np.abs(theirs - w[:, c0:c1]).mean()
            assert mine < 1.01 * hqq


@pytest.mark.parametrize("table", ["a string", {"model.layers.0.mlp.down_proj.weight": ""},
                                   {"model.layers.0.mlp.down_proj.weight": {"x": 1}}])
def test_a_damaged_hessian_table_is_refused_in_one_line(tiny_llama, text_file, tmp_path, table):
    """Found by fuzzing the Hessian directory's document: AttributeError, KeyError, TypeError tracebacks."""
    import json
    import struct

    from test_container import _set_doc

    from accel.calibrate.hessians import HESSIAN_DIR, HessianStore
    from accel.cli.main import main
    from accel.errors import AccelError

    calib = tmp_path / "c"
    assert main(["calibrate", str(tiny_llama), "--for", "weights", "--data", str(text_file), "--out", str(calib),
                 "--samples", "2", "--seq-len", "32"]) == 0
    path = calib / HESSIAN_DIR / "model.safetensors"
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    doc = json.loads(header["__metadata__"]["accel"])
    doc["hessians"] = table
    _set_doc(header, doc)
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + raw[8 + n:])
    with pytest.raises(AccelError, match="is damaged"):
        HessianStore(calib)

