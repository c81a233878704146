"""Batch-1 generation speed: a model decoded to dense fp32 against an accel OUT_DIR served through QuantLinear.

Both arms load in this process and decode greedily with a KV cache: a fixed prompt is prefilled, then --tokens
tokens are generated one at a time; the figure is generated tokens per second of the decode phase (the prefill is
timed apart). Arms alternate over --rounds rounds and the median is reported, so a busy machine hurts both alike.
The OUT_DIR must come from the same source model (its tokenizer is used for both).

Usage: python bench/generate.py OUT_DIR [--reference smollm2-135m] [--tokens 64] [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.benchargs import positive, run_main

PROMPT = "The quick brown fox jumps over the lazy dog. In Python, a list comprehension"


def decode_speed(model, ids, tokens: int) -> tuple[float, float, list[int]]:
    """(prefill seconds, generated tokens per second, the generated ids) with greedy decoding."""
    import torch

    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True)
        prefill = time.perf_counter() - t0
        past, nxt = out.cache, out.logits[:, -1].argmax(-1, keepdim=True)
        generated = [int(nxt)]
        t0 = time.perf_counter()
        for _ in range(tokens - 1):
            out = model(input_ids=nxt, cache=past, use_cache=True)
            past, nxt = out.cache, out.logits[:, -1].argmax(-1, keepdim=True)
            generated.append(int(nxt))
        return prefill, (tokens - 1) / (time.perf_counter() - t0), generated


def time_breakdown(model, ids, tokens: int) -> dict[str, float]:
    """Milliseconds a generated token spends in the linear layers, in the LM head and elsewhere (attention, norms,
    Python): one more `decode_speed` run with forward hooks around every linear module, counting the one-token
    calls (the decode steps, and the prompt's LM head on its last position). The hooks themselves add a few microseconds a call, counted in the linear layers' share."""
    import torch

    spent = {"linear": 0.0, "lm_head": 0.0}
    started: dict[int, float] = {}

    def before(module, inputs):
        started[id(module)] = time.perf_counter()

    def after(module, inputs, output, key):
        if inputs[0].shape[-2] == 1:  # a decode step, not the prompt
            spent[key] += time.perf_counter() - started[id(module)]

    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) or type(module).__name__ == "QuantLinear":
            key = "lm_head" if name.endswith("lm_head") else "linear"
            hooks += [module.register_forward_pre_hook(before),
                      module.register_forward_hook(lambda m, i, o, key=key: after(m, i, o, key))]
    try:
        _, tokens_per_s, _ = decode_speed(model, ids, tokens)
    finally:
        for h in hooks:
            h.remove()
    token_ms = 1e3 / tokens_per_s
    per = {f"{k}_ms": v / (tokens - 1) * 1e3 for k, v in spent.items()}
    return {"token_ms": token_ms, **per, "other_ms": token_ms - sum(per.values())}


def _at_least_two(text: str) -> int:
    value = positive(text)
    if value < 2:
        raise argparse.ArgumentTypeError("must be at least 2 (the first token comes from the prefill)")
    return value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", help="accel OUT_DIR (served with QuantLinear kernels)")
    ap.add_argument("--reference", default="smollm2-135m", help="dense fp32 arm (source model)")
    ap.add_argument("--tokens", type=_at_least_two, default=64,
                    help="tokens generated per round (the rate is over all but the first, which the prefill makes)")
    ap.add_argument("--rounds", type=positive, default=3, help="rounds per arm (the median is reported)")
    ap.add_argument("--threads", type=positive, default=os.cpu_count() or 1, help="torch and kernel threads")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time where a generated token goes (linear layers, LM head, the rest), with hooks")
    args = ap.parse_args()

    import torch

    from accel.eval.load import load_causal_lm
    from accel.kernels import set_threads

    torch.set_num_threads(args.threads)
    set_threads(args.threads)
    t0 = time.perf_counter()
    quant = load_causal_lm(args.out_dir, kernels=True)
    load_quant = time.perf_counter() - t0
    t0 = time.perf_counter()
    dense = load_causal_lm(args.reference)
    load_dense = time.perf_counter() - t0
    ids = quant.tokenizer(PROMPT, return_tensors="pt").input_ids
    arms = {"dense-fp32": dense.model, "accel-kernels": quant.model}
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k in arms}
    texts = {}
    for _ in range(args.rounds):
        for name, model in arms.items():
            prefill, tps, generated = decode_speed(model, ids, args.tokens)
            runs[name].append((prefill, tps))
            texts[name] = quant.tokenizer.decode(generated)
    result = {"out_dir": args.out_dir, "reference": args.reference, "tokens": args.tokens, "rounds": args.rounds,
              "threads": args.threads, "prompt_tokens": int(ids.shape[1]),
              "load_seconds": {"accel-kernels": load_quant, "dense-fp32": load_dense},
              "load_average": os.getloadavg(), "arms": {}}
    for name, samples in runs.items():
        result["arms"][name] = {"tokens_per_s": statistics.median(s[1] for s in samples),
                                "prefill_s": statistics.median(s[0] for s in samples),
                                "text": texts[name]}
    result["speedup"] = result["arms"]["accel-kernels"]["tokens_per_s"] / result["arms"]["dense-fp32"]["tokens_per_s"]
    if args.breakdown:
        for name, model in arms.items():
            result["arms"][name]["breakdown"] = time_breakdown(model, ids, args.tokens)
    print(f"{'arm':<15} {'tokens/s':>9} {'prefill s':>10}")
    for name, arm in result["arms"].items():
        print(f"{name:<15} {arm['tokens_per_s']:>9.1f} {arm['prefill_s']:>10.3f}")
    for name, arm in result["arms"].items():
        if "breakdown" in arm:
            b = arm["breakdown"]
            print(f"{name}: {b['token_ms']:.2f} ms a token with hooks: linear layers {b['linear_ms']:.2f}, "
                  f"LM head {b['lm_head_ms']:.2f}, the rest {b['other_ms']:.2f}")
    print(f"speedup of accel-kernels over dense fp32: {result['speedup']:.2f}x")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(run_main(main))
