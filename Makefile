# Two entry points: `make demo` and `make test`. Each creates .venv on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.base: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.test: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'
	touch $@ $(VENV)/.base

demo: $(VENV)/.base
	$(BIN)/python -m strata_runtime.demo

lint: $(VENV)/.test
	$(BIN)/ruff check .

test: $(VENV)/.test
	$(BIN)/ruff check .
	$(BIN)/pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
