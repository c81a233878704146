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
               on_window: Callable[[], None] | None = None, batch: int = 1) -> WindowNLL:
    """Teacher-forced NLL decoded one token at a time through a fresh cache per window.

    Every attention read (or recurrent-state read) goes through the cache `make_cache()` returns, which is how a
    quantized KV cache or state cache is measured rather than simulated. With `batch` > 1, that many windows
    (all of one length) decode side by side as one batch through one cache: each sequence still reads only its
    own cached state, so the result is the same up to float32 summation order, and much faster for small models.
    """
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    out = np.empty(len(windows), dtype=np.float64)
    for first in range(0, len(windows), batch):
        ids = torch.from_numpy(np.ascontiguousarray(windows[first:first + batch]))
        cache = make_cache()
        total = torch.zeros(ids.shape[0], dtype=torch.float64)
        for t in range(ids.shape[1] - 1):
            logits = model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True).logits[:, -1].float()
            total -= torch.log_softmax(logits, dim=-1).gather(1, ids[:, t + 1:t + 2])[:, 0].double()
        out[first:first + ids.shape[0]] = (total / (ids.shape[1] - 1)).numpy()
        if on_window:
            for _ in range(ids.shape[0]):
                on_window()
    return WindowNLL(nll=out, tokens=int(windows.shape[0] * (windows.shape[1] - 1)))
