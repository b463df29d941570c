# The Distributed Training Lab. `make lab` opens the course; `make test` checks everything.
# Both set up .venv on first use (Python 3.10+, no conda needed) and skip that afterwards.

PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# A package index for torch, e.g. https://download.pytorch.org/whl/cpu (no CUDA download on a
# laptop) or https://download.pytorch.org/whl/cu130 (a particular CUDA build). See README.md.
TORCH_INDEX ?=
CELL_TIMEOUT ?= 180
ARTIFACTS := test-artifacts

.DEFAULT_GOAL := help
.PHONY: help setup lab test test-fast lint unit notebooks browser bench gpu-check clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):.*## (.*)/  make \1\t\2/' | expand -t 22

setup: $(STAMP) ## create .venv and install the lab into it (once; again only if pyproject.toml changes)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null || \
		{ echo "make: the lab needs Python 3.10 or newer; set PYTHON=/path/to/python3.11"; exit 1; }
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --progress-bar off $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) -e '.[lab,test]'
	$(BIN)/python -m ipykernel install --sys-prefix --name labkit --display-name "Python (labkit)"
	touch $(STAMP)

lab: setup ## open the course in JupyterLab (http://127.0.0.1, token required)
	$(BIN)/jupyter lab --ServerApp.ip=127.0.0.1 --ServerApp.root_dir=notebooks

test: test-fast browser ## everything: lint, unit and distributed tests, every notebook (nbval and browser)
	@echo "make test: all checks passed. Screenshots of every notebook: $(ARTIFACTS)/screenshots/"

test-fast: lint unit notebooks ## the same without the browser, for quick loops

lint: setup ## ruff on code and notebooks; notebooks must be committed without outputs
	$(BIN)/ruff check labkit tests benchmarks notebooks
	$(BIN)/nbstripout --verify notebooks/*.ipynb

unit: setup ## unit and distributed tests (real processes over gloo)
	$(BIN)/python -m pytest tests --ignore=tests/browser

notebooks: setup ## run every notebook top to bottom (nbval)
	$(BIN)/python -m pytest --nbval-lax --nbval-current-env --nbval-cell-timeout=$(CELL_TIMEOUT) \
		-p no:cacheprovider notebooks

browser: setup ## every notebook in JupyterLab in Chromium (Playwright); screenshots in test-artifacts/
	$(BIN)/python -m pytest tests/browser; status=$$?; \
		echo "Screenshots of every notebook: $(ARTIFACTS)/screenshots/"; exit $$status

bench: setup ## print the benchmark tables (launcher, collectives)
	@for b in benchmarks/[a-z]*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

gpu-check: setup ## on a CUDA machine: devices, backend choice, labkit's kernels on GPUs vs torch's
	$(BIN)/python -m labkit.gpu_check

clean: ## remove .venv, caches and test artifacts
	rm -rf $(VENV) $(ARTIFACTS) .pytest_cache .ruff_cache .hypothesis *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
