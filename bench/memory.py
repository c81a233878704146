"""Peak memory of conversion against model depth: design.md §8 asks that it be bounded by the largest layer.

Two random Llama models that differ only in their number of decoder layers (bf16 safetensors directories, the
tiny-gdn fixture's byte-level tokenizer) go through `accel calibrate --for weights`, `accel quantize --weights
rtn3` (in-process) and `accel quantize --weights gptq3 --calib` (the worker pool), each command a process of its
own, one at a time; the figure is its peak resident memory (itself or a worker) as wait4 gives it. What one
more layer costs is (peak at the deeper model − peak at the shallower) / (layers between them), read against one
layer's weights in float32 and its Hessians in float64: a run whose memory grows with the model shows a multiple
of them, a streamed one zero.

With --rev REV the same commands also run on the accel package of a git revision (its `accel/` extracted to the
work directory), in the same run, alternating with this checkout's.
Usage: python bench/memory.py [--quick] [--hidden 1024] [--layers 2,12] [--rev REV] [--work DIR] [--json]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.benchargs import positive, run_main

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "accel" / "fixtures" / "tiny-gdn"
SAMPLES, SEQ_LEN = 16, 256


def make_model(out: Path | str, hidden: int, layers: int) -> Path:
    """A random Llama (seeded) of `layers` decoder layers, stored in bf16, with a byte-level tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    out = Path(out)
    if (out / "config.json").is_file():
        return out
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=257, hidden_size=hidden, intermediate_size=hidden * 11 // 4 // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64,
                         num_key_value_heads=max(1, hidden // 256), max_position_embeddings=SEQ_LEN,
                         tie_word_embeddings=False)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, tmp / name)
    tmp.rename(out)
    return out


def make_model_apart(out: Path, hidden: int, layers: int) -> Path:
    """make_model in a process of its own: this one stays small (no PyTorch), since a child's peak as getrusage
    gives it (what an older accel reports) starts at its parent's size."""
    code = f"from bench.memory import make_model; make_model({str(out)!r}, {hidden}, {layers})"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
    return out


def layer_megabytes(model: Path) -> tuple[float, float]:
    """(one decoder layer's weights in float32, its distinct-input Hessians in float64), in MiB."""
    config = json.loads((model / "config.json").read_text())
    h, i = config["hidden_size"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * (h // config["num_attention_heads"])
    weights = h * h * 2 + h * kv * 2 + 3 * h * i
    hessians = 3 * h * h + i * i  # q/k/v share one input, gate/up one; o and down their own
    return weights * 4 / 2**20, hessians * 8 / 2**20


def extract_revision(rev: str, work: Path) -> Path:
    """`accel/` of a git revision, extracted under work/rev-<commit>; returns the directory to put on PYTHONPATH."""
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{rev}^{{commit}}"],
                            capture_output=True, text=True, check=False)
    if commit.returncode:
        raise OSError(f"--rev {rev}: not a revision of this repository")
    target = work / f"rev-{commit.stdout.strip()[:12]}"
    if not (target / "accel").is_dir():
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit.stdout.strip(), "accel"],
                                 capture_output=True, check=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(target, filter="data")
    return target


def run_command(package: Path, args: list[str]) -> float:
    """One accel command in its own process on `package` (a directory holding accel/); its peak resident memory in
    MiB, itself or a worker, as the kernel accounts it at exit (wait4; an older accel's report has no figure). This
    process stays small (no PyTorch), so the child's high-water mark does not start at its parent's size."""
    env = {**os.environ, "PYTHONPATH": str(package)}
    code = "import sys; from accel.cli.main import run; sys.argv[0] = 'accel'; run()"
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([sys.executable, "-c", code, *args, "--force"], stdout=subprocess.DEVNULL,
                                stderr=err, env=env, cwd=package)  # `python -c` puts its directory before PYTHONPATH
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode:
            err.seek(0)
            lines = err.read().decode(errors="replace").strip().splitlines() or ["?"]
            raise OSError(f"accel {' '.join(args)} failed (exit {proc.returncode}): {lines[-1]}")
    return usage.ru_maxrss / 1024.0


def commands(model: Path, text: Path, out: Path) -> dict[str, list[str]]:
    calib = out / "calib"
    return {
        "calibrate --for weights": ["calibrate", str(model), "--for", "weights", "--data", str(text), "--out",
                                    str(calib), "--samples", str(SAMPLES), "--seq-len", str(SEQ_LEN)],
        "quantize rtn3": ["quantize", str(model), "--weights", "rtn3", "--out", str(out / "rtn3")],
        "quantize gptq3 --calib": ["quantize", str(model), "--weights", "gptq3", "--calib", str(calib), "--out",
                                   str(out / "gptq3")],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="hidden 512, layers 2 and 6")
    parser.add_argument("--hidden", type=positive, default=None, help="hidden size (a multiple of 256)")
    parser.add_argument("--layers", default=None, help="two layer counts, as 2,12")
    parser.add_argument("--rev", default=None, help="also run a git revision's accel package")
    parser.add_argument("--work", type=Path, default=None, help="where models and outputs go (default: a temp dir)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    hidden = args.hidden or (512 if args.quick else 1024)
    if hidden % 256:
        raise OSError(f"--hidden must be a multiple of 256, got {hidden}")
    try:
        depths = sorted({int(v) for v in (args.layers or ("2,6" if args.quick else "2,12")).split(",")})
    except ValueError:
        depths = []
    if len(depths) != 2 or depths[0] < 1:
        raise OSError(f"--layers takes two different positive layer counts, as 2,12; got {args.layers!r}")
    work = (args.work or Path(tempfile.mkdtemp(prefix="accel-memory-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    from accel.eval.data import pydoc_text

    text = work / "text.txt"
    text.write_text(pydoc_text()[:300_000], encoding="utf-8")
    models = {n: make_model_apart(work / f"llama-{hidden}-{n}", hidden, n) for n in depths}
    arms = {"this checkout": ROOT}
    if args.rev:
        arms[f"rev {args.rev}"] = extract_revision(args.rev, work)
    peaks: dict[tuple[str, str, int], float] = {}
    for n, model in models.items():
        for arm, package in arms.items():
            out = work / f"out-{n}-{package.name}"
            out.mkdir(exist_ok=True)
            for command, argv in commands(model, text, out).items():
                peaks[command, arm, n] = run_command(package, argv)
                print(f"  {arm}, {n} layers, {command}: peak {peaks[command, arm, n]:.0f} MiB", file=sys.stderr)
    weights_mb, hessians_mb = layer_megabytes(models[depths[0]])
    rows = []
    for (command, arm, n), peak in peaks.items():
        if n != depths[0]:
            continue
        deeper = peaks[command, arm, depths[1]]
        per_layer = (deeper - peak) / (depths[1] - depths[0])
        rows.append({"command": command, "arm": arm, "peak_mb": {str(depths[0]): round(peak, 1),
                                                                 str(depths[1]): round(deeper, 1)},
                     "mb_per_layer": round(per_layer, 1), "per_layer_vs_weights_fp32": round(per_layer / weights_mb, 2),
                     "per_layer_vs_hessians_fp64": round(per_layer / hessians_mb, 2)})
    print(f"random Llama, hidden {hidden}: one layer is {weights_mb:.1f} MiB of float32 weights and "
          f"{hessians_mb:.1f} MiB of float64 Hessians; calibration {SAMPLES} windows of {SEQ_LEN} tokens")
    print(f"| command | arm | peak MiB, {depths[0]} layers | peak MiB, {depths[1]} layers | MiB per added layer "
          f"| ÷ layer weights (fp32) | ÷ layer Hessians (fp64) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['command']} | {r['arm']} | {r['peak_mb'][str(depths[0])]:.0f} | "
              f"{r['peak_mb'][str(depths[1])]:.0f} | {r['mb_per_layer']:.1f} | {r['per_layer_vs_weights_fp32']:.2f} | "
              f"{r['per_layer_vs_hessians_fp64']:.2f} |")
    print(json.dumps({"hidden": hidden, "layers": depths, "layer_weights_fp32_mb": round(weights_mb, 2),
                      "layer_hessians_fp64_mb": round(hessians_mb, 2), "rows": rows}))
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
