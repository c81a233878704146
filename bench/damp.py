"""DAMP against uniform recurrent-state quantization on the trained fixtures, decoding token by token.

    OMP_NUM_THREADS=1 .venv/bin/python bench/damp.py [--quick] [--fixtures tiny-gdn,tiny-kda] [--json]
        [--arms 'int:9;damp:9.5,alloc=water'] [--windows N] [--skip-windows N] [--stats DIR]
        [--text heldout|docstrings] [--batch B]

For each fixture: `accel calibrate --for state` on training text (windows of `accel.fixtures.corpus.train_text`),
then every arm decodes the same held-out windows (`heldout_text`, never trained on) one token at a time through
`accel.runtime.state_cache.QuantizedStateCache`, so every read of a recurrent state is of the quantized storage.
Per arm: bits per state value and state bytes (measured from the stored parts), NLL, the paired ΔNLL against
the fp32 arm with a bootstrap 95% interval over windows, and the mean per-token KL divergence of the next-token
distribution from the fp32 arm's (far more sensitive than ΔNLL: it is never negative and needs no luck in the
sampled text). The matched table compares DAMP with the uniform arm of equal bits per value (and with the same
formats on random channels), paired per window. Arms: fp32, bf16, fp16, uniform INT8 / FP8 / INT4 (one
float16 scale per channel), and, at matched budgets, uniform INT-K (K = 5, 6, 9, 10); DAMP's two-tier map at 9.9
bits and at INT9 / 6 / 5's exact bits; its ranking ablations at 9.9 (energy alone, persistence alone, random
channels with the same formats); DAMP with water-filled INT-K widths per channel (`alloc=water`, weighted by the
measured gradient sensitivity) at exactly uniform INT-K's bits (K + 16/d_v: 10.25, 9.25, 8.25, 6.25, 5.25, 4.25 at
the fixtures' d_v = 64) and at 9.9, with its weighting ablations (energy x persistence, energy alone, random
weights). `--arms` runs a subset (fp32 always first), `--stats` keeps the calibration. `--text docstrings` evaluates on
the standard library's docstrings (`accel.fixtures.corpus.docstring_text`, also never trained on, ~3,300
windows) where the held-out pydoc text's ~57 windows cannot resolve small differences; `--batch` windows decode
side by side, each through its own quantized state (9.7x faster per window at 32 on tiny-gdn; the tables in
docs/benchmarks.md before 2026-12-03 18:00 decoded one at a time, `--batch 1`: a float32 state gives the same
figures to 1e-7, a quantized one a different rounding history, as another text would; docs/architecture.md).
"No detectable loss" means the ΔNLL interval lies inside ±MARGIN nats/token, a margin fixed before the final runs;
`detectable` says whether the interval excludes zero.
Also reported: the share of INT8 error energy in the top 10% of channels, and the split-half rank correlations.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from accel.calibrate.run import CalibSettings, pick_windows
from accel.calibrate.state import collect_state_stats, write_state_stats
from accel.eval.data import token_windows
from accel.eval.load import load_causal_lm
from accel.eval.perplexity import decode_nll
from accel.eval.stats import paired_bootstrap
from accel.fixtures.corpus import docstring_text, heldout_text, train_text
from accel.quantize.damp import damp_map, parse_damp_arg
from accel.quantize.maps import parse_spec
from accel.runtime.state_shapes import state_shape
from bench.benchargs import non_negative, positive, run_main

MARGIN = 0.001  # nats/token: the "no detectable loss" margin, fixed before the final runs (docs/damp.md)

UNIFORM = ["fp32", "bf16", "fp16", "int8", "fp8", "int4", "int:5", "int:6", "int:9", "int:10"]


def matched_budget(k: int, d_v: int) -> str:
    """Uniform INT-K's bits per value: K-bit codes plus one float16 scale per channel row of d_v values."""
    return f"{k + 16 / d_v:g}"


def damp_arms(d_v: int) -> list[str]:
    """DAMP arms for a fixture whose state rows hold d_v values: the two-tier map at 9.9 bits and at uniform
    INT9 / 6 / 5's exact budgets, its ranking ablations, and water-filled INT-K widths at every uniform INT-K
    budget (K = 10, 9, 8, 6, 5, 4) and at 9.9, with their weighting ablations."""
    b = {k: matched_budget(k, d_v) for k in (4, 5, 6, 8, 9, 10)}
    return (["damp:9.9", f"damp:{b[9]}", f"damp:{b[6]}", f"damp:{b[5]}",
             "damp:9.9,rank=energy", "damp:9.9,rank=persistence", "damp:9.9,rank=random",
             f"damp:{b[6]},rank=random"]
            + [f"damp:{b[k]},alloc=water" for k in (10, 9, 8, 6, 5, 4)] + ["damp:9.9,alloc=water"]
            + [f"damp:{b[9]},alloc=water,rank=both", f"damp:{b[9]},alloc=water,rank=energy",
               f"damp:{b[6]},alloc=water,rank=both", f"damp:{b[6]},alloc=water,rank=random"])


def matched_pairs(d_v: int) -> list[tuple[str, str]]:
    """DAMP against the uniform arm at the same bits per value (and 9.9 against its two uniform neighbours)."""
    b = {k: matched_budget(k, d_v) for k in (4, 5, 6, 8, 9, 10)}
    uniform = {10: "int:10", 9: "int:9", 8: "int8", 6: "int:6", 5: "int:5", 4: "int4"}
    water = [(f"damp:{b[k]},alloc=water", uniform[k]) for k in (10, 9, 8, 6, 5, 4)]
    return water + [
        ("damp:9.9,alloc=water", "int:9"), ("damp:9.9,alloc=water", "int:10"),
        ("damp:9.9,alloc=water", "damp:9.9")] + [
        (f"damp:{b[k]},alloc=water", f"damp:{b[k]}") for k in (9, 6, 5)] + [
        (f"damp:{b[9]},alloc=water,rank=both", "int:9"), (f"damp:{b[9]},alloc=water,rank=energy", "int:9"),
        (f"damp:{b[6]},alloc=water,rank=both", "int:6"), (f"damp:{b[6]},alloc=water,rank=random", "int:6"),
        (f"damp:{b[9]}", "int:9"), (f"damp:{b[6]}", "int:6"), (f"damp:{b[5]}", "int:5"), ("damp:9.9", "int:9"),
        ("damp:9.9", "int:10"), ("damp:9.9", "damp:9.9,rank=random"), (f"damp:{b[6]}", f"damp:{b[6]},rank=random")]


QUICK_UNIFORM = ["fp32", "bf16", "int8", "fp8", "int4"]
QUICK_DAMP = ["damp:9.9", "damp:9.0", "damp:6.5"]


def load_or_collect(model, windows, directory: Path | None, name: str) -> dict:
    """collect_state_stats, or its arrays from `directory` (written there by an earlier run with these windows)."""
    path = None if directory is None else directory / f"{name}-{len(windows)}x{windows.shape[1]}.npz"
    if path is not None and path.exists():
        with np.load(path) as z:
            stats = {k: z[k] for k in z.files if k != "_meta"}
            meta = json.loads(str(z["_meta"]))
        stats.update(meta, shape=state_shape(model.config))
        return stats
    stats = collect_state_stats(model, windows)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays = {k: v for k, v in stats.items() if isinstance(v, np.ndarray)}
        meta = {k: v for k, v in stats.items() if isinstance(v, int)}
        np.savez(path, _meta=json.dumps(meta), **arrays)
    return stats


def stored_map(spec: str, loaded, stats, seed: int):
    method, arg = parse_spec("state", spec)
    if method.name == "damp":
        return damp_map(stats, stats["shape"], parse_damp_arg(arg), seed)
    return method.from_eval_spec(arg, loaded.config)


class _LogProbs:
    """Calls the model and keeps each step's next-token log-probabilities [batch, vocab] (decode_nll sees the model
    unchanged); given the reference arm's steps, it keeps only each step's KL from them instead ([batch])."""

    def __init__(self, model, ref_steps: list | None = None):
        self.model, self.ref_steps, self.steps = model, ref_steps, []

    def __call__(self, **kwargs):
        out = self.model(**kwargs)
        logp = torch.log_softmax(out.logits[:, -1].double(), dim=-1)
        if self.ref_steps is None:
            self.steps.append(logp)
        else:
            ref = self.ref_steps[len(self.steps)]
            self.steps.append((ref.exp() * (ref - logp)).sum(dim=-1))
        return out


def mean_kl(kl_steps: list, windows: int, seq_len: int) -> np.ndarray:
    """Per window, the mean over its tokens of KL(fp32 arm || this arm) of the next-token distributions.

    `kl_steps` holds one [batch] tensor per decode step, the steps of each batch of windows in turn."""
    per_step = seq_len - 1
    out = [torch.stack(kl_steps[i:i + per_step]).mean(dim=0) for i in range(0, len(kl_steps), per_step)]
    result = torch.cat(out).numpy()
    assert result.size == windows
    return result


def run_fixture(name: str, args) -> dict:
    torch.manual_seed(0)
    loaded = load_causal_lm(name)
    calib_windows = pick_windows(loaded.tokenizer, train_text(),
                                 CalibSettings(samples=args.calib_samples, seq_len=args.seq_len, seed=0))
    started = time.perf_counter()
    stats = load_or_collect(loaded.model, calib_windows, args.stats, name)
    with tempfile.TemporaryDirectory() as tmp:
        calib_report = write_state_stats(Path(tmp), stats)
    calib_seconds = time.perf_counter() - started
    text = heldout_text() if args.text == "heldout" else docstring_text()
    windows = token_windows(loaded.tokenizer, text, args.seq_len, args.skip_windows + args.windows)
    windows = windows[args.skip_windows:]
    if len(windows) < args.windows:
        raise SystemExit(f"error: the {args.text} text has {args.skip_windows + len(windows)} windows of "
                         f"{args.seq_len} tokens, fewer than --skip-windows {args.skip_windows} + --windows "
                         f"{args.windows}")
    d_v = stats["shape"].d_v
    arms = (QUICK_UNIFORM + QUICK_DAMP) if args.quick else (UNIFORM + damp_arms(d_v))
    if args.arms:
        arms = ["fp32"] + [a.strip() for a in args.arms.split(";") if a.strip() and a.strip() != "fp32"]
    rows, ref, ref_steps, per_window = [], None, None, {}
    for spec in arms:
        stored = stored_map(spec, loaded, stats, seed=0)
        method, _ = parse_spec("state", spec)
        method.check(stored, loaded.config)
        runtime = method.runtime(stored, loaded.model)
        capture = _LogProbs(loaded.model, ref_steps)
        t = time.perf_counter()
        arm = decode_nll(capture, windows, runtime.make_cache, batch=args.batch)
        seconds = time.perf_counter() - t
        rep = runtime.report()
        if ref is None:
            ref, ref_steps = arm, capture.steps
            kl = np.zeros(len(windows))
        else:
            kl = mean_kl(capture.steps, len(windows), args.seq_len)
        per_window[spec] = (arm.nll, kl)
        delta = paired_bootstrap(arm.nll, ref.nll, seed=0)
        kl_ci = paired_bootstrap(kl, np.zeros_like(kl), seed=0)
        row = {"arm": spec, "bits_per_value": rep["state_bits_per_value"], "state_bytes": rep["state_bytes"],
               "nll": arm.mean, "ppl": arm.ppl, "delta_nll": delta.mean, "ci": [delta.low, delta.high],
               "no_detectable_loss": bool(-MARGIN <= delta.low and delta.high <= MARGIN),
               "detectable": bool(delta.low > 0 or delta.high < 0), "kl": kl_ci.mean,
               "kl_ci": [kl_ci.low, kl_ci.high], "seconds": seconds}
        if method.name == "damp" and stored.params.get("alloc") == "water":
            row["widths"] = stored.params["widths"]
            ks = [int(k[3:]) for k in stored.params["widths"]]
            row["formats"] = f"int{min(ks)}..int{max(ks)}"
        elif method.name == "damp":
            row["high_channels"] = stored.params["high_channels"]
            row["formats"] = f"{stored.params['high']}/{stored.params['low']}"
        rows.append(row)
        if not args.json:
            print(f"{name:9s} {spec:28s} {row['bits_per_value']:6.3f} bits {row['state_bytes']:8.0f} B  "
                  f"ppl {arm.ppl:.4f}  ΔNLL {delta.mean:+.5f} [{delta.low:+.5f}, {delta.high:+.5f}]  "
                  f"KL {kl_ci.mean:.2e} ({seconds:.0f} s)", file=sys.stderr, flush=True)
    matched = []
    for a, b in matched_pairs(d_v):
        if a in per_window and b in per_window:
            dn = paired_bootstrap(per_window[a][0], per_window[b][0], seed=0)
            dk = paired_bootstrap(per_window[a][1], per_window[b][1], seed=0)
            matched.append({"damp": a, "versus": b, "nll_diff": dn.mean, "nll_diff_ci": [dn.low, dn.high],
                            "kl_diff": dk.mean, "kl_diff_ci": [dk.low, dk.high],
                            "kl_ratio": float(per_window[a][1].mean() / per_window[b][1].mean())})
    return {"fixture": name, "arch": stats["shape"].arch, "shape": stats["shape"].to_json(),
            "windows": len(windows), "skip_windows": args.skip_windows, "seq_len": args.seq_len, "text": args.text,
            "batch": args.batch,
            "calib_windows": len(calib_windows), "calib_seconds": calib_seconds,
            "calibration": {k: v for k, v in calib_report.items() if k not in ("plots",)}, "arms": rows,
            "matched": matched}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer windows and arms")
    parser.add_argument("--fixtures", default="tiny-gdn,tiny-kda")
    parser.add_argument("--windows", type=positive, default=None, help="held-out windows (default 16; quick 4)")
    parser.add_argument("--text", choices=("heldout", "docstrings"), default="heldout",
                        help="evaluation text: the held-out pydoc paragraphs (about 57 windows of 512) or the "
                             "standard library's docstrings (about 3,300 windows), both never trained on")
    parser.add_argument("--skip-windows", type=non_negative, default=0,
                        help="start after this many windows of the text (a run on windows an earlier run did not use)")
    parser.add_argument("--batch", type=positive, default=32,
                        help="windows decoded side by side (each through its own state; default 32)")
    parser.add_argument("--seq-len", type=positive, default=None, help="tokens per window (default 512; quick 128)")
    parser.add_argument("--calib-samples", type=positive, default=None,
                        help="calibration windows (default 64; quick 8)")
    parser.add_argument("--json", action="store_true", help="accepted: the last line is always the JSON object")
    parser.add_argument("--arms", default=None,
                        help="only these arms, separated by ';' (fp32, the reference, always runs first)")
    parser.add_argument("--stats", default=None, type=Path,
                        help="a directory to keep each fixture's calibration statistics in and reuse them from")
    args = parser.parse_args()
    args.windows = args.windows or (4 if args.quick else 16)
    args.seq_len = args.seq_len or (128 if args.quick else 512)
    args.calib_samples = args.calib_samples or (8 if args.quick else 64)
    torch.set_num_threads(1)
    results = [run_fixture(name.strip(), args) for name in args.fixtures.split(",") if name.strip()]
    print(markdown(results))
    print(json.dumps({"bench": "damp", "margin": MARGIN, "quick": args.quick, "fixtures": results}))


def markdown(results: list[dict]) -> str:
    """The tables of docs/benchmarks.md."""
    out = []
    for res in results:
        cal = res["calibration"]
        out += [(f"### {res['fixture']} ({res['arch']}, {len(res['shape']['layers'])} layers x "
                f"{res['shape']['heads']} heads x {res['shape']['d_k']}x{res['shape']['d_v']})"), "",
                (f"{res['windows']} windows of {res['seq_len']} tokens of held-out text ({res['text']}, decoded "
                 f"{res['batch']} at a time); calibration {res['calib_windows']} "
                f"training windows ({res['calib_seconds']:.0f} s). Top-10% channels hold "
                f"{cal['top10_energy_share']:.1%} of the INT8 error energy ({cal['top10_score_share']:.1%} of "
                f"energy x persistence). Split-half rank correlation: energy {cal['energy_rank_corr']:.3f}, "
                f"persistence {cal['persistence_rank_corr']:.3f}, product {cal['score_rank_corr']:.3f}; top-20% "
                f"overlap {cal['score_top20_overlap']:.2f}."
                + (f" Gradient sensitivity: top-10% channels hold {cal['top10_sensitivity_share']:.1%} of energy x "
                   f"sensitivity; split-half rank correlation {cal['sensitivity_rank_corr']:.3f} (sensitivity), "
                   f"{cal['sensitivity_score_rank_corr']:.3f} (energy x sensitivity)."
                   if "sensitivity_rank_corr" in cal else "")), "",
                ("| arm | formats | bits/value | state bytes | ppl | ΔNLL | 95% CI | detectable | within ±margin "
                 "| KL to fp32 | 95% CI |"),
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        for row in res["arms"]:
            out.append(f"| {row['arm']} | {row.get('formats', '')} | {row['bits_per_value']:.3f} | "
                       f"{row['state_bytes']:.0f} | {row['ppl']:.4f} | {row['delta_nll']:+.5f} | "
                       f"[{row['ci'][0]:+.5f}, {row['ci'][1]:+.5f}] | {'yes' if row['detectable'] else 'no'} | "
                       f"{'yes' if row['no_detectable_loss'] else 'no'} | {row['kl']:.2e} | "
                       f"[{row['kl_ci'][0]:.2e}, {row['kl_ci'][1]:.2e}] |")
        out += ["", "| DAMP arm | against | NLL difference | 95% CI | KL difference | 95% CI | KL ratio |",
                "|---|---|---|---|---|---|---|"]
        for m in res["matched"]:
            out.append(f"| {m['damp']} | {m['versus']} | {m['nll_diff']:+.5f} | [{m['nll_diff_ci'][0]:+.5f}, "
                       f"{m['nll_diff_ci'][1]:+.5f}] | {m['kl_diff']:+.2e} | [{m['kl_diff_ci'][0]:+.2e}, "
                       f"{m['kl_diff_ci'][1]:+.2e}] | {m['kl_ratio']:.3f} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(run_main(main))
