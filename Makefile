# Quick start: `make demo` (train the embedded CPU demo) and `make test`. Both install first.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
NPROC   ?= 2
PYTEST  := $(BIN)/python -m pytest

.PHONY: install test test-slow test-gpu test-slurm lint format demo clean

install: $(STAMP)

# torch==2.13.0 resolves to the CPU wheel on machines that carry it locally; the GPU machine
# brings its own CUDA build of torch and installs the rest beside it (docs/gpu.md).
$(STAMP): setup.py pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

test: install
	$(PYTEST) -q -m "not slow and not gpu" tests

test-slow: install
	$(PYTEST) -q -m "slow" tests

test-gpu:
	python3 -m pytest -q -m gpu tests

# A one-machine Slurm cluster on loopback (Debian's slurmctld/slurmd/munge) running launch/slurm.sbatch.
test-slurm: install
	bash launch/test_slurm.sh

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

demo: install
	$(BIN)/python -m megatron_rl.demo --out .demo
	rm -rf outputs/demo  # a fresh run each time (metrics.jsonl appends)
	$(BIN)/torchrun --nproc_per_node=$(NPROC) -m megatron_rl.train --config yaml/cpu_demo.yaml

clean:
	rm -rf .demo outputs checkpoints .pytest_cache
