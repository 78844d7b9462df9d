# `make test` and `make demo` work on a fresh machine: they create .venv first; `make docs`
# creates its own .venv-docs (Sphinx and the notebooks' kernel) and builds docs/_build/html.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DOCS_VENV  ?= .venv-docs
DOCS_PY    := $(DOCS_VENV)/bin/python
DOCS_STAMP := $(DOCS_VENV)/.installed
# pytest worker processes. Two, for CI's two cores: much of the suite waits on the processes
# it starts or compiles in one thread, so two workers take about 0.6 of one's time there.
# Each worker's tests still see 8 simulated devices; a test file stays in one worker.
TEST_WORKERS ?= 2

.PHONY: test demo docs lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,examples,bench]"
	touch $(STAMP)

test: $(STAMP)
	$(VENV)/bin/ruff check jaxdist tests benchmarks conftest.py docs
	$(VENV)/bin/ruff format --check jaxdist tests benchmarks conftest.py
	$(VENV)/bin/mypy jaxdist
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile
	@$(PY) -c "import sys, jax; print(f'tested with Python {sys.version.split()[0]}, jax {jax.__version__}')"

$(DOCS_STAMP): pyproject.toml
	$(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_PY) -m pip install --quiet --upgrade pip
	$(DOCS_PY) -m pip install --quiet -e ".[docs]"
	touch $(DOCS_STAMP)

# The site, with warnings as errors (a broken cross-reference, a missing API entry, a
# notebook cell that raises), then the checks that the build fails when it should.
docs: $(DOCS_STAMP)
	$(DOCS_PY) -m sphinx -W --keep-going -n -E -b html docs docs/_build/html
	$(DOCS_PY) -m pytest -q -p no:cacheprovider tests/docs

demo: $(STAMP)
	$(PY) -m jaxdist.examples.digits

lint: $(STAMP)
	$(VENV)/bin/ruff check jaxdist tests benchmarks conftest.py docs
	$(VENV)/bin/ruff format --check jaxdist tests benchmarks conftest.py

bench: $(STAMP)
	$(PY) benchmarks/dispatch.py
	$(PY) benchmarks/run_overhead.py
	$(PY) benchmarks/train_step.py
	$(PY) benchmarks/all_reduce.py
	$(PY) benchmarks/input_pipeline.py
	$(PY) benchmarks/digits.py
	$(PY) benchmarks/multi_process.py
	$(PY) benchmarks/checkpoint.py
	$(PY) benchmarks/parameter_server.py
	$(PY) benchmarks/fsdp.py
	$(PY) benchmarks/mesh.py
	$(PY) benchmarks/fit_metrics.py

clean:
	rm -rf .venv .venv313 .venv-docs .pytest_cache .ruff_cache *.egg-info docs/_build
