# spillway: `make train` trains the tiny recipe on the embedded corpus; `make test` runs the tests.
# Both create the virtual environment (.venv) on first use.
#
# Tested JAX versions (README, "Tested JAX versions"), each in its own venv:
#   make test test-slow   Python 3.11, jax 0.10.2 (the floor), .venv, all extras
#   make test-jax011      Python 3.12, jax 0.11.2 (the GPU machine's), .venv-jax011
#   make test-newest      Python 3.13, newest jax pinned by constraints/newest.txt, .venv-newest
#   (both run the whole suite; SUITE=test runs only the default, SUITE=test-slow the slow tests)
#   make test-unpinned    Python 3.13, whatever pip resolves today, .venv-unpinned
#   make freeze-newest    rewrite constraints/newest.txt from .venv-unpinned (after test-unpinned passed)
# The 3.12/3.13 venvs get the `test` extra only: torch's pinned CPU wheel exists
# here only for Python 3.11 (elsewhere pip would fetch a multi-GB CUDA build), so
# the Hugging Face parity tests run in .venv alone and skip elsewhere.

PYTHON ?= python3
VENV ?= .venv
EXTRAS ?= dev
CONSTRAINTS ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.spillway-installed
ARGS ?=
# The suite runs in one pytest-xdist worker per core, at most 4 (each worker is a JAX process with 8 fake
# devices and up to ~4 GB resident): compiling, most of the suite's time, uses one core per program.
# `worksteal` hands a worker's queue half over to an idle one, so one long file does not leave a core idle.
# TEST_WORKERS=0 runs everything in one process, as before.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n < 4 ? n : 4 )))
PYTEST := $(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal
# Interpreters for the other environments: pyenv's, else the first on PATH.
PYTHON312 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
PYTHON313 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.13*/bin/python3.13) python3.13)

.PHONY: train test test-slow test-all test-jax011 test-newest test-unpinned freeze-newest gpu-plugin plan bench clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[$(EXTRAS)]' $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
	@touch $@

# The deviceless GPU compiler (jax-cuda13 plugin, version = installed jaxlib) goes
# into its own folder inside the venv, loaded only by the planner's compile process.
gpu-plugin: $(STAMP)
	$(PY) -m spillway.recipes.plan.plugin install

train: $(STAMP)
	$(VENV)/bin/spillway train tiny $(ARGS)

test: $(STAMP) gpu-plugin
	$(PYTEST) -q -m "not slow" $(ARGS)

# SLOW_MARKS narrows the slow tests: CI runs those with a torch reference and those that compile for the
# CPU alone in .venv, those that compile for a GPU (needs_toolchain) in .venv-jax011 (see .ci/run).
SLOW_MARKS ?= slow
test-slow: $(STAMP) gpu-plugin
	$(PYTEST) -q -m "$(SLOW_MARKS)" $(ARGS)

test-all: $(STAMP) gpu-plugin
	$(PYTEST) -q $(ARGS)

# The whole suite (slow tests included) in each of the other tested environments.
SUITE ?= test-all
test-jax011:
	SPILLWAY_ENV_WITHOUT_TORCH=1 $(MAKE) $(SUITE) VENV=.venv-jax011 PYTHON=$(PYTHON312) EXTRAS=test CONSTRAINTS=constraints/jax011.txt

test-newest:
	SPILLWAY_ENV_WITHOUT_TORCH=1 $(MAKE) $(SUITE) VENV=.venv-newest PYTHON=$(PYTHON313) EXTRAS=test CONSTRAINTS=constraints/newest.txt

test-unpinned:
	SPILLWAY_ENV_WITHOUT_TORCH=1 $(MAKE) $(SUITE) VENV=.venv-unpinned PYTHON=$(PYTHON313) EXTRAS=test

freeze-newest:
	@test -x .venv-unpinned/bin/python || { echo "run make test-unpinned first"; exit 1; }
	{ echo "# make test-newest's pins: pip freeze of .venv-unpinned (Python 3.13) on $$(date +%F), see Makefile."; \
	  .venv-unpinned/bin/python -m pip freeze --exclude-editable | grep -v -i '^spillway'; } > constraints/newest.txt

plan: $(STAMP) gpu-plugin
	$(VENV)/bin/spillway plan llama3_8b $(ARGS)

clean:
	rm -rf runs .cache .pytest_cache
