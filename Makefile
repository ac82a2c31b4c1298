# Quick start: `make demo` and `make test` work on a fresh machine with only Python 3.11.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed

.PHONY: demo test test-slow venv notebooks clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# One install of the package with its test, parity, notebooks and serve extras; re-run when pyproject changes.
# The editable install leaves our own sources without bytecode, and where PYTHONDONTWRITEBYTECODE is set
# every process (test workers, notebook kernels, the tests' child processes) compiles hkv again on import:
# ~0.5 s each on 2 cores. compileall writes it once; a .pyc older than its source is simply not used.
$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(PIP) install -q -e '.[test,parity,notebooks,serve]'
	$(PY) -m compileall -q -j 0 hkv models pallas_kernels > /dev/null
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m models.deepseek_v4.demo

# Test files run in HKV_TEST_WORKERS processes (pytest-xdist; a file's tests stay in one process, so its
# module fixtures are built once). One XLA compile uses ~1.6 cores on average: 2 workers keep a 2-core box busy.
HKV_TEST_WORKERS ?= 2

test: $(STAMP)
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m pytest -q --durations=15 -n $(HKV_TEST_WORKERS) --dist loadfile

test-slow: $(STAMP)
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m pytest -q -m slow

# Regenerate colab/*.ipynb (stored without outputs) from their jupytext sources colab/*.py.
notebooks: $(STAMP)
	$(VENV)/bin/jupytext --to ipynb colab/[0-9]*.py

clean:
	rm -rf $(VENV) .pytest_cache
