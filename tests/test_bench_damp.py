"""bench/damp.py's per-window KL when windows decode in batches (a pure function of the per-step KLs)."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from damp import mean_kl


def test_mean_kl_averages_each_windows_own_steps_across_batches():
    # 5 windows of 4 tokens (3 steps each) decoded in batches of 2, 2 and 1: step t of batch b is [batch] KLs
    kl = np.arange(15, dtype=np.float64).reshape(5, 3) ** 2  # window w, step t
    steps = [torch.from_numpy(kl[b:b + 2, t].copy()) for b in (0, 2) for t in range(3)]
    steps += [torch.from_numpy(kl[4:5, t].copy()) for t in range(3)]
    np.testing.assert_allclose(mean_kl(steps, 5, 4), kl.mean(axis=1))
    with pytest.raises(AssertionError):
        mean_kl(steps, 6, 4)
