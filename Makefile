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

.PHONY: setup data lint test run docs serve-docs vendor-katex

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
	$(BIN)/mypy

test: setup lint
	$(OFFLINE_ENV) $(BIN)/python -m pytest -q

# The MKOR reproduction's built-in default: BERT pre-training with LAMB, K-FAC, MKOR, MKOR-H and
# Eva on the built-in English corpus, ending with the comparison table (17 min with one thread on
# a shared 2-core machine). Options go in ARGS, e.g. `make run ARGS="--threads 1"` on a busy one.
run: setup
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
		$(BIN)/python -m reproductions.mkor.bert $(ARGS)

# The results site: concept figures and reproduction pages are regenerated from the committed
# results files, then the site is built into site/ (offline, warnings are errors).
DOCS_ENV := NO_MKDOCS_2_WARNING=1
docs: $(STAMP)
	$(DOCS_ENV) $(BIN)/python -m scripts.make_concept_figures
	$(DOCS_ENV) $(BIN)/python -m scripts.make_docs_pages
	$(DOCS_ENV) $(BIN)/mkdocs build --strict

serve-docs: docs
	$(DOCS_ENV) $(BIN)/mkdocs serve --dev-addr 127.0.0.1:8000

# KaTeX is committed under docs/vendor/katex so math renders without a CDN; this refreshes it from
# npm. Only the minified bundle, auto-render and the woff2 fonts (which every current browser
# takes first) are kept; the package's README.md is left out, or mkdocs would build it as a page.
KATEX_VERSION := 0.16.47
vendor-katex:
	tmp=$$(mktemp -d) && npm install --silent --prefix "$$tmp" katex@$(KATEX_VERSION) && \
	src="$$tmp/node_modules/katex" && dst=docs/vendor/katex && rm -rf "$$dst" && \
	mkdir -p "$$dst/contrib" "$$dst/fonts" && \
	cp "$$src/LICENSE" "$$src/dist/katex.min.js" "$$src/dist/katex.min.css" "$$dst/" && \
	cp "$$src/dist/contrib/auto-render.min.js" "$$dst/contrib/" && \
	cp "$$src/dist/fonts/"*.woff2 "$$dst/fonts/" && rm -rf "$$tmp"
