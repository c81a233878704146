#!/usr/bin/env bash
# The prepared run for a session lent a GPU: one call of the device tool, from the repository root:
#
#     bash scripts/gpu_session.sh            (timeout_s 600; OUT is the tool's output folder)
#
# It needs nothing but the device image's own python3 (PyTorch, Triton, numpy, safetensors, transformers; gcc for
# the CPU kernels that make the test weights): no virtual environment travels. In order, each under its own time
# limit so that a hang in one still leaves the others' files in $OUT:
#   1. versions.txt: the GPU, the driver, python3's torch / triton / numpy;
#   2. gpu.json + gpu.log: bench/gpu.py (both GPU goals: issue #4's Leech matvec against FP16, issue #6's Triton
#      state update; its own float64 checks), JSON on the last line of gpu.json, the table in gpu.log;
#   3. tests.log: the Triton tests of tests/test_kernels_triton.py and tests/test_state_update.py on the GPU (the
#      same tests `make test` runs under Triton's interpreter), each kernel against the float64 reference.
# BENCH_ARGS adds options to bench/gpu.py (such as `--shapes 4096x4096`); BENCH_S and TESTS_S are the limits.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-build/gpu-session}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 ACCEL_KERNEL_CACHE=${ACCEL_KERNEL_CACHE:-build/kernel-cache}
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1
    $PY - <<'PYEOF' 2>&1
import sys
print("python", sys.version.split()[0])
for name in ("torch", "triton", "numpy", "transformers"):
    try:
        module = __import__(name)
        print(name, module.__version__)
    except Exception as e:  # a missing package is what this file is for
        print(name, "missing:", e)
import torch
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
PYEOF
} | tee "$OUT/versions.txt"
start=$SECONDS
# shellcheck disable=SC2086
timeout "${BENCH_S:-330}" $PY bench/gpu.py ${BENCH_ARGS:-} >"$OUT/gpu.json" 2>"$OUT/gpu.log"
echo "bench/gpu.py: exit $? after $((SECONDS - start)) s" | tee -a "$OUT/versions.txt"
tail -n 60 "$OUT/gpu.log"
start=$SECONDS
timeout "${TESTS_S:-200}" $PY -m pytest -q -p no:cacheprovider tests/test_kernels_triton.py tests/test_state_update.py \
    -k triton >"$OUT/tests.log" 2>&1
echo "triton tests: exit $? after $((SECONDS - start)) s" | tee -a "$OUT/versions.txt"
tail -n 15 "$OUT/tests.log"
