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
]


@pytest.mark.parametrize("shape", [(37, 53), (20, 96)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("codec,params", CASES, ids=["int8", "int4", "int2-sym", "base3", "leech2-planes",
                                                     "leech3-onehot"])
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
