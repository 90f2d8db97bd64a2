# spillway: `make train` trains the tiny recipe on the embedded corpus; `make test` runs the tests.
# Both create the virtual environment (.venv) on first use.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.spillway-installed
ARGS ?=

.PHONY: train test test-slow test-all gpu-plugin plan bench clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $@

# The deviceless GPU compiler (jax-cuda13 plugin, version = installed jaxlib) goes
# into its own folder, loaded only by the planner's compile process.
gpu-plugin: $(STAMP)
	$(PY) -m spillway.recipes.plan.plugin install

train: $(STAMP)
	$(VENV)/bin/spillway train tiny $(ARGS)

test: $(STAMP) gpu-plugin
	$(PY) -m pytest -q -m "not slow" $(ARGS)

test-slow: $(STAMP) gpu-plugin
	$(PY) -m pytest -q -m slow $(ARGS)

test-all: $(STAMP) gpu-plugin
	$(PY) -m pytest -q $(ARGS)

plan: $(STAMP) gpu-plugin
	$(VENV)/bin/spillway plan llama3_8b --gpu h200 $(ARGS)

clean:
	rm -rf runs .cache .pytest_cache
