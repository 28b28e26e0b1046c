# Two commands: `make demo` and `make test`. Each sets up what it needs on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU wheel; on a GPU node use e.g. `make demo TORCH=torch` to take your CUDA build.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: demo test check lint types unit bench bench-small gpu-check clean

$(STAMP): pyproject.toml client/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ./client -e '.[test]'
	touch $@

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/cached demo

lint: $(STAMP)
	$(VENV)/bin/ruff check cached client tests bench
	$(VENV)/bin/ruff format --check cached client tests bench

types: $(STAMP)
	$(VENV)/bin/mypy

unit: $(STAMP)
	$(PY) -m pytest -q

# `check` is what `test` runs: format, lint, types, the test suite, and the benchmark smoke runs.
check: lint types unit bench-small

test: check

bench: $(STAMP)
	$(PY) bench/serve.py
	$(PY) bench/transport.py
	$(PY) bench/epochs.py
	$(PY) bench/cache_sim.py
	$(PY) bench/malloc.py

bench-small: $(STAMP)
	$(PY) bench/serve.py --small
	$(PY) bench/transport.py --small
	$(PY) bench/epochs.py --small
	$(PY) bench/cache_sim.py --small
	$(PY) bench/malloc.py --small

# On a GPU node (with a CUDA build of torch): byte-exact batches on the GPU under a slow
# consumer, and host-to-device bandwidth; under 3 minutes. Without CUDA it runs the CPU parts,
# prints "no CUDA: GPU parts skipped" and exits 0 (a skip, not a pass).
gpu-check: $(STAMP)
	$(PY) bench/gpu_check.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .demo
