# The Distributed Training Lab. `make lab` opens the course; `make test` checks everything.
# Both set up .venv on first use (Python 3.10+, no conda needed) and skip that afterwards.

PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# JupyterLab defaults for the course (code wraps at the notebook's width; no pop-up asking to fetch Jupyter news
# on the first start), installed into the environment.
OVERRIDES := $(VENV)/share/jupyter/lab/settings/overrides.json
# The kernels' IPython config (ipywidgets loaded as a kernel starts: no "No such comm" warnings), installed likewise.
KERNEL_CONFIG := $(VENV)/etc/ipython/ipython_kernel_config.py
# Where torch comes from. "auto": on Linux without an NVIDIA driver, PyTorch's CPU index (no multi-GB CUDA
# download on a laptop); elsewhere PyPI's default build. Or name an index, e.g. https://download.pytorch.org/whl/cu130,
# or set it empty for PyPI's default everywhere. See README.md.
TORCH_INDEX ?= auto
CPU_INDEX := https://download.pytorch.org/whl/cpu
NVIDIA_DRIVER := $(shell [ -e /proc/driver/nvidia/version ] || command -v nvidia-smi >/dev/null 2>&1 && echo yes)
TORCH_FROM := $(if $(filter auto,$(TORCH_INDEX)),$(if $(and $(filter Linux,$(shell uname -s)),$(if $(NVIDIA_DRIVER),,no)),$(CPU_INDEX)),$(TORCH_INDEX))
# pip's progress bars when a person watches a terminal; quiet in CI and in logs.
PIP_PROGRESS := $(shell [ -t 2 ] && [ -z "$$CI" ] && echo on || echo off)
# make lab opens your own copy of the course (created once, never overwritten): your edits and outputs stay
# yours, and `git pull` never conflicts with them. `make refresh NOTEBOOK=03_ring_allreduce` resets one.
LAB_DIR ?= my-notebooks
# The port JupyterLab listens on, on 127.0.0.1 only. Empty: JupyterLab's own (8888, or the next free one). Named, e.g.
# `make lab LAB_PORT=8889` for a second student on one GPU box, it is that port or an error, never another one, so
# that the student's `ssh -L 8889:127.0.0.1:8889` reaches this lab (README, "For instructors").
LAB_PORT ?=
CELL_TIMEOUT ?= 180
# pytest-xdist workers for `make unit`: most distributed tests wait on process starts and rendezvous, so two
# share 2 cores well; more only help with more cores (each test starts up to 8 ranks).
TEST_WORKERS ?= 2
# Every notebook run by papermill at 2 ranks, two notebooks at a time: they time what they teach (a bubble, a
# bandwidth fit), but they assert bytes and formulas, never a timing (a timing is a verdict they print), so a
# notebook beside them changes the numbers shown, not the checks; 2:18 instead of 4:01 on 2 idle cores. For
# timings worth reading, run them one at a time: make unit PAPERMILL_WORKERS=1.
PAPERMILL_WORKERS ?= 2
PAPERMILL_TESTS := tests/notebooks/test_papermill.py
# The browser tests two notebooks at a time, each pytest-xdist worker with its own JupyterLab server and Chromium
# (tests/browser/conftest.py: session fixtures are per worker): a notebook in JupyterLab waits on its kernel, on
# rendering and on polls most of the time (5:43 of CPU in 7:34 on 2 idle cores, one at a time). Like papermill,
# they check what shows and what moves, never a timing. BROWSER_WORKERS=1 for one at a time.
BROWSER_WORKERS ?= 2
# The second run of the tests marked numerics collects only the modules that name the marker (each worker collecting
# all of tests/unit and tests/distributed, 3500 tests, took some 8 s of CPU more for the same 182); -m numerics
# still picks the tests among them.
NUMERICS_MODULES = $(shell grep -l 'pytest\.mark\.numerics' tests/unit/test_*.py tests/distributed/test_*.py)
ARTIFACTS := test-artifacts
# The class hub's proxy (npm's configurable-http-proxy, pinned in deploy/package-lock.json), installed by `npm ci`.
PROXY := deploy/node_modules/.bin/configurable-http-proxy
# The tests' exercise progress (labkit.exercises.progress) goes here, never into the student's ~/.labkit.
unit notebooks browser: export LABKIT_PROGRESS = $(CURDIR)/$(ARTIFACTS)/progress.json

.DEFAULT_GOAL := help
.PHONY: help setup lab copy refresh test test-fast lint unit hub-test book book-test notebooks browser bench hub gradebook gpu-test gpu-wheels \
	gpu-check clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):.*## (.*)/  make \1\t\2/' | expand -t 22

setup: $(STAMP) $(OVERRIDES) $(KERNEL_CONFIG) ## create .venv and install the lab into it (once; again only if pyproject.toml changes)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null || \
		{ echo "make: the lab needs Python 3.10 or newer; set PYTHON=/path/to/python3.11"; exit 1; }
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	@echo "make: installing PyTorch $(if $(TORCH_FROM),from $(TORCH_FROM),from PyPI)$(if $(and $(filter auto,$(TORCH_INDEX)),$(TORCH_FROM)), (no NVIDIA driver found: the CPU build; TORCH_INDEX= for PyPI's)), then the lab"
	$(BIN)/python -m pip install --progress-bar $(PIP_PROGRESS) --no-deps $(if $(TORCH_FROM),--extra-index-url $(TORCH_FROM)) \
		$$(sed -n 's/^ *"\(torch==[^"]*\)",$$/\1/p' pyproject.toml)
	$(BIN)/python -m pip install --progress-bar $(PIP_PROGRESS) -e '.[lab,test,hub,book]'
	$(BIN)/python -m ipykernel install --sys-prefix --name labkit --display-name "Python (labkit)"
	touch $(STAMP)

$(OVERRIDES): jupyter/overrides.json $(STAMP)
	mkdir -p $(dir $@) && cp jupyter/overrides.json $@

$(KERNEL_CONFIG): jupyter/ipython_kernel_config.py $(STAMP)
	mkdir -p $(dir $@) && cp jupyter/ipython_kernel_config.py $@

lab: setup copy ## open your copy of the course in JupyterLab (http://127.0.0.1, token required; LAB_PORT=8889: that port)
	$(BIN)/jupyter lab --ServerApp.ip=127.0.0.1 --ServerApp.root_dir=$(LAB_DIR) \
		$(if $(LAB_PORT),--ServerApp.port=$(LAB_PORT) --ServerApp.port_retries=0) \
		--KernelSpecManager.allowed_kernelspecs=labkit

copy: ## your copy of the course (my-notebooks/): adds the notebooks it lacks, never overwrites one
	@mkdir -p $(LAB_DIR)
	@for nb in notebooks/*.ipynb; do [ -e "$(LAB_DIR)/$${nb##*/}" ] || { cp "$$nb" $(LAB_DIR)/ && echo "make: $(LAB_DIR)/$${nb##*/} (new)"; }; done

refresh: ## make refresh NOTEBOOK=03_ring_allreduce: your copy back to the course's (the old one kept as a backup)
	@test -n "$(NOTEBOOK)" && test -f "notebooks/$(NOTEBOOK:.ipynb=).ipynb" || \
		{ echo "make: say which notebook, e.g. make refresh NOTEBOOK=03_ring_allreduce (see notebooks/)"; exit 2; }
	@mkdir -p $(LAB_DIR)
	@mine="$(LAB_DIR)/$(NOTEBOOK:.ipynb=).ipynb"; \
		if [ -e "$$mine" ]; then backup="$${mine%.ipynb}.backup-$$(date +%Y%m%d-%H%M%S).ipynb"; mv "$$mine" "$$backup"; \
			echo "make: your version is kept as $$backup"; fi; \
		cp "notebooks/$(NOTEBOOK:.ipynb=).ipynb" "$$mine" && echo "make: $$mine is the course's version again"

test: lint unit hub-test book-test browser ## everything: lint, unit and distributed tests, every notebook (papermill, the website, the browser)
	@echo "make test: all checks passed. Screenshots of every notebook: $(ARTIFACTS)/screenshots/"

test-fast: lint unit hub-test notebooks ## without the browser: every notebook through nbval instead, for quick loops

lint: setup ## ruff on code and notebooks; notebooks must be committed without outputs
	$(BIN)/ruff check labkit tests benchmarks notebooks book
	$(BIN)/nbstripout --verify notebooks/*.ipynb

# The tests marked numerics (they compare floating-point results: tests/unit/test_numerics_marker.py) run again
# on other kernels than this CPU's own: ATen's scalar kernels for its vectorised ones, and MKL's AVX2 branch
# (MKL_CBWR: on an AVX-512 Intel CPU another GEMM code path; on AMD, MKL keeps its default but for small
# matrices). An exact assert that holds only by one CPU's summation order may fail here as on another machine.
unit: setup ## unit and distributed tests (real processes over gloo), TEST_WORKERS at a time; then papermill
	$(BIN)/python -m pytest -n $(TEST_WORKERS) tests --ignore=tests/browser --ignore=$(PAPERMILL_TESTS) --ignore=tests/hub \
		--ignore=tests/book
	MKL_CBWR=AVX2 ATEN_CPU_CAPABILITY=default $(BIN)/python -m pytest -n $(TEST_WORKERS) -m numerics -q \
		$(NUMERICS_MODULES)
	$(BIN)/python -m pytest -n $(PAPERMILL_WORKERS) $(PAPERMILL_TESTS)

# The class's hub with 8 students at once takes both cores by itself: its own phase, one test at a time.
hub-test: setup $(PROXY) ## the class's JupyterHub, for real: 8 local students, isolation, caps, bounds, gradebook (root)
	$(BIN)/python -m pytest -p no:cacheprovider tests/hub

# The course as a website (book/): every notebook executed at 2 ranks, BOOK_WORKERS at a time, as a new student's
# would run (no solution, no progress), then Sphinx (-W: a broken link or reference fails the build).
BOOK_DIR ?= build/book
BOOK_WORKERS ?= 2
book: setup ## the course as a static website in build/book/html, every notebook executed at 2 ranks (a few minutes)
	$(BIN)/python book/prepare.py $(BOOK_DIR) --workers $(BOOK_WORKERS)
	rm -rf $(BOOK_DIR)/html $(BOOK_DIR)/doctrees
	$(BIN)/sphinx-build -q -W --keep-going -b html -c book -d $(BOOK_DIR)/doctrees $(BOOK_DIR)/src $(BOOK_DIR)/html
	@echo "make book: the site is $(BOOK_DIR)/html/index.html ($$(du -sh $(BOOK_DIR)/html | cut -f1)); serve it with" \
		"$(BIN)/python -m http.server -d $(BOOK_DIR)/html"

book-test: book ## the website in Chromium: every page's figures drawn, links resolved, no solution given away
	LABKIT_BOOK=$(BOOK_DIR) $(BIN)/python -m pytest -p no:cacheprovider tests/book

notebooks: setup ## run every notebook top to bottom (nbval)
	$(BIN)/python -m pytest --nbval-lax --nbval-current-env --nbval-cell-timeout=$(CELL_TIMEOUT) \
		-p no:cacheprovider notebooks

browser: setup ## every notebook in JupyterLab in Chromium (Playwright); screenshots in test-artifacts/
	$(BIN)/python -m pytest -n $(BROWSER_WORKERS) tests/browser; status=$$?; \
		echo "Screenshots of every notebook: $(ARTIFACTS)/screenshots/"; exit $$status

# A class on one server (README, "A class on one server"): JupyterHub as root, each student's server as that student.
HUB_PORT ?= 8000
HUB_STATE ?= .hub
CLASS_LIST ?=
CLASS_WORLD_SIZE ?= 4
CLASS_THREADS_PER_RANK ?= 1
CLASS_MEMORY_GIB ?= 4
CLASS_CPU_CORES ?= 2
$(PROXY): deploy/package.json deploy/package-lock.json
	cd deploy && npm ci --no-audit --no-fund --loglevel=error
hub: setup $(PROXY) ## a class on this server: JupyterHub, each student's server as that student (run as root)
	@[ "$$(id -u)" = 0 ] || { echo "make hub: run it as root (sudo make hub): the hub starts each student's server as that student"; exit 1; }
	LABKIT_HUB_PORT=$(HUB_PORT) LABKIT_HUB_STATE=$(HUB_STATE) LABKIT_CLASS_LIST=$(CLASS_LIST) \
		LABKIT_CLASS_WORLD_SIZE=$(CLASS_WORLD_SIZE) LABKIT_CLASS_THREADS_PER_RANK=$(CLASS_THREADS_PER_RANK) \
		LABKIT_CLASS_MEMORY_GIB=$(CLASS_MEMORY_GIB) LABKIT_CLASS_CPU_CORES=$(CLASS_CPU_CORES) \
		$(BIN)/jupyterhub -f deploy/jupyterhub_config.py

gradebook: setup ## every student's exercises re-graded from their notebooks: a table and gradebook.csv (root)
	@[ "$$(id -u)" = 0 ] || { echo "make gradebook: run it as root (sudo make gradebook): it grades as each student"; exit 1; }
	$(BIN)/python -m labkit.classroom.gradebook --hub http://127.0.0.1:$(HUB_PORT) \
		--token-file $(HUB_STATE)/gradebook-token --csv gradebook.csv

bench: setup ## print the benchmark tables (launcher, collectives, DDP, pipeline, ZeRO and FSDP)
	@for b in benchmarks/[a-z]*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

# On a CUDA machine with its own torch, nothing installed: `make gpu-test` there uses .venv if it exists, else python3.
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
gpu-test: ## on a CUDA machine, its own torch: tests/gpu, then every notebook under NCCL, with what carried each
	PYTHONPATH=. $(GPU_PYTHON) -m pytest tests/gpu -ra -p no:cacheprovider
	PYTHONPATH=. $(GPU_PYTHON) tests/gpu/run_notebooks.py

# What a CUDA machine with its own torch but no network lacks (Python 3.12, x86-64), as wheels to carry in .whl/:
# labkit's and tests/gpu's packages and theirs, less what such a machine's image already holds (torch, numpy, ...).
GPU_WHEELS = asttokens comm debugpy entrypoints executing fastjsonschema ipykernel ipython ipython_pygments_lexers \
	ipywidgets jedi jsonschema jsonschema_specifications jupyter_client jupyter_core jupyterlab_widgets \
	matplotlib_inline nbclient nbformat nest_asyncio2 papermill parso pexpect platformdirs plotly prompt_toolkit \
	ptyprocess pure_eval pyzmq referencing rpds_py stack_data tenacity tornado traitlets wcwidth widgetsnbextension
gpu-wheels: ## here, with PyPI: the wheels tests/gpu/device_run.sh installs on an offline CUDA machine, into .whl/
	rm -rf .whl && python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl $(GPU_WHEELS)

gpu-check: setup ## on a CUDA machine: devices, backend choice, labkit's kernels on GPUs vs torch's
	$(BIN)/python -m labkit.commands.gpu_check

clean: ## remove .venv, caches and test artifacts
	rm -rf .venv $(ARTIFACTS) .pytest_cache .ruff_cache .hypothesis *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
