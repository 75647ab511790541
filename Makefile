# Set-up on a fresh machine is `make demo` or `make test`; nothing has to be installed by hand. The metrics extra
# (tensorboard, wandb, matplotlib) is installed so that the tests read back every metrics sink.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch 2.13 lies on this machine's disk; a bare `pip install torch` could pull a
# multi-GB CUDA build, so torch is installed pinned, and only when the venv lacks it.
TORCH_SPEC ?= torch==2.13.*
NPROC ?= 2

.PHONY: setup demo test lint bench clean

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[hf,dev,metrics]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) examples/train_gpt2.py

# Two pytest workers, a test file each at a time (--dist loadfile: a file's launches share their fixtures), the
# slowest files first (tests/conftest.py; xdist's own reorder would start the files with the most tests first).
# Quiet machine, 2026-11-28 (venv present), after the examples moved onto forked ranks and forked ranks froze their
# inherited objects: 8m49s, 8m34s and 8m53s (pytest 525 s, 508 s, 528 s; 97 % of both cores busy). The VM's speed
# drifts (a pure-Python probe took 277-540 ms over the day; before these changes 8m35s-11m16s); three workers took
# 12m07s: the suite keeps both cores busy, more workers only wait.
test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Full-mode benchmarks (tens of minutes; run on a quiet machine). Figures go in benchmarks/README.md.
bench: setup
	$(PY) -m pip install -q -e ".[bench]"
	OMP_NUM_THREADS=1 $(PY) benchmarks/throughput.py --compile on
	OMP_NUM_THREADS=1 $(PY) benchmarks/throughput.py --metrics
	OMP_NUM_THREADS=1 $(PY) benchmarks/memory.py --vocab 8192
	OMP_NUM_THREADS=1 $(PY) benchmarks/memory.py --gc --vocab 8192
	OMP_NUM_THREADS=1 $(PY) benchmarks/capacity.py
	OMP_NUM_THREADS=1 $(PY) benchmarks/setup_time.py
	$(PY) benchmarks/consolidate.py
	OMP_NUM_THREADS=1 $(PY) benchmarks/checkpoint.py

clean:
	rm -rf $(VENV) build *.egg-info
