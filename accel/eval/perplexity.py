"""Perplexity of a causal LM over token windows, with per-window NLL kept for paired comparisons."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class WindowNLL:
    nll: np.ndarray  # mean NLL per window, nats/token, float64
    tokens: int  # predicted tokens in all

    @property
    def mean(self) -> float:
        return float(self.nll.mean())

    @property
    def ppl(self) -> float:
        return float(np.exp(self.mean))


@torch.inference_mode()
def window_nll(model: torch.nn.Module, windows: np.ndarray, on_window: Callable[[], None] | None = None) -> WindowNLL:
    """Teacher-forced NLL of every next token in each window (every window has the same length)."""
    out = np.empty(len(windows), dtype=np.float64)
    for i, window in enumerate(windows):
        ids = torch.from_numpy(np.ascontiguousarray(window))[None]
        logits = model(input_ids=ids).logits[0, :-1].float()
        logp = torch.log_softmax(logits, dim=-1)
        picked = logp.gather(1, ids[0, 1:, None])[:, 0]
        out[i] = -picked.double().mean().item()
        if on_window:
            on_window()
    return WindowNLL(nll=out, tokens=int(windows.shape[0] * (windows.shape[1] - 1)))


@torch.inference_mode()
def decode_nll(model: torch.nn.Module, windows: np.ndarray, make_cache: Callable[[], object],
               on_window: Callable[[], None] | None = None) -> WindowNLL:
    """Teacher-forced NLL decoded one token at a time through a fresh cache per window.

    Every attention read (or recurrent-state read) goes through the cache `make_cache()` returns, which is how a
    quantized KV cache or state cache is measured rather than simulated.
    """
    out = np.empty(len(windows), dtype=np.float64)
    for i, window in enumerate(windows):
        ids = torch.from_numpy(np.ascontiguousarray(window))[None]
        cache = make_cache()
        total = 0.0
        for t in range(ids.shape[1] - 1):
            logits = model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True).logits[0, -1].float()
            total -= float(torch.log_softmax(logits, dim=-1)[ids[0, t + 1]].double())
        out[i] = total / (ids.shape[1] - 1)
        if on_window:
            on_window()
    return WindowNLL(nll=out, tokens=int(windows.shape[0] * (windows.shape[1] - 1)))
