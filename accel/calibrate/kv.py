"""`accel calibrate --for kv`: the KV-cache quality cliff, token-importance indicators, and SemKV's choices.

On the calibration windows (all of them, each paired with itself at full precision):
1. Full-precision reference NLL per window; one pass with fp16 KV that also records, per layer and token, the
   token-importance indicators and the channel means of keys and values.
2. The sweep: uniform quantization at every L in 3..16 (and 24, 32 beyond the grid) for both bases, the per-window
   ΔNLL against the reference and its paired bootstrap 95% CI. "No detectable loss" means the CI lies inside
   ±MARGIN (0.01 nats/token), fixed here before any run. The cliff of a base is the lowest L that passes with
   every larger L of the grid passing too.
3. The indicators (key norm, value norm, accumulated attention, observation-window attention, and attention
   times value norm), their split-half stability (odd against even windows) and their agreement with each other.
4. SemKV mixes: the two grid levels around the cliff (the failing one below it and the cliff) at fractions 0.25,
   0.5 and 0.75 of tokens at the higher level, ranked by the write-time indicator that did better at 0.5.

Every arm runs through `accel.runtime.kv_cache.simulate` (the parallel equivalent of the packed cache) and its
bytes per token are measured by filling a real `PackedKVCache` with the arm's own keys and values. Writes
`report.json`, `sweep.md`, `sweep.png` (ΔNLL against code bits, CI bars) and `quantiles.safetensors` (per-layer
quantiles of the write-time scores, and the channel means) into <calib>/kv/.
"""

from __future__ import annotations

import json
import time
import warnings
from typing import Any

import numpy as np
import torch

from accel.calibrate import without_timings
from accel.calibrate.run import CalibContext, register_kind
from accel.eval.perplexity import window_nll
from accel.eval.stats import paired_bootstrap
from accel.formats.artifact import write_weights
from accel.formats.atomic import atomic_write_text
from accel.formats.bitpack import base_grouping
from accel.formats.tensor import encode_tensor
from accel.quantize.semkv import OPTION_KEYS, quantile_threshold
from accel.runtime.kv_cache import (
    RUNTIME_INDICATORS,
    KVScheme,
    PackedKVCache,
    fp16_bytes_per_token,
    model_kv_shape,
    rope_rotate,
    rope_theta_of,
    simulate,
    token_score,
)

MARGIN = 0.01  # nats/token: "no detectable loss" = the paired 95% CI lies inside ±MARGIN. Fixed in advance.
SWEEP_LEVELS = tuple(range(3, 17))
EXTRA_LEVELS = (24, 32)  # beyond the 3..16 grid, to locate a cliff above it
FRACTIONS = (0.25, 0.5, 0.75)
QUANTILES = 1000
INDICATORS = ("key_norm", "value_norm", "acc_attention", "obs_attention", "attention_x_value_norm")
# Per base: the map options every arm of the sweep uses (`sink`: first tokens kept in fp16; `pre_rope`: keys
# coded before RoPE, where the model has plain RoPE), and whether the per-token base is centered by the
# calibrated channel means and smoothed by the calibrated key scales.
BASE_OPTIONS = {"affine": {"key_block": 32, "value_group": 64, "window": 0, "sink": 1, "pre_rope": 1,
                           "center": False, "smooth": False},
                "turbo": {"key_block": 1, "value_group": 64, "window": 0, "sink": 1, "pre_rope": 1,
                          "center": True, "smooth": True}}
BYTES_WINDOWS = 4  # windows whose keys and values fill a real cache to measure the bytes of a mixed arm


def code_bits(levels: int) -> float:
    """Bits per code of the base-L packing (e.g. 7/3 for L = 5)."""
    g, bits = base_grouping(levels)
    return bits / g


class KVRecorder:
    """Observer for `simulate`: indicators, channel sums, or the keys and values that fill a cache."""

    def __init__(self, layers: int, obs_window: int, indicators: bool, keep: int = 0, rope_theta: float = 0.0,
                 skip: int = 0):
        self.layers, self.obs_window, self.indicators, self.keep = layers, obs_window, indicators, keep
        self.rope_theta, self.skip = rope_theta, skip  # channel statistics leave out the first `skip` tokens
        self.scores: dict[str, list[list[np.ndarray]]] = {name: [[] for _ in range(layers)] for name in INDICATORS}
        self.sums: dict[str, np.ndarray] = {}
        self.count = 0
        self.kept: list[dict[int, tuple[np.ndarray, np.ndarray]]] = []
        self.window = -1

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> None:
        kn, vn = k.numpy(), v.numpy()
        if layer == 0:
            self.window += 1
            if self.window < self.keep:
                self.kept.append({})
        if self.window < self.keep:
            self.kept[-1][layer] = (kn, vn)
        if not self.indicators:
            return
        kept = slice(self.skip, None)
        stats = [("key", kn[kept]), ("value", vn[kept])]
        stats.append(("key_sq", kn[kept].astype(np.float64) ** 2))
        if self.rope_theta:
            pre = rope_rotate(kn, np.arange(kn.shape[0]), self.rope_theta, inverse=True)[kept].astype(np.float64)
            stats += [("key_pre", pre), ("key_pre_sq", pre**2)]
        qn = q.double().numpy()[:, kept]  # [Hq, T, d] -> per KV head, summed over its query heads
        stats.append(("query_sq", (qn**2).sum(axis=1).reshape(k.shape[1], -1, qn.shape[-1]).sum(axis=1)[None]))
        for name, x in stats:
            self.sums.setdefault(name, np.zeros((self.layers, *x.shape[1:])))
            self.sums[name][layer] += x.sum(axis=0)
        if layer == 0:
            self.count += kn[kept].shape[0]
        length = kn.shape[0]
        groups = q.shape[0] // k.shape[1]
        keys = k.transpose(0, 1).repeat_interleave(groups, 0)  # [Hq, T, d]
        logits = (q @ keys.transpose(1, 2)) * scale
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1).double()  # [Hq, T(q), T(k)]
        received = probs.sum(dim=(0, 1)).numpy()
        obs = probs[:, length - self.obs_window:, :].sum(dim=(0, 1)).numpy()
        obs[length - self.obs_window:] = np.nan  # tokens inside the observation window are not scored
        vnorm = token_score("value_norm", kn, vn)
        seen_by = np.arange(length, 0, -1, dtype=np.float64)  # queries that can attend to token s
        rows = {"key_norm": token_score("key_norm", kn, vn), "value_norm": vnorm, "acc_attention": received,
                "obs_attention": obs, "attention_x_value_norm": received / seen_by * vnorm}
        for name, row in rows.items():
            self.scores[name][layer].append(row)

    def stacked(self, name: str) -> np.ndarray:
        """[windows, layers, T] scores of one indicator."""
        return np.stack([np.stack(per_layer) for per_layer in zip(*self.scores[name], strict=True)])


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    ok = np.isfinite(a) & np.isfinite(b)
    a, b = a[ok], b[ok]
    if a.size < 3:
        return float("nan")
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def indicator_stability(scores: dict[str, np.ndarray], buckets: int = 8) -> dict[str, Any]:
    """Split-half stability (even against odd windows) of each indicator, and the indicators' agreement."""
    out: dict[str, Any] = {"indicators": {}, "agreement_top25_jaccard": {}}
    for name, s in scores.items():  # s: [windows, layers, T]
        halves = (s[0::2], s[1::2])
        if len(halves[1]) == 0:
            out["indicators"][name] = {"profile_spearman": None, "fraction_transfer_error": None}
            continue
        length = s.shape[2]
        edges = np.linspace(0, length, buckets + 1).astype(int)
        with warnings.catch_warnings():  # buckets inside the observation window hold no scores
            warnings.simplefilter("ignore", RuntimeWarning)
            profiles = [np.stack([np.nanmean(h[:, :, edges[i]:edges[i + 1]], axis=(0, 2))
                                  for i in range(buckets)], 1) for h in halves]
        errors = []
        for frac in FRACTIONS:
            for a, b in ((0, 1), (1, 0)):
                thr = np.nanquantile(halves[a].transpose(1, 0, 2).reshape(s.shape[1], -1), 1 - frac, axis=1)
                other = halves[b].transpose(1, 0, 2).reshape(s.shape[1], -1)
                valid = np.isfinite(other)
                realized = ((other > thr[:, None]) & valid).sum(1) / valid.sum(1)
                errors.append(np.abs(realized - frac).mean())
        out["indicators"][name] = {"profile_spearman": _spearman(profiles[0].ravel(), profiles[1].ravel()),
                                   "fraction_transfer_error": float(np.mean(errors))}
    names = list(scores)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            sa, sb = scores[a], scores[b]
            valid = np.isfinite(sa) & np.isfinite(sb)
            vals = []
            for w in range(sa.shape[0]):
                for layer in range(sa.shape[1]):
                    m = valid[w, layer]
                    x, y = sa[w, layer, m], sb[w, layer, m]
                    k = max(1, x.size // 4)
                    top_x, top_y = set(np.argsort(-x)[:k]), set(np.argsort(-y)[:k])
                    vals.append(len(top_x & top_y) / len(top_x | top_y))
            out["agreement_top25_jaccard"][f"{a}~{b}"] = float(np.mean(vals))
    return out


def channel_statistics(sums: dict[str, np.ndarray], count: int) -> dict[str, np.ndarray]:
    """Channel means of keys (as received and pre-RoPE) and values, and the smoothing scales of the keys.

    The scale of a key channel is (E[(k - mean)^2] / E[q^2])^(1/4), both shared by the two channels of a RoPE
    pair (so it commutes with the rotation), normalized to geometric mean 1 per head. Per-token coding after a
    random rotation spreads its error evenly over the coded channels; dividing by s first puts error ∝ s^2 on
    channel j, and E[(q·e)^2] ∝ sum_j E[q_j^2] s_j^2 · sum_j var_j / s_j^2 is smallest at s_j^4 ∝ var_j / E[q_j^2]
    (Cauchy-Schwarz): more error where queries are small, less where they are large.
    """
    out = {name: (sums[name] / count).astype(np.float32) for name in ("key", "value", "key_pre") if name in sums}
    query = sums["query_sq"] / count
    for name, key in (("key_scale", "key"), ("key_scale_pre", "key_pre")):
        if key not in sums:
            continue
        var = np.maximum(sums[f"{key}_sq"] / count - (sums[key] / count) ** 2, 0.0)
        half = var.shape[-1] // 2
        var_pair = np.concatenate([(var[..., :half] + var[..., half:]) / 2] * 2, axis=-1)
        q_pair = np.concatenate([(query[..., :half] + query[..., half:]) / 2] * 2, axis=-1)
        tiny = 1e-12 * max(float(var_pair.max()), 1e-30)
        scale = ((var_pair + tiny) / (q_pair + 1e-12 * max(float(q_pair.max()), 1e-30))) ** 0.25
        out[name] = (scale / np.exp(np.log(scale).mean(axis=-1, keepdims=True))).astype(np.float32)
    return out


def base_options(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """BASE_OPTIONS for one model: pre-RoPE key coding only where the model uses plain RoPE."""
    plain_rope = rope_theta_of(config) is not None
    return {b: {**o, "pre_rope": int(o["pre_rope"] and plain_rope)} for b, o in BASE_OPTIONS.items()}


def scheme_for(base: str, levels: tuple[int, int], thresholds: np.ndarray | None, indicator: str,
               means: dict[str, np.ndarray], seed: int, options: dict[str, Any], rope_theta: float) -> KVScheme:
    opts = options[base]
    pre = bool(opts["pre_rope"])
    center, smooth = opts["center"], opts["smooth"]
    return KVScheme(base=base, levels=levels, thresholds=None if thresholds is None else tuple(map(float, thresholds)),
                    indicator=indicator, seed=seed, key_block=opts["key_block"], value_group=opts["value_group"],
                    window=opts["window"], sink=opts["sink"], rope_theta=rope_theta if pre else 0.0,
                    key_mean=means["key_pre" if pre else "key"] if center else None,
                    value_mean=means["value"] if center else None,
                    key_scale=means["key_scale_pre" if pre else "key_scale"] if smooth else None)


def measure_bytes(scheme: KVScheme, kept: list[dict[int, tuple[np.ndarray, np.ndarray]]], layers: int
                  ) -> dict[str, float]:
    """Fill real caches with the arm's keys and values (all but the last token, as eval holds) -> bytes/token."""
    totals, tokens, high = {"codes": 0, "side": 0, "fp16": 0, "total": 0}, 0, 0.0
    for window in kept:
        cache = PackedKVCache(scheme, layers)
        for layer in range(layers):
            k, v = window[layer]
            kt = torch.from_numpy(np.ascontiguousarray(k[:-1].transpose(1, 0, 2)))[None]
            vt = torch.from_numpy(np.ascontiguousarray(v[:-1].transpose(1, 0, 2)))[None]
            cache.update(kt, vt, layer)
        for key, n in cache.stored_bytes().items():
            totals[key] += n
        tokens += cache.tokens()
        high += cache.high_fraction() * cache.tokens()
    return {"bytes_per_token": totals["total"] / tokens, "high_fraction": high / tokens,
            **{f"{k}_per_token": v / tokens for k, v in totals.items() if k != "total"}}


class _Sweep:
    def __init__(self, ctx: CalibContext, ref: np.ndarray, means: dict[str, np.ndarray], fp16_bytes: int):
        self.ctx, self.ref, self.means, self.fp16_bytes = ctx, ref, means, fp16_bytes
        self.model = ctx.loaded.model
        self.layers = int(self.model.config.num_hidden_layers)

    def arm(self, name: str, scheme: KVScheme, bytes_windows: int) -> dict[str, Any]:
        started = time.perf_counter()
        recorder = KVRecorder(self.layers, 1, indicators=False, keep=bytes_windows)
        with simulate(self.model, scheme, observer=recorder) as record:
            nll = window_nll(self.model, self.ctx.windows, self.ctx.progress.advance).nll
        delta = paired_bootstrap(nll, self.ref, seed=self.ctx.settings.seed)
        size = measure_bytes(scheme, recorder.kept, self.layers)
        row = {"arm": name, "base": scheme.base, "levels": list(scheme.levels), "indicator": scheme.indicator,
               "code_bits": code_bits(scheme.levels[0]) if scheme.levels[0] == scheme.levels[1] else None,
               "bits_per_value": 8 * size["bytes_per_token"] / (self.fp16_bytes / 2),
               "reduction": self.fp16_bytes / size["bytes_per_token"], **size,
               "sim_high_fraction": float(record.high.sum() / max(1, record.tokens.sum())),
               "delta_nll": delta.mean, "ci": [delta.low, delta.high],
               "passes": bool(-MARGIN <= delta.low and delta.high <= MARGIN),
               "window_delta_nll": [float(x) for x in nll - self.ref], "seconds": time.perf_counter() - started}
        return row


def find_cliff(rows: list[dict[str, Any]]) -> int | None:
    """The lowest L that passes with every larger L passing too (rows of one base, uniform)."""
    cliff = None
    for row in sorted(rows, key=lambda r: -r["levels"][0]):
        if not row["passes"]:
            break
        cliff = row["levels"][0]
    return cliff


@register_kind("kv")
def calibrate_kv(ctx: CalibContext) -> dict[str, Any]:
    started = time.perf_counter()
    model, windows, progress = ctx.loaded.model, ctx.windows, ctx.progress
    config = dict(ctx.loaded.config)
    layers, kv_heads, head_dim = model_kv_shape(config)
    fp16_bytes = fp16_bytes_per_token(config)
    seed = ctx.settings.seed
    length = windows.shape[1]
    levels = SWEEP_LEVELS + EXTRA_LEVELS
    options = base_options(config)
    theta = rope_theta_of(config) or 0.0
    progress.stage(f"kv: reference and indicators ({len(windows)} windows)", 2 * len(windows))
    ref = window_nll(model, windows, progress.advance).nll
    recorder = KVRecorder(layers, max(1, min(32, length // 4)), indicators=True, keep=1, rope_theta=theta,
                          skip=max(o["sink"] for o in options.values()))
    with simulate(model, None, observer=recorder):
        fp16_nll = window_nll(model, windows, progress.advance).nll
    progress.close()
    means = channel_statistics(recorder.sums, recorder.count)
    scores = {name: recorder.stacked(name) for name in INDICATORS}
    quantiles = {name: np.quantile(scores[name].transpose(1, 0, 2).reshape(layers, -1),
                                   np.linspace(0, 1, QUANTILES + 1), axis=1).T for name in RUNTIME_INDICATORS}
    fp16_delta = paired_bootstrap(fp16_nll, ref, seed=seed)

    sweep = _Sweep(ctx, ref, means, fp16_bytes)
    rows: list[dict[str, Any]] = []
    progress.stage(f"kv: sweep L = {levels[0]}..{levels[-1]}, two bases", 2 * len(levels) * len(windows))
    for base in ("affine", "turbo"):
        for lv in levels:
            rows.append(sweep.arm(f"{base}-{lv}", scheme_for(base, (lv, lv), None, "key_norm", means, seed,
                                                                 options, theta), 1))
    progress.close()
    cliffs = {base: find_cliff([r for r in rows if r["base"] == base]) for base in ("affine", "turbo")}

    def thresholds(indicator: str, frac: float) -> np.ndarray:
        return quantile_threshold(quantiles[indicator], frac)

    def pair(base: str) -> tuple[int, int] | None:
        cliff = cliffs[base]
        if cliff is None or cliff == levels[0]:
            return None
        return levels[levels.index(cliff) - 1], cliff

    # the indicator probe: both write-time indicators at 0.5 on the first base with a cliff
    probe_base = next((b for b in ("affine", "turbo") if pair(b)), "affine")
    probe_pair = pair(probe_base) or (levels[-2], levels[-1])
    planned = [(probe_base, probe_pair, 0.5, ind) for ind in RUNTIME_INDICATORS]
    planned += [(b, pair(b), f, None) for b in ("affine", "turbo") if pair(b) for f in FRACTIONS
                if not (b == probe_base and f == 0.5)]
    progress.stage(f"kv: {len(planned)} SemKV mixes", len(planned) * len(windows))
    mixes: list[dict[str, Any]] = []
    runtime_indicator = RUNTIME_INDICATORS[0]
    for i, (base, lohi, frac, indicator) in enumerate(planned):
        if indicator is None:
            indicator = runtime_indicator
        scheme = scheme_for(base, lohi, thresholds(indicator, frac), indicator, means, seed, options, theta)
        name = f"{base}-{lohi[0]}/{lohi[1]}@{frac}" + (f":{indicator}" if i < len(RUNTIME_INDICATORS) else "")
        mixes.append({**sweep.arm(name, scheme, BYTES_WINDOWS), "frac": frac})
        if i == len(RUNTIME_INDICATORS) - 1:  # the probe is done: rank the rest with the better indicator
            probe = mixes[: len(RUNTIME_INDICATORS)]
            runtime_indicator = min(probe, key=lambda r: (r["delta_nll"],
                                                          RUNTIME_INDICATORS.index(r["indicator"])))["indicator"]
    progress.close()

    recommendations: dict[str, Any] = {}
    for base in ("affine", "turbo"):
        candidates = [r for r in rows if r["base"] == base and r["levels"][0] == cliffs[base]]
        candidates += [r for r in mixes if r["base"] == base and r["indicator"] == runtime_indicator
                       and r["passes"] and tuple(r["levels"]) == pair(base)]
        candidates = [r for r in candidates if r["passes"]]
        if not candidates:
            recommendations[base] = None
            continue
        best = min(candidates, key=lambda r: r["bytes_per_token"])
        recommendations[base] = {"base": base, "levels": best["levels"], "frac": best.get("frac", 0.0),
                                 "bits_per_value": best["bits_per_value"], "reduction": best["reduction"],
                                 "delta_nll": best["delta_nll"], "ci": best["ci"], "arm": best["arm"]}

    stability = indicator_stability(scores)
    report = {"margin": MARGIN, "model_shape": [layers, kv_heads, head_dim], "windows": len(windows),
              "seq_len": int(length), "fp16_bytes_per_token": fp16_bytes,
              "options": {b: {k: int(o[k]) for k in OPTION_KEYS} for b, o in options.items()},
              "centered": {b: o["center"] for b, o in options.items()},
              "smoothed": {b: o["smooth"] for b, o in options.items()},
              "fp16": {"delta_nll": fp16_delta.mean, "ci": [fp16_delta.low, fp16_delta.high]},
              "reference_nll": float(ref.mean()), "sweep": rows, "cliff": cliffs, "mixes": mixes,
              "runtime_indicator": runtime_indicator, "recommendations": recommendations,
              "stability": stability, "seconds": time.perf_counter() - started}
    _write(ctx, report, quantiles, means)
    return summary(report)


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """The compact part that goes into calibration.json and --json."""
    return {"margin": report["margin"], "cliff": report["cliff"], "runtime_indicator": report["runtime_indicator"],
            "recommendations": report["recommendations"], "fp16": report["fp16"],
            "sweep": [{k: r[k] for k in ("arm", "code_bits", "bits_per_value", "delta_nll", "ci", "passes")}
                      for r in report["sweep"]],
            "stability": report["stability"], "seconds": report["seconds"]}


def sweep_markdown(report: dict[str, Any]) -> str:
    title = (f"KV sweep: {report['windows']} windows x {report['seq_len']} tokens, margin ±{report['margin']} "
             f"nats/token (95% paired bootstrap CI inside the margin = no detectable loss)")
    lines = [title, "",
             "| arm | code bits | bits/value (measured) | reduction vs fp16 | ΔNLL | 95% CI | no detectable loss |",
             "|---|---|---|---|---|---|---|"]
    for r in report["sweep"] + report["mixes"]:
        cb = f"{r['code_bits']:.3f}" if r["code_bits"] is not None else "mixed"
        lines.append(f"| {r['arm']} | {cb} | {r['bits_per_value']:.3f} | {r['reduction']:.2f}x | "
                     f"{r['delta_nll']:+.4f} | [{r['ci'][0]:+.4f}, {r['ci'][1]:+.4f}] | "
                     f"{'yes' if r['passes'] else 'no'} |")
    lines += ["", f"cliff: {report['cliff']}; write-time indicator: {report['runtime_indicator']}", ""]
    return "\n".join(lines)


def plot_sweep(report: dict[str, Any], path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for base, color in (("affine", "tab:blue"), ("turbo", "tab:orange")):
        rows = [r for r in report["sweep"] if r["base"] == base]
        x = np.array([r["code_bits"] for r in rows])
        y = np.array([r["delta_nll"] for r in rows])
        err = np.array([[r["delta_nll"] - r["ci"][0] for r in rows], [r["ci"][1] - r["delta_nll"] for r in rows]])
        ax.errorbar(x, y, yerr=err, fmt="o-", color=color, capsize=3, label=f"{base} (uniform L)")
        for r in rows:
            ax.annotate(str(r["levels"][0]), (r["code_bits"], r["delta_nll"]), textcoords="offset points",
                        xytext=(3, 4), fontsize=6, color=color)
    ax.axhspan(-report["margin"], report["margin"], color="green", alpha=0.12, label=f"±{report['margin']} margin")
    ax.axhline(0, color="black", lw=0.6)
    ax.set_yscale("symlog", linthresh=0.01)
    ax.set_xlabel("code bits per value (base-L packing)")
    ax.set_ylabel("ΔNLL vs full precision (nats/token)")
    ax.set_title(f"KV cliff: {report['windows']} windows x {report['seq_len']} tokens, 95% CI")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _write(ctx: CalibContext, report: dict[str, Any], quantiles: dict[str, np.ndarray],
           means: dict[str, np.ndarray]) -> None:
    report["plot"] = "sweep.png" if plot_sweep(report, ctx.out_dir / "sweep.png") else None
    text = json.dumps(without_timings(report), indent=1, sort_keys=True) + "\n"
    atomic_write_text(ctx.out_dir / "report.json", text)
    atomic_write_text(ctx.out_dir / "sweep.md", sweep_markdown(report))
    tensors = [encode_tensor(f"quantiles.{name}", q.astype(np.float32), "raw", role="data", dtype="float32")
               for name, q in quantiles.items()]
    tensors += [encode_tensor(f"mean.{name}", m.astype(np.float32), "raw", role="data", dtype="float32")
                for name, m in means.items()]
    write_weights(ctx.out_dir, tensors, extra={"kv_calibration": {"margin": MARGIN}})

