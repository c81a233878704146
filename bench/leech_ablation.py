"""Where a Leech arm's perplexity gap sits on SmolLM2-135M: quantize once, then put groups of tensors back to fp32.

Same protocol as bench/leech_quality.py (calibrate on the second half of the pydoc corpus, evaluate on the first
half). Each row keeps one group of layers in source precision and reports ppl and the paired ΔNLL against fp32, so
the drop from the "all" row is that group's share of the gap.
Usage: python bench/leech_ablation.py [--arm leech4] [--quick] [--json] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable

from benchargs import run_main
from weights_protocol import MODEL, add_arguments, ensure_calibration, prepare


def _layer(name: str) -> int:
    found = re.search(r"layers\.(\d+)\.", name)
    return int(found.group(1)) if found else -1


def groups(layers: int) -> dict[str, Callable[[str], bool]]:
    """Row label -> which quantized tensors that row keeps in source precision."""
    return {
        "all quantized": lambda n: False,
        "keep q,k": lambda n: "q_proj" in n or "k_proj" in n,
        "keep v,o": lambda n: "v_proj" in n or "o_proj" in n,
        "keep gate,up": lambda n: "gate_proj" in n or "up_proj" in n,
        "keep down": lambda n: "down_proj" in n,
        "keep first 3 layers": lambda n: _layer(n) < 3,
        "keep last 3 layers": lambda n: _layer(n) >= layers - 3,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    add_arguments(ap)
    ap.add_argument("--arm", default="leech4")
    args = ap.parse_args()
    # accel (and torch with it) imported here, not at the top: accel quantize's worker processes import this
    # script again (spawn), and would each load torch for nothing
    from accel.converters import build_transformers_model, open_model
    from accel.eval.data import token_windows
    from accel.eval.load import load_decoded_tensors
    from accel.eval.perplexity import window_nll
    from accel.eval.stats import paired_bootstrap
    from accel.formats.artifact import Artifact
    from accel.quantize.methods import get_weight_method
    from accel.quantize.pipeline import QuantizeSettings, quantize_model

    get_weight_method(args.arm)  # an unknown arm before the calibration
    work, eval_text = prepare(args, "leech_ablation.")
    started = time.perf_counter()
    calib = ensure_calibration(work, args)
    out = work / args.arm
    quantize_model(MODEL, out, QuantizeSettings(weights=args.arm, calib=str(calib)), force=True, jobs=args.jobs)
    art = Artifact(out)
    decoded = load_decoded_tensors(art)
    quantized = {n for n in art.names if art.entry(n).role == "quantized"}
    with open_model(MODEL) as source:
        original = {n: source.load_tensor(n) for n in source.tensor_names()}
        config, tokenizer = dict(source.config), source.load_tokenizer()
    windows = token_windows(tokenizer, eval_text, args.seq_len, args.windows)
    ref = window_nll(build_transformers_model(config, original), windows)
    rows = []
    for label, keep in groups(int(config["num_hidden_layers"])).items():
        tensors = dict(original)
        tensors.update({n: decoded[n] for n in quantized if not keep(n)})
        arm = window_nll(build_transformers_model(config, tensors), windows)
        delta = paired_bootstrap(arm.nll, ref.nll, seed=0)
        kept = sum(original[n].size for n in quantized if keep(n)) / sum(original[n].size for n in quantized)
        rows.append({"row": label, "kept_fraction": kept, "ppl": arm.ppl, "ppl_ratio": arm.ppl / ref.ppl,
                     "delta_nll": delta.mean, "delta_nll_ci": [delta.low, delta.high]})
        print(f"{label:20s} kept {kept:6.1%}  ppl {arm.ppl:8.3f}  ×fp32 {arm.ppl / ref.ppl:.4f}  "
              f"ΔNLL {delta.mean:+.4f} [{delta.low:+.4f}, {delta.high:+.4f}]", file=sys.stderr, flush=True)
    print(f"| row | params kept in fp32 | ppl | × fp32 (ppl {ref.ppl:.3f}) | ΔNLL [95% CI] |")
    print("|---|---|---|---|---|")
    for r in rows:
        lo, hi = r["delta_nll_ci"]
        print(f"| {r['row']} | {r['kept_fraction']:.1%} | {r['ppl']:.3f} | {r['ppl_ratio']:.4f} | "
              f"{r['delta_nll']:+.4f} [{lo:+.4f}, {hi:+.4f}] |")
    print(f"total {time.perf_counter() - started:.0f} s", file=sys.stderr)
    if args.json:
        print(json.dumps({"arm": args.arm, "fp32_ppl": ref.ppl, "windows": len(windows), "seq_len": args.seq_len,
                          "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
