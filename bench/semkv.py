"""SemKV on SmolLM2-135M: measured KV bytes per token and ΔNLL of every arm, against fp16 and the baselines.

Protocol (fixed before the run):
- Text: the pydoc corpus (`accel.eval.data.pydoc_text`), split in two halves by characters. `accel calibrate
  --for kv` runs on the first half; every arm is evaluated on windows of the second half.
- Quality: per-window NLL of each arm paired with the full-precision model on the same windows, paired bootstrap
  95% CI of the mean ΔNLL. No detectable loss = the CI inside ±0.01 nats/token (the calibration's MARGIN).
- Bytes: what the cache really holds after the last token of a window (seq_len - 1 tokens), every stored array
  included (codes, ranges, norms, level flags, the fp16 open key block / window / residual), averaged over
  windows. Reduction = fp16 bytes (2 bytes a value) / measured bytes.
- Arms: SemKV maps (the calibration's pick for each base, built exactly as `accel quantize --kv semkv:BASE`
  builds them); uniform affine and TurboQuant at each base's cliff, with the calibration's options (sink token,
  pre-RoPE keys; TurboQuant centered and smoothed with the calibrated means and scales); the same uniform
  levels without those options (the ablation); fp16 KV; KIVI-style 2-bit with a 32-token fp16 window;
  transformers QuantizedCache with quanto and HQQ at 4 and 2 bits.
- Paths: our caches' NLL comes from `accel.runtime.kv_cache.simulate`, the parallel equivalent of the packed
  cache (equal to token-by-token decoding up to float rounding, tests/test_kv_cache.py); their bytes from
  filling real PackedKVCaches with each arm's own keys and values. The SemKV arms are also decoded token by
  token through `accel eval`'s path on the first --decode-windows windows as a cross-check. The transformers
  caches have no parallel equivalent, so they are decoded token by token on all windows.

Usage: python bench/semkv.py [--quick] [--json] [--windows N] [--seq-len T] [--calib-samples N]
                            [--no-decoded-baselines] [--workdir DIR]
Writes the text halves and the calibration under --workdir (default build/bench/semkv; --quick: its quick/) and
reuses a calibration there recorded with the same settings on the same text.
The last line printed is one JSON object with the table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from bench.benchargs import calibration_matches, non_negative, positive, run_main

MODEL = "smollm2-135m"
OUT = Path(__file__).resolve().parents[1] / "build" / "bench" / "semkv"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def write_halves(out: Path) -> tuple[Path, Path]:
    from accel.eval.data import pydoc_text

    text = pydoc_text()
    half = len(text) // 2
    out.mkdir(parents=True, exist_ok=True)
    paths = (out / "calib.txt", out / "eval.txt")
    for path, part in zip(paths, (text[:half], text[half:]), strict=True):
        if not path.is_file() or path.read_text(encoding="utf-8") != part:
            path.write_text(part, encoding="utf-8")
    return paths


def ensure_calibration(calib_text: Path, out: Path, samples: int, seq_len: int) -> tuple[Path, float | None]:
    """Run `accel calibrate --for kv` unless `out` already holds one with these settings on this text; returns
    the directory and the seconds it took (None when reused)."""
    from accel.calibrate.kv import BASE_OPTIONS
    from accel.calibrate.run import CalibSettings, calibrate
    from accel.quantize.semkv import OPTION_KEYS

    options = {b: {k: int(o[k]) for k in OPTION_KEYS} for b, o in BASE_OPTIONS.items()}
    report = out / "kv" / "report.json"
    same_options = report.is_file() and json.loads(report.read_text()).get("options") == options
    if same_options and calibration_matches(out, calib_text, "kv", samples, seq_len):
        log(f"reusing the calibration in {out}")
        return out, None  # its time is not recorded: calibrations write no timings
    log(f"calibrating ({samples} windows x {seq_len} tokens; this is the long part)")
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    calibrate(MODEL, calib_text, out, ["kv"], CalibSettings(samples=samples, seq_len=seq_len, seed=0), force=True)
    return out, time.perf_counter() - started


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    from accel.calibrate.kv import MARGIN, KVRecorder, measure_bytes
    from accel.eval.data import token_windows
    from accel.eval.load import load_causal_lm
    from accel.eval.perplexity import decode_nll, window_nll
    from accel.eval.stats import paired_bootstrap
    from accel.quantize.maps import BuildContext, StoredMap, get_method, parse_spec
    from accel.quantize.semkv import load_kv_calibration, make_arrays, make_params, scheme_of
    from accel.runtime.kv_cache import fp16_bytes_per_token, simulate

    out = args.workdir / "quick" if args.quick else args.workdir
    calib_text, eval_text = write_halves(args.workdir)
    calib_dir, calib_seconds = ensure_calibration(calib_text, out / "calib", args.calib_samples, args.seq_len)

    loaded = load_causal_lm(MODEL)
    model, config = loaded.model, dict(loaded.config)
    layers = int(model.config.num_hidden_layers)
    fp16_bytes = fp16_bytes_per_token(config)
    windows = token_windows(loaded.tokenizer, eval_text.read_text(encoding="utf-8"), args.seq_len, args.windows)
    log(f"eval: {len(windows)} windows x {args.seq_len} tokens of the second half")
    ref = window_nll(model, windows).nll
    calib = load_kv_calibration(calib_dir, config)
    report = calib.report

    arms: list[tuple[str, str, object]] = []  # (name, kind, spec or StoredMap)
    grid = sorted({r["levels"][0] for r in report["sweep"]})
    for base in ("affine", "turbo"):
        # the calibration's pick; without one (no level passed), the top two grid levels half and half
        spec = base if calib.recommendation(base) is not None else f"{base}:{grid[-2]}/{grid[-1]}@0.5"
        stored = get_method("kv", "semkv").build(spec, BuildContext(MODEL, config, calib_dir, seed=0))
        arms.append((f"semkv-{base}" + ("" if spec == base else " (no pick)"), "map", stored))

    def uniform(base: str, level: int, ablate: bool = False) -> StoredMap:
        """Every token at `level`, with the calibration's options, means and scales for `base`; ablate: without
        the sink, pre-RoPE keys and smoothing (TurboQuant keeps its centering, by the post-RoPE means)."""
        options = {} if ablate else calib.options(base)
        params = make_params(base, (level, level), 0.0, "key_norm", 0, config, **options)
        extra = calib.means(base)
        if ablate:
            extra = {"key_mean": calib.mean_arrays["key"], "value_mean": calib.mean_arrays["value"]} if extra else {}
        return StoredMap("kv", base, params, {**make_arrays(params, None), **extra})

    for base in ("affine", "turbo"):
        cliff = report["cliff"][base]
        level = cliff if cliff is not None else grid[-1]
        label = "cliff" if cliff is not None else "top of grid, no level passed"
        arms.append((f"{base}-{level} (uniform, {label})", "map", uniform(base, level)))
        arms.append((f"{base}-{level} (uniform, ablation: no sink/pre-RoPE/smoothing)", "map",
                     uniform(base, level, ablate=True)))
    arms += [("fp16", "spec", "fp16"), ("kivi-2bit", "spec", "kivi:2")]
    if not args.no_decoded_baselines:
        arms += [("quanto-4bit", "decode", "quanto:4"), ("quanto-2bit", "decode", "quanto:2"),
                 ("hqq-4bit", "decode", "hqq:4"), ("hqq-2bit", "decode", "hqq:2")]

    rows = []
    for name, kind, what in arms:
        started = time.perf_counter()
        if kind == "map":
            stored = what
            p = stored.params
            opts = ",".join(f"{k}={p[k]}" for k in ("sink", "pre_rope") if p.get(k)) + \
                (",smooth" if "key_scale" in stored.arrays else "") + (",centered" if "key_mean" in stored.arrays
                                                                        else "")
            spec = (f"semkv:{p['base']}:{p['levels'][0]}/{p['levels'][1]}@{p['frac']}" if stored.method == "semkv"
                    else f"{p['base']}:{p['levels'][0]}") + (f" [{opts.lstrip(',')}]" if opts else "")
        else:
            method, arg = parse_spec("kv", what)
            stored = method.from_eval_spec(arg, config)
            spec = what
        method = get_method("kv", stored.method)
        method.check(stored, config)
        row = {"arm": name, "spec": spec}
        if kind in ("map", "spec"):
            scheme = scheme_of(stored)
            kept = KVRecorder(layers, 1, indicators=False, keep=min(args.bytes_windows, len(windows)))
            with simulate(model, scheme, observer=kept):
                nll = window_nll(model, windows).nll
            size = measure_bytes(scheme, kept.kept, layers)
            row.update(path="simulate", bytes_per_token=size["bytes_per_token"],
                       high_fraction=size["high_fraction"])
            if kind == "map" and stored.method == "semkv" and args.decode_windows:
                runtime = method.runtime(stored, model)
                sub = windows[: args.decode_windows]
                decoded = decode_nll(model, sub, runtime.make_cache).nll
                rep = runtime.report()
                row["decode_check"] = {"windows": len(sub), "kv_bytes_per_token": rep["kv_bytes_per_token"],
                                       "delta_nll_decode": float((decoded - ref[: len(sub)]).mean()),
                                       "delta_nll_simulate": float((nll[: len(sub)] - ref[: len(sub)]).mean())}
        else:
            runtime = method.runtime(stored, model)
            nll = decode_nll(model, windows, runtime.make_cache).nll
            row.update(path="decode", bytes_per_token=runtime.report()["kv_bytes_per_token"])
        delta = paired_bootstrap(nll, ref, seed=0)
        row.update(bits_per_value=8 * row["bytes_per_token"] / (fp16_bytes / 2),
                   reduction=fp16_bytes / row["bytes_per_token"], delta_nll=delta.mean, ci=[delta.low, delta.high],
                   no_detectable_loss=bool(-MARGIN <= delta.low and delta.high <= MARGIN),
                   seconds=time.perf_counter() - started)
        rows.append(row)
        log(f"{name:28s} {row['bytes_per_token']:9.1f} B/token {row['reduction']:5.2f}x  ΔNLL "
            f"{delta.mean:+.4f} [{delta.low:+.4f}, {delta.high:+.4f}]  {row['seconds']:.0f} s")

    def best(prefixes) -> float:
        ok = [r["reduction"] for r in rows if r["no_detectable_loss"] and r["arm"].startswith(prefixes)]
        return max(ok) if ok else 0.0

    ours = {"affine": best(("semkv-affine", "affine-")), "turbo": best(("semkv-turbo", "turbo-"))}
    baselines = best(("fp16", "kivi", "quanto", "hqq"))
    goals = {"affine_6x": {"target": 6.0, "best_reduction": ours["affine"], "met": ours["affine"] >= 6.0},
             "turbo_7.9x": {"target": 7.9, "best_reduction": ours["turbo"], "met": ours["turbo"] >= 7.9},
             "beats_every_baseline": {"best_ours": max(ours.values()), "best_baseline": baselines,
                                      "met": max(ours.values()) > baselines}}
    return {"model": MODEL, "margin": MARGIN, "seq_len": args.seq_len, "windows": len(windows),
            "calib_windows": report["windows"], "calib_seconds": calib_seconds, "fp16_bytes_per_token": fp16_bytes,
            "reference_nll": float(ref.mean()), "cliff": report["cliff"], "indicator": report["runtime_indicator"],
            "rows": rows, "goals": goals}


def markdown(result: dict) -> str:
    lines = [(f"| arm | spec | bytes/token | bits/value | reduction vs fp16 | ΔNLL (nats/token) | 95% CI | "
             f"no detectable loss (±{result['margin']}) |"), "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['arm']} | `{r['spec']}` | {r['bytes_per_token']:.1f} | {r['bits_per_value']:.3f} | "
                     f"{r['reduction']:.2f}x | {r['delta_nll']:+.4f} | [{r['ci'][0]:+.4f}, {r['ci'][1]:+.4f}] | "
                     f"{'yes' if r['no_detectable_loss'] else 'no'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run of a few minutes")
    parser.add_argument("--json", action="store_true", help="accepted: the last line is always the JSON object")
    parser.add_argument("--windows", type=positive, default=None, help="eval windows (default 16; quick 3)")
    parser.add_argument("--seq-len", type=positive, default=None, help="tokens per window (default 256; quick 64)")
    parser.add_argument("--calib-samples", type=positive, default=None,
                        help="calibration windows (default 20; quick 4)")
    parser.add_argument("--decode-windows", type=non_negative, default=None,
                        help="windows the SemKV arms are also decoded token by token (default 2; quick 1)")
    parser.add_argument("--bytes-windows", type=positive, default=4, help="windows that fill real caches for bytes")
    parser.add_argument("--workdir", type=Path, default=OUT,
                        help="the two text halves and the calibration (quick/calib for --quick), kept and reused "
                             "when their settings match (default: build/bench/semkv in the checkout)")
    parser.add_argument("--no-decoded-baselines", action="store_true",
                        help="skip the transformers caches (quanto, HQQ), which only decode token by token (slow)")
    args = parser.parse_args()
    defaults = {"windows": (16, 3), "seq_len": (256, 64), "calib_samples": (20, 4), "decode_windows": (2, 1)}
    for key, (full, quick) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    started = time.perf_counter()
    result = run(args)
    result["seconds"] = time.perf_counter() - started
    print(markdown(result))
    print(json.dumps(result["goals"], indent=1))
    print(json.dumps(result))  # the last line, --json or not


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    sys.exit(run_main(main))
