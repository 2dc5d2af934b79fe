# Entry points for people and CI. Python 3.11 and pip only (see pyproject.toml and
# /work/shared/reference/ENVIRONMENT.md): uv/poetry would bypass the machine's pip configuration.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LINT_PATHS := $(wildcard core reproductions data scripts tests)
OFFLINE_ENV := OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
	TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline

.PHONY: setup data lint test run

# The virtual environment is (re)installed only when pyproject.toml is newer than the stamp.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

# Installs the Debian data packages when missing and builds the data caches; cheap when done.
data: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m data.prepare

setup: $(STAMP) data

lint: $(STAMP)
	$(BIN)/ruff check $(LINT_PATHS)

test: setup lint
	$(OFFLINE_ENV) $(BIN)/python -m pytest -q

run: setup
	$(BIN)/python -m reproductions.demo
