"""`accel calibrate --for state`: per layer, head and d_k channel statistics of GDN / KDA recurrent states.

The windows run through the model in segments of `SEGMENT` tokens with a recording cache (transformers' cache
API: every linear-attention layer stores its new state with `update_recurrent_state`), so each window gives one
state snapshot per segment and layer. Per channel (a d_k row of a head's state) it records:

- energy: the mean squared INT8 quantization error of the row (per-row absmax scale, as the runtime stores it),
  summed over the row's d_v values;
- persistence: how long an error written into the channel survives, from the decay gates α_t = exp(g_t) (GDN:
  one per head and token, from `A_log`, `dt_bias` and `in_proj_a`; KDA: one per channel and token, the forget
  gate's output). An error e written at step t is e·α_{t+1}···α_{t+n} n steps later; with gates independent
  across steps its expected energy is e²·m^n, m = E[α²] (the mean of exp(2g) over all calibration tokens). So
  persistence = Σ_{n<T} m^n, T the window length: the energy an error keeps, summed over the steps it survives
  (1 for a channel that forgets at once, T for one that never decays). The mean log decay E[g] goes in the
  table too;
- stability: both statistics again on two disjoint halves of the windows (even and odd windows), and the
  Spearman rank correlation between the halves.

It writes `model.safetensors` (an accel container: energy, persistence, mean_log_decay as [layers, heads, d_k];
the half-data versions as [2, layers, heads, d_k]), `table.md`, and PNG plots (when matplotlib is installed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from accel.calibrate.run import CalibContext, register_kind
from accel.errors import AccelError
from accel.formats.artifact import Artifact, write_weights
from accel.formats.tensor import encode_tensor
from accel.progress import SILENT, Progress
from accel.runtime.state_cache import int_round_trip, quantize_rows
from accel.runtime.state_shapes import StateShape, state_shape

SEGMENT = 32  # tokens between state snapshots
STATE_DIR = "state"
ARRAYS = ("energy", "persistence", "mean_log_decay", "mean_decay2", "energy_half", "persistence_half")
# written since the water-filling allocation (`--state damp:…,alloc=water`); older directories lack them
TIER_BITS = tuple(range(2, 17))  # INT-K widths whose error energy is recorded, in energy_tiers' order
OPTIONAL = ("energy_tiers", "sensitivity", "sensitivity_half")


class _RecordingCache(DynamicCache):
    def __init__(self, config: Any, on_state):
        super().__init__(config=config)
        self._on_state = on_state

    def update_recurrent_state(self, recurrent_states, layer_idx, state_idx=0, **kwargs):
        self._on_state(layer_idx, recurrent_states)
        return super().update_recurrent_state(recurrent_states, layer_idx, state_idx, **kwargs)


def _gate_modules(model: torch.nn.Module, shape: StateShape) -> dict[int, torch.nn.Module]:
    """Layer index -> the module whose forward output gives the log decay."""
    layers = model.model.layers
    out = {}
    for li in shape.layers:
        layer = layers[li]
        if shape.arch == "gdn":
            mixer = getattr(layer, "linear_attn", None)
            if mixer is None or not (hasattr(mixer, "in_proj_a") or hasattr(mixer, "in_proj_ba")):
                raise AccelError(f"layer {li}: no Gated DeltaNet module (linear_attn.in_proj_a or in_proj_ba) found")
            out[li] = mixer
        else:
            mixer = getattr(layer, "self_attn", None)
            if mixer is None or not hasattr(mixer, "forget_gate"):
                raise AccelError(f"layer {li}: no Kimi Delta Attention module (self_attn.forget_gate) found")
            out[li] = mixer
    return out


def decay_input_of_ba(mixer: torch.nn.Module, ba: torch.Tensor) -> torch.Tensor:
    """`a` ([..., value heads]) out of Qwen3-Next's joint b/a projection, which holds [b | a] for each key head's
    group of value heads (as its `fix_query_key_value_ordering` splits it)."""
    nk, nv = mixer.num_k_heads, mixer.num_v_heads
    return ba.view(*ba.shape[:-1], nk, 2 * (nv // nk))[..., nv // nk:].reshape(*ba.shape[:-1], nv)


@torch.inference_mode()
def collect_state_stats(model: torch.nn.Module, windows: np.ndarray, segment: int = SEGMENT,
                        progress: Progress = SILENT) -> dict[str, Any]:
    """Energy and decay sums per half of the windows; see the module docstring."""
    shape = state_shape(model.config)
    pos = {li: i for i, li in enumerate(shape.layers)}
    nl, h, dk = len(shape.layers), shape.heads, shape.d_k
    energy = np.zeros((2, nl, h, dk))
    tiers = np.zeros((len(TIER_BITS), nl, h, dk))
    snapshots = np.zeros(2)
    log_decay = np.zeros((2, nl, h, dk))
    decay2 = np.zeros((2, nl, h, dk))
    tokens = np.zeros(2)
    half = [0]

    def on_state(layer_idx: int, state: torch.Tensor) -> None:
        if layer_idx not in pos:
            return
        b = state.shape[0]
        rows = state.detach().float().reshape(-1, shape.d_v)
        err = (quantize_rows(rows, "int8") - rows).double().pow(2).sum(-1).reshape(b, h, dk).sum(0)
        energy[half[0], pos[layer_idx]] += err.numpy()
        for t, k in enumerate(TIER_BITS):
            tiers[t, pos[layer_idx]] += (int_round_trip(rows, k) - rows).double().pow(2).sum(-1).reshape(
                b, h, dk).sum(0).numpy()
        if layer_idx == shape.layers[0]:
            snapshots[half[0]] += b

    def gate_hook(layer_idx: int, mixer: torch.nn.Module):
        if shape.arch == "gdn":
            def hook(_mod, _args, a):
                g = -mixer.A_log.float().exp() * torch.nn.functional.softplus(a.float() + mixer.dt_bias.float())
                add_gates(layer_idx, g.double()[..., None])  # [B, T, H, 1]: one gate per head
            if hasattr(mixer, "in_proj_a"):  # Qwen3.5: a projection of its own
                return mixer.in_proj_a.register_forward_hook(hook)

            def hook_ba(module, args, ba):  # Qwen3-Next: b and a in one projection
                hook(module, args, decay_input_of_ba(mixer, ba))
            return mixer.in_proj_ba.register_forward_hook(hook_ba)

        def hook(_mod, _args, g):
            add_gates(layer_idx, g.double())  # [B, T, H, d_k]
        return mixer.forget_gate.register_forward_hook(hook)

    def add_gates(layer_idx: int, g: torch.Tensor) -> None:
        log_decay[half[0], pos[layer_idx]] += g.sum(dim=(0, 1)).numpy()
        decay2[half[0], pos[layer_idx]] += (2.0 * g).exp().sum(dim=(0, 1)).numpy()

    handles = [gate_hook(li, m) for li, m in _gate_modules(model, shape).items()]
    try:
        progress.stage("calibrating (recurrent states)", len(windows))
        for w, window in enumerate(windows):
            half[0] = w % 2
            ids = torch.from_numpy(np.ascontiguousarray(window))[None]
            cache = _RecordingCache(model.config, on_state)
            for start in range(0, ids.shape[1], segment):
                model.model(input_ids=ids[:, start:start + segment], cache=cache, use_cache=True)
            tokens[half[0]] += ids.shape[1]
            progress.advance()
        progress.close()
    finally:
        for handle in handles:
            handle.remove()
    if snapshots.min() == 0:
        raise AccelError("state calibration needs at least 2 windows (one per half of the data)")
    sens = collect_sensitivity(model, windows, segment, progress)
    seq_len = windows.shape[1]
    e_half = energy / snapshots[:, None, None, None]
    m_half = decay2 / tokens[:, None, None, None]
    m_all = decay2.sum(0) / tokens.sum()
    return {
        "shape": shape,
        "energy": energy.sum(0) / snapshots.sum(),
        "energy_half": e_half,
        "mean_log_decay": log_decay.sum(0) / tokens.sum(),
        "mean_decay2": m_all,
        "persistence": persistence(m_all, seq_len),
        "persistence_half": persistence(m_half, seq_len),
        "energy_tiers": tiers / snapshots.sum(),
        "sensitivity": sens.sum(0) / 2.0,
        "sensitivity_half": sens,
        "snapshots": int(snapshots.sum()),
        "tokens": int(tokens.sum()),
        "seq_len": int(seq_len),
        "segment": int(segment),
    }


class _SensingCache(DynamicCache):
    """Hands each linear layer its state plus a zero leaf tensor, so the loss's gradient reaches that leaf."""

    def __init__(self, config: Any, layers: dict[int, int]):
        super().__init__(config=config)
        self._layers, self.leaves = layers, []

    def get_recurrent_state(self, layer_idx, state_idx=0):
        state = super().get_recurrent_state(layer_idx, state_idx)
        if state is None or state_idx != 0 or layer_idx not in self._layers:
            return state
        leaf = torch.zeros_like(state, requires_grad=True)
        self.leaves.append((layer_idx, leaf))
        return state + leaf


def collect_sensitivity(model: torch.nn.Module, windows: np.ndarray, segment: int = SEGMENT,
                        progress: Progress = SILENT) -> np.ndarray:
    """[2 halves, layers, heads, d_k]: per channel, the mean over state reads of Σ_v (∂NLL/∂S[c, v])².

    Each window runs in segments of `segment` tokens; where a segment reads a layer's state, a zero leaf is
    added to it, and one backward pass of the window's summed next-token NLL gives the gradient of every later
    token's loss with respect to the state there (through the recurrence, the later layers and the head). An
    error e in channel c changes the loss by about ½ Σ_v F[c, v] e_v² (F the Fisher information, estimated by
    the squared gradient), so the channel's expected loss from a quantizer of error energy D is about
    ½ sensitivity·D / d_v: the weight water-filling gives each channel's error energy (docs/damp.md).
    """
    shape = state_shape(model.config)
    pos = {li: i for i, li in enumerate(shape.layers)}
    sums = np.zeros((2, len(shape.layers), shape.heads, shape.d_k))
    reads = np.zeros(2)
    progress.stage("calibrating (state sensitivity)", len(windows))
    with torch.inference_mode(False), torch.enable_grad():
        for w, window in enumerate(windows):
            ids = torch.from_numpy(np.ascontiguousarray(window))[None]
            cache = _SensingCache(model.config, pos)
            loss = torch.zeros((), dtype=torch.float64)
            for start in range(0, ids.shape[1], segment):
                chunk = ids[:, start:start + segment + 1]
                out = model(input_ids=chunk[:, :segment], cache=cache, use_cache=True)
                n = chunk.shape[1] - 1
                if n > 0:
                    logp = torch.log_softmax(out.logits[0, :n].float(), dim=-1)
                    loss = loss - logp.gather(1, chunk[0, 1:, None]).double().sum()
            if cache.leaves and loss.requires_grad:
                grads = torch.autograd.grad(loss, [leaf for _, leaf in cache.leaves], allow_unused=True)
                for (li, _), g in zip(cache.leaves, grads):
                    if g is not None:
                        sums[w % 2, pos[li]] += g.detach().double().pow(2).sum(-1).sum(0).numpy()
                reads[w % 2] += ids.shape[0] * (len(cache.leaves) // max(1, len(pos)))
            progress.advance()
    progress.close()
    return sums / np.maximum(reads, 1)[:, None, None, None]


def persistence(mean_decay2: np.ndarray, horizon: int) -> np.ndarray:
    """Σ_{n<horizon} m^n, m = E[α²]: the summed expected energy of a unit error over the steps it survives."""
    m = np.clip(mean_decay2, 0.0, 1.0)
    out = np.full(m.shape, float(horizon))
    far = m < 1.0 - 1e-9
    out[far] = (1.0 - m[far] ** horizon) / (1.0 - m[far])
    return out


def rank(x: np.ndarray) -> np.ndarray:
    """Ranks 0..n-1 with ties given their mean rank."""
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    order = np.argsort(x, kind="stable")
    ranks = np.empty(x.size)
    ranks[order] = np.arange(x.size, dtype=np.float64)
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=ranks)
    return sums[inverse] / counts[inverse]


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = rank(a), rank(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = np.sqrt((ra * ra).sum() * (rb * rb).sum())
    return float((ra * rb).sum() / denom) if denom > 0 else float("nan")


def top_share(energy: np.ndarray, fraction: float = 0.10) -> float:
    """Share of the total error energy held by the top `fraction` of channels."""
    flat = np.sort(np.asarray(energy, dtype=np.float64).reshape(-1))[::-1]
    k = max(1, round(fraction * flat.size))
    total = flat.sum()
    return float(flat[:k].sum() / total) if total > 0 else float("nan")


def top_overlap(a: np.ndarray, b: np.ndarray, fraction: float = 0.2) -> float:
    """Fraction of the top `fraction` channels by `a` that are also in the top by `b`."""
    k = max(1, round(fraction * a.size))
    ta = set(np.argsort(-a.reshape(-1), kind="stable")[:k].tolist())
    tb = set(np.argsort(-b.reshape(-1), kind="stable")[:k].tolist())
    return len(ta & tb) / k


def stability(stats: dict[str, Any]) -> dict[str, float]:
    shape: StateShape = stats["shape"]
    e, p = stats["energy_half"], stats["persistence_half"]
    # GDN persistence is one number per head: correlate heads, not their repeated channels
    p0, p1 = (p[0][..., 0], p[1][..., 0]) if shape.arch == "gdn" else (p[0], p[1])
    score = e * p
    out = {"energy_rank_corr": spearman(e[0], e[1]), "persistence_rank_corr": spearman(p0, p1),
           "score_rank_corr": spearman(score[0], score[1]),
           "score_top20_overlap": top_overlap(score[0], score[1], 0.2)}
    if "sensitivity_half" in stats:
        f = stats["sensitivity_half"]
        out["sensitivity_rank_corr"] = spearman(f[0], f[1])
        out["sensitivity_score_rank_corr"] = spearman(e[0] * f[0], e[1] * f[1])
    return out


@register_kind("state")
def record_state(ctx: CalibContext) -> dict[str, Any]:
    """Write <calib>/state: the container of statistics, table.md and the plots."""
    stats = collect_state_stats(ctx.loaded.model, ctx.windows, SEGMENT, ctx.progress)
    return write_state_stats(ctx.out_dir, stats)


def write_state_stats(out_dir: Path, stats: dict[str, Any]) -> dict[str, Any]:
    shape: StateShape = stats["shape"]
    corr = stability(stats)
    report = {"arch": shape.arch, "layers": list(shape.layers), "heads": shape.heads, "d_k": shape.d_k,
              "d_v": shape.d_v, "snapshots": stats["snapshots"], "tokens": stats["tokens"],
              "segment": stats["segment"], "seq_len": stats["seq_len"],
              "top10_energy_share": top_share(stats["energy"]),
              "top10_score_share": top_share(stats["energy"] * stats["persistence"]), **corr}
    if "sensitivity" in stats:
        report["top10_sensitivity_share"] = top_share(stats["energy"] * stats["sensitivity"])
    encoded = [encode_tensor(name, np.asarray(stats[name], dtype=np.float32), "raw", role="data", dtype="float32")
               for name in ARRAYS + OPTIONAL if name in stats]
    write_weights(Path(out_dir), encoded, extra={"state": {**report, "shape": shape.to_json()}})
    (Path(out_dir) / "table.md").write_text(state_table(stats, report), encoding="utf-8")
    report["plots"] = write_plots(Path(out_dir), stats, corr)
    return report


def state_table(stats: dict[str, Any], report: dict[str, Any]) -> str:
    shape: StateShape = stats["shape"]
    e, p, g = stats["energy"], stats["persistence"], stats["mean_log_decay"]
    lines = [f"# Recurrent-state channel statistics ({shape.arch}, {shape.describe()})", "",
             (f"{report['snapshots']} state snapshots per layer (every {report['segment']} tokens of "
              f"{report['tokens']} tokens, windows of {report['seq_len']})."), "",
             ("Energy: mean squared INT8 error of a channel (row of d_v values). Persistence: Σ_n m^n over "
              "the window, m = E[α²] the mean squared decay gate."), "",
             ("| layer | head | energy mean | energy max | top-10% channels' share | mean log decay "
              "(min..max) | persistence (min..max) |"),
             "|---|---|---|---|---|---|---|"]
    for i, li in enumerate(shape.layers):
        for hh in range(shape.heads):
            lines.append(f"| {li} | {hh} | {e[i, hh].mean():.3e} | {e[i, hh].max():.3e} | "
                         f"{top_share(e[i, hh]):.3f} | {g[i, hh].min():.4f}..{g[i, hh].max():.4f} | "
                         f"{p[i, hh].min():.2f}..{p[i, hh].max():.2f} |")
    lines += ["", "| statistic | value |", "|---|---|"]
    for key in ("top10_energy_share", "top10_score_share", "top10_sensitivity_share", "energy_rank_corr", "persistence_rank_corr",
                "score_rank_corr", "score_top20_overlap", "sensitivity_rank_corr", "sensitivity_score_rank_corr"):
        if key in report:
            lines.append(f"| {key} | {report[key]:.4f} |")
    return "\n".join(lines) + "\n"


def write_plots(out_dir: Path, stats: dict[str, Any], corr: dict[str, float]) -> list[str]:
    """energy.png, persistence.png, concentration.png, split_half.png; [] when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    shape: StateShape = stats["shape"]
    nl = len(shape.layers)
    written = []
    for name, arr, label in (("energy", np.log10(stats["energy"] + 1e-30), "log10 INT8 error energy"),
                             ("persistence", np.log10(stats["persistence"]), "log10 persistence")):
        fig, axes = plt.subplots(nl, 1, figsize=(8, 1.2 + 0.35 * shape.heads * nl), squeeze=False)
        vmin, vmax = float(arr.min()), float(arr.max())
        for i, li in enumerate(shape.layers):
            ax = axes[i, 0]
            im = ax.imshow(arr[i], aspect="auto", interpolation="nearest", vmin=vmin, vmax=vmax, cmap="viridis")
            ax.set_ylabel(f"layer {li}\nhead")
        axes[-1, 0].set_xlabel("d_k channel")
        fig.colorbar(im, ax=axes[:, 0].tolist(), label=label)
        fig.suptitle(f"{shape.arch}: {label} per layer, head, channel")
        fig.savefig(out_dir / f"{name}.png", dpi=90)
        plt.close(fig)
        written.append(f"{name}.png")

    fig, ax = plt.subplots(figsize=(5, 4))
    for label, arr in (("energy", stats["energy"]), ("energy x persistence", stats["energy"] * stats["persistence"])):
        flat = np.sort(arr.reshape(-1))[::-1]
        ax.plot(np.arange(1, flat.size + 1) / flat.size, np.cumsum(flat) / flat.sum(), label=label)
    ax.axvline(0.1, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("fraction of channels (sorted)")
    ax.set_ylabel("cumulative share")
    ax.set_title("concentration of INT8 error energy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "concentration.png", dpi=90)
    plt.close(fig)
    written.append("concentration.png")

    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    e, p = stats["energy_half"], stats["persistence_half"]
    axes[0].scatter(rank(e[0]), rank(e[1]), s=3)
    axes[0].set_title(f"energy ranks, halves (rho {corr['energy_rank_corr']:.3f})")
    p0, p1 = (p[0][..., 0], p[1][..., 0]) if shape.arch == "gdn" else (p[0], p[1])
    axes[1].scatter(rank(p0), rank(p1), s=6)
    axes[1].set_title(f"persistence ranks, halves (rho {corr['persistence_rank_corr']:.3f})")
    for ax in axes:
        ax.set_xlabel("rank, even windows")
        ax.set_ylabel("rank, odd windows")
    fig.tight_layout()
    fig.savefig(out_dir / "split_half.png", dpi=90)
    plt.close(fig)
    written.append("split_half.png")
    return written


def read_state_stats(calib_dir: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(arrays, document) of <calib>/state, or an AccelError saying how to make it."""
    path = Path(calib_dir) / STATE_DIR
    if not path.is_dir():
        raise AccelError(f"--calib {calib_dir}: no state statistics (run `accel calibrate MODEL --for state` first)")
    art = Artifact(path)
    doc = art.extra.get("state")
    if not isinstance(doc, dict) or not isinstance(doc.get("shape"), dict):
        raise AccelError(f"--calib {calib_dir}: {STATE_DIR}/ lacks its state document")
    arrays = {}
    for name in ARRAYS + OPTIONAL:
        if name not in art.names:
            if name in OPTIONAL:
                continue
            raise AccelError(f"--calib {calib_dir}: {STATE_DIR}/ lacks the array {name!r}")
        arrays[name] = art.decode(name).astype(np.float64)
    art.close()
    return arrays, doc
