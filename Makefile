# One-command set-up on a fresh machine: a virtual environment with torch==2.13.0 installed first
# (pip then takes the local CPU wheel instead of downloading CUDA builds), then this package.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test bench setup clean

$(BIN)/torchplace: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev,examples,hf]"
	touch $@

setup: $(BIN)/torchplace

demo: setup
	HF_HUB_OFFLINE=1 $(BIN)/torchplace demo

test: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python benchmarks/dp_workloads.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
