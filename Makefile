# `make test` and `make demo` work on a fresh machine: they create .venv first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test demo lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,examples,bench]"
	touch $(STAMP)

test: $(STAMP)
	$(VENV)/bin/ruff check jaxdist tests benchmarks conftest.py
	$(VENV)/bin/mypy jaxdist
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q
	@$(PY) -c "import sys, jax; print(f'tested with Python {sys.version.split()[0]}, jax {jax.__version__}')"

demo: $(STAMP)
	$(PY) -m jaxdist.examples.digits

lint: $(STAMP)
	$(VENV)/bin/ruff check jaxdist tests benchmarks conftest.py
	$(VENV)/bin/ruff format --check jaxdist tests benchmarks

bench: $(STAMP)
	$(PY) benchmarks/dispatch.py
	$(PY) benchmarks/run_overhead.py
	$(PY) benchmarks/train_step.py
	$(PY) benchmarks/input_pipeline.py
	$(PY) benchmarks/digits.py
	$(PY) benchmarks/multi_process.py
	$(PY) benchmarks/checkpoint.py
	$(PY) benchmarks/parameter_server.py
	$(PY) benchmarks/fsdp.py

clean:
	rm -rf .venv .venv313 .pytest_cache .ruff_cache *.egg-info
