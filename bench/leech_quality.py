"""Quality of weight quantizers on SmolLM2-135M: ppl, paired ΔNLL (bootstrap 95% CI) and exact bits/weight per arm.

Calibration uses the second half of the pydoc corpus, evaluation the first half, so no window is seen twice.
With --tune-steps N the leech arms are quantized with `accel quantize --tune-steps N` (row scales refit by KL to
fp32 on the calibration windows; docs/leech.md).
Usage: python bench/leech_quality.py [--quick] [--json] [--arms a,b,...] [--windows N] [--seq-len L] [--tune-steps N]
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
from benchargs import non_negative, run_main
from weights_protocol import MODEL, add_arguments, ensure_calibration, prepare

ARMS = ["fp32", "rtn2", "rtn3", "hqq2", "hqq3", "gptq2", "gptq3", "leech2", "leech3", "leech4"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    add_arguments(ap)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--tune-steps", type=non_negative, default=0, help="leech arms: accel quantize --tune-steps N")
    args = ap.parse_args()
    # accel (and torch with it) imported here, not at the top: accel quantize's worker processes import this
    # script again (spawn), and would each load torch for nothing
    from accel.eval.data import token_windows
    from accel.eval.load import load_causal_lm
    from accel.eval.perplexity import window_nll
    from accel.eval.stats import paired_bootstrap
    from accel.quantize.methods import get_weight_method
    from accel.quantize.pipeline import QuantizeSettings, quantize_model

    arms = [a for a in args.arms.split(",") if a]
    for arm in arms:  # an unknown arm before any work
        if arm != "fp32":
            get_weight_method(arm)
    work, eval_text = prepare(args, "leech_quality.")
    calib = work / "calib"
    if any(a != "fp32" and get_weight_method(a).uses_calibration for a in arms):
        ensure_calibration(work, args)

    ref = load_causal_lm(MODEL)
    windows = token_windows(ref.tokenizer, eval_text, args.seq_len, args.windows)
    ref_nll = window_nll(ref.model, windows)
    del ref
    rows = []
    for arm in arms:
        if arm == "fp32":
            rows.append({"arm": "fp32", "bits_per_weight": 32.0, "ppl": ref_nll.ppl, "delta_nll": 0.0,
                         "delta_nll_ci": [0.0, 0.0], "quantize_s": 0.0})
            continue
        out = work / arm
        method = get_weight_method(arm)
        settings = QuantizeSettings(weights=arm, calib=str(calib) if method.uses_calibration else None,
                                    tune_steps=args.tune_steps if arm.startswith("leech") else 0)
        report = quantize_model(MODEL, out, settings, force=True, jobs=args.jobs)
        loaded = load_causal_lm(out)
        nll = window_nll(loaded.model, windows)
        del loaded
        delta = paired_bootstrap(nll.nll, ref_nll.nll)
        rows.append({"arm": arm, "bits_per_weight": report["bits_per_weight"], "ppl": nll.ppl,
                     "delta_nll": delta.mean, "delta_nll_ci": [delta.low, delta.high],
                     "quantize_s": report["seconds"]})
        print(f"{arm}: {report['bits_per_weight']:.4f} bits/w, ppl {nll.ppl:.3f} ({nll.ppl / ref_nll.ppl:.4f}x), "
              f"ΔNLL {delta.mean:+.4f} [{delta.low:+.4f}, {delta.high:+.4f}], {report['seconds']:.0f} s",
              file=sys.stderr, flush=True)

    print(f"SmolLM2-135M, pydoc first half, {len(windows)} windows x {args.seq_len} tokens; calibration on the "
          f"second half ({args.calib_samples} windows); leech --tune-steps {args.tune_steps}")
    print(f"{'arm':8} {'bits/w':>8} {'ppl':>10} {'ppl/fp32':>9} {'ΔNLL':>9} {'95% CI':>21} {'quant s':>8}")
    for r in rows:
        lo, hi = r["delta_nll_ci"]
        print(f"{r['arm']:8} {r['bits_per_weight']:8.4f} {r['ppl']:10.3f} {r['ppl'] / ref_nll.ppl:9.3f} "
              f"{r['delta_nll']:+9.4f} [{lo:+8.4f}, {hi:+8.4f}] {r['quantize_s']:8.1f}")
    if args.json:
        print(json.dumps({"benchmark": "leech_quality", "windows": len(windows), "seq_len": args.seq_len,
                          "tune_steps": args.tune_steps, "rows": rows}, default=float))
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(run_main(main))
