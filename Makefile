# Quick start: `make demo` (train the embedded CPU demo) and `make test`. Both install first.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
NPROC   ?= 2
PYTEST  := $(BIN)/python -m pytest

.PHONY: install test test-slow test-gpu test-slurm lint format demo clean

install: $(STAMP)

# The versions the CPU test suite runs against (setup.py leaves torch and transformers open, so that
# a cluster keeps its own builds). torch==2.13.0 resolves to the CPU wheel on machines that carry it
# locally; a GPU machine brings its own CUDA build of torch and installs the rest beside it (docs/gpu.md).
CPU_PINS ?= torch==2.13.0 transformers==5.12.1
$(STAMP): setup.py pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[dev]' $(CPU_PINS)
	touch $(STAMP)

# One line per test module (its name as it starts, a mark per test, the share of the run done), then
# --durations: the slowest tests, so that the run's length stays visible in every log.
test: install
	$(PYTEST) -m "not slow and not gpu" --durations=10 tests

# Exit status 5 is pytest's "no test selected": not a failure for an optional group.
test-slow: install
	$(PYTEST) -q -m "slow" tests || [ $$? -eq 5 ]

# On a GPU machine with the wheel kit (docs/gpu.md) this runs the system python; elsewhere the
# virtualenv's, where every GPU test is skipped with its reason.
GPU_PY ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
test-gpu:
	$(GPU_PY) -m pytest -q -m gpu tests

# A one-machine Slurm cluster on loopback (Debian's slurmctld/slurmd/munge) running launch/slurm.sbatch.
test-slurm: install
	bash launch/test_slurm.sh

# ruff everywhere; mypy on the typed core ([tool.mypy] files in pyproject.toml), and on the whole
# package against a baseline that may only shrink (tests/mypy_baseline.py).
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python tests/mypy_baseline.py

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

demo: install
	$(BIN)/python -m megatron_rl.demo --out .demo
	$(BIN)/torchrun --nproc_per_node=$(NPROC) -m megatron_rl.train --config yaml/cpu_demo.yaml

clean:
	rm -rf .demo outputs checkpoints .pytest_cache
