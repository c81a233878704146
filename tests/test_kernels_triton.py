"""Triton kernels against the float64 reference: run on a CUDA GPU, or on CPU under TRITON_INTERPRET=1.

Without Triton, or with neither a GPU nor the interpreter, every test here skips.
"""

from __future__ import annotations

import numpy as np
import pytest

from accel.formats.tensor import encode_tensor
from accel.kernels import _build, triton_kernels

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not triton_kernels.available(), reason="needs triton and a CUDA GPU "
                                 "(or TRITON_INTERPRET=1)"),
              pytest.mark.skipif(not _build.compiler_available(), reason="no C compiler for the accel CPU kernels")]

CASES = [
    ("affine", {"levels": 256, "group": 64}), ("affine", {"levels": 16, "group": 64}),
    ("affine", {"levels": 4, "group": 16, "symmetric": True}), ("affine", {"levels": 3, "group": 32, "layout": "base"}),
    ("leech", {"shells": (13,), "layout": "planes", "seed_in": 2, "seed_out": 3}),
    ("leech", {"shells": (13, 3), "layout": "onehot", "seed_in": 2, "seed_out": 3}),
    ("leech", {"shells": (13, 3), "layout": "planes", "seed_in": 4, "seed_out": 5}),
    ("leech", {"shells": (12, 6), "layout": "planes", "seed_in": 6, "seed_out": 7}),
]


@pytest.mark.parametrize("shape", [(37, 53), (20, 96)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("codec,params", CASES, ids=["int8", "int4", "int2-sym", "base3", "leech2-planes",
                                                     "leech3-onehot", "leech3-planes-4+3", "leech-planes-4+4"])
def test_triton_matvec(rng, shape, codec, params):
    import torch

    from accel.kernels import kernel_weight
    from accel.kernels.reference import reference_matvec

    entry, arrays = encode_tensor("w", rng.standard_normal(shape), codec, **params)
    parts = {p: arrays[n] for p, n in entry.parts.items()}
    gpu = triton_kernels.gpu_weight(kernel_weight(entry, parts))
    x = rng.standard_normal(shape[1]).astype(np.float32)
    y = gpu.matvec(torch.from_numpy(x).to(triton_kernels._device())).cpu().double().numpy()
    ref = reference_matvec(entry, parts, x)
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-5


@pytest.mark.parametrize("params,kind", [
    ({"levels": 256, "group": 128}, "affine-words"), ({"levels": 16, "group": 32}, "affine-words"),
    ({"levels": 4, "group": 64}, "affine-words"), ({"levels": 4, "group": 16, "symmetric": True}, "affine-words"),
    ({"levels": 16, "group": 24}, "affine"), ({"levels": 8, "group": 64}, "affine")],
    ids=["int8-g128", "int4-g32", "int2-g64", "int2-sym-g16", "int4-g24", "int3-g64"])
def test_triton_affine_word_kernel_and_its_fallback(rng, params, kind):
    """8-, 4- and 2-bit codes whose groups are whole words (a power of two of them) take the word kernel, the rest
    the stream kernel; 45 x 300: six 8-row tiles (the last partial), groups cut by the last column."""
    import torch

    from accel.kernels import kernel_weight
    from accel.kernels.reference import reference_matvec

    entry, arrays = encode_tensor("w", rng.standard_normal((45, 300)), "affine", **params)
    parts = {p: arrays[n] for p, n in entry.parts.items()}
    gpu = triton_kernels.gpu_weight(kernel_weight(entry, parts))
    assert gpu.kind == kind
    x = rng.standard_normal(300).astype(np.float32)
    y = gpu.matvec(torch.from_numpy(x).to(triton_kernels._device())).cpu().double().numpy()
    ref = reference_matvec(entry, parts, x)
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-5


@pytest.mark.parametrize("codec,params", [CASES[4], CASES[6]], ids=["leech2-planes", "leech3-planes-4+3"])
def test_triton_leech_matvec_in_tiles_and_splits(rng, codec, params):
    """70 x 1000 (1008 coded columns): three 32-row tiles (the last one partial), 126 words split among 4
    programs a tile, 42 blocks' parity in two words a row, and twice over: the second call reuses the buffers."""
    import torch

    from accel.kernels import kernel_weight
    from accel.kernels.reference import reference_matvec

    entry, arrays = encode_tensor("w", rng.standard_normal((70, 1000)), codec, **params)
    parts = {p: arrays[n] for p, n in entry.parts.items()}
    gpu = triton_kernels.gpu_weight(kernel_weight(entry, parts))
    assert gpu.splits == 4 and gpu.parts == 4 and gpu.stages[0][0] == "nibble"
    for _ in range(2):
        x = rng.standard_normal(1000).astype(np.float32)
        y = gpu.matvec(torch.from_numpy(x).to(triton_kernels._device())).cpu().double().numpy()
        ref = reference_matvec(entry, parts, x)
        assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-5


@pytest.mark.parametrize("n", [24, 432, 1536, 2048, 4104])
def test_transform_kernel_against_float64(rng, n):
    """`_rht_kernel` is both seeded transforms: V (signs first) on a zero-padded input, plain or written as the
    Leech stages read it, and U^T on a sum of partial vectors with the row scales folded in before and the signs
    after."""
    import torch

    from accel.quantize.incoherence import _factors, rht, split_size

    signs, r = _factors(n, 77)
    odd = split_size(n)[0]

    def dev(a):
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(triton_kernels._device())

    def rel(got, want):
        return np.linalg.norm(got - want) / np.linalg.norm(want)

    x = rng.standard_normal(n)
    given = n - 5  # the last 5 elements are padding, read as zeros
    want = rht(np.where(np.arange(n) < given, x, 0.0), 77)
    forward = triton_kernels._Transform(signs, r, odd, dev)
    out = torch.full((n,), np.nan, device=triton_kernels._device())
    forward(dev(x[:given]), given, out)
    assert rel(out.cpu().numpy(), want) < 1e-6
    stage = torch.full((9 * n // 8,), np.nan, device=triton_kernels._device())
    forward(dev(x[:given]), given, stage, stage_input=True)
    rows = stage.cpu().double().numpy().reshape(9, n // 8)  # [n', k]: z[8k + n'] * 16^-m(n'), then word sums
    m = np.array([0, 1, 2, 3, 4, 2, 3, 4])
    assert rel((rows[:8] * 16.0 ** m[:, None]).T.reshape(-1), want) < 1e-6
    assert rel(rows[8], want.reshape(-1, 8).sum(axis=1)) < 1e-6
    inverse = triton_kernels._Transform(signs, r.T, odd, dev)
    scale, parts = rng.random(n), rng.standard_normal((3, n))
    out = torch.full((n,), np.nan, device=triton_kernels._device())
    inverse(dev(parts), n, out, pre=dev(scale), post=inverse.signs, parts=3)
    assert rel(out.cpu().numpy(), rht(parts.sum(axis=0) * scale, 77, inverse=True)) < 1e-6


@pytest.mark.parametrize("codec,params", [CASES[1], CASES[6]], ids=["int4", "leech3-planes-4+3"])
def test_gpu_weight_clone_is_the_same_weight_elsewhere(rng, codec, params):
    """bench/gpu.py cycles through clones so that weights stream from device memory: a clone computes the same
    output, bit for bit, from arrays of its own."""
    import torch

    from accel.kernels import kernel_weight

    entry, arrays = encode_tensor("w", rng.standard_normal((40, 96)), codec, **params)
    gpu = triton_kernels.gpu_weight(kernel_weight(entry, {p: arrays[n] for p, n in entry.parts.items()}))
    twin = gpu.clone()
    x = torch.from_numpy(rng.standard_normal(96).astype(np.float32)).to(triton_kernels._device())
    assert torch.equal(gpu.matvec(x), twin.matvec(x))

    def pointers(g):
        found = [v.data_ptr() for v in vars(g).values() if isinstance(v, torch.Tensor)]
        for _, args, _, _ in getattr(g, "stages", []):
            found += [a.data_ptr() for a in args]
        for t in getattr(g, "transforms", {}).values():
            found += [t.signs.data_ptr(), t.mat.data_ptr()]
        return found

    assert len(pointers(gpu)) >= 3 and not set(pointers(gpu)) & set(pointers(twin))


def test_gpu_bench_script_runs_under_the_triton_interpreter():
    """bench/gpu.py is what a session lent a GPU runs in its few minutes of device time: its plumbing (every kernel
    checked against float64, every arm timed, the JSON line) is exercised here on tiny shapes."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(root / "bench" / "gpu.py"), "--interpret"], check=False,
                         capture_output=True, text=True, timeout=300, cwd=root)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["goals"]["all_errors_ok"], out["matvec_errors"]
    assert {e["kernel"] for e in out["matvec_errors"]} == {"int8", "int4", "int2", "base3", "leech-planes",
                                                          "leech-onehot"}
    assert {r["kernel"] for r in out["rows"]} >= {"torch-fp16", "leech-planes"}
    assert len(out["state_rows"]) == 2 and out["state_error"]["ok"]


def test_gpu_bench_reports_a_failing_kernel_and_goes_on(monkeypatch):
    """On a lent GPU a kernel that fails to compile must cost only its own rows: the others are still checked and
    timed, and the failure is in the output."""
    import importlib.util
    from pathlib import Path

    import accel.kernels.state_update_triton as state_triton

    bench = Path(__file__).resolve().parents[1] / "bench"
    monkeypatch.syspath_prepend(str(bench))
    spec = importlib.util.spec_from_file_location("gpu_bench", bench / "gpu.py")
    gpu_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_bench)
    real = triton_kernels.gpu_weight

    def flaky(weight):
        if type(weight).__name__ == "LeechWeight":
            raise RuntimeError("simulated compile failure")
        return real(weight)

    monkeypatch.setattr(triton_kernels, "gpu_weight", flaky)
    rng = np.random.default_rng(0)
    errors, rows = gpu_bench.matvec_checks((37, 96), [(48, 96)], triton_kernels._device(), 1, rng)
    failed = {e["kernel"] for e in errors if not e["ok"]}
    assert failed == {"leech-planes", "leech-onehot"}
    assert all("simulated compile failure" in e["error"] for e in errors if not e["ok"])
    timed = {r["kernel"] for r in rows if "us" in r}
    assert {"torch-fp16", "int8", "int4", "int2", "base3"} <= timed and not timed & failed
    assert {r["kernel"] for r in rows if "error" in r} == failed

    def broken(*args, **kwargs):
        raise RuntimeError("simulated launch failure")

    monkeypatch.setattr(state_triton, "step_mixed_triton", broken)
    error, state_rows = gpu_bench.state_checks((1, 2, 16, 32), 2, 2, 16, 32, (1,), triton_kernels._device(), 1, rng)
    assert not error["ok"] and "simulated launch failure" in error["error"]
    (row,) = state_rows
    assert row["triton_damp_ms"] is None and row["speedup_vs_triton_f32"] is None
    assert row["torch_f32_ms"] is not None and "damp" in row["errors"]
