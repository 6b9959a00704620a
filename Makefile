# Two entry points: `make demo` and `make test`. Each creates .venv on a fresh machine and
# installs from the pinned environment in requirements.txt, the lock (every package pinned).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP_VERSION := 26.3
# pytest-xdist processes for `make test`, each taking whole test files (module fixtures built
# once); CI has 2 cores
TEST_WORKERS ?= 2
# Most of the suite's time is XLA compiling small CPU programs: without LLVM's optimizations
# it compiles in about half the time. The tests compare programs compiled alike (subprocesses
# inherit the flag: tests/ep_worker.py `xla_flags`), and the GPU runs use XLA's defaults.
TEST_XLA_FLAGS ?= --xla_backend_optimization_level=0

.PHONY: demo test lint lock test-latest clean

# The build backend comes from the lock too: the package builds in the venv (no isolated
# build environment, which would fetch the newest setuptools of the day).
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q pip==$(PIP_VERSION)
	$(BIN)/pip install -q -c requirements.txt setuptools

# demo: the package's run dependencies at the lock's versions (the lock also pins the test
# extras, which the demo does not need)
$(VENV)/.base: pyproject.toml requirements.txt | $(BIN)/python
	$(BIN)/pip install -q --no-build-isolation -c requirements.txt -e .
	touch $@

# test: exactly the lock, and the package on top of it
$(VENV)/.test: pyproject.toml requirements.txt | $(BIN)/python
	$(BIN)/pip install -q --no-build-isolation -r requirements.txt -e '.[test]'
	touch $@ $(VENV)/.base

demo: $(VENV)/.base
	$(BIN)/python -m strata_runtime.demo

lint: $(VENV)/.test
	$(BIN)/ruff check .

test: $(VENV)/.test
	$(BIN)/ruff check .
	XLA_FLAGS="$(TEST_XLA_FLAGS) $$XLA_FLAGS" $(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=12

# Re-resolve every dependency at its newest release into the lock (review the diff, then
# `make test`): the lock changes only when someone asks for it.
lock:
	rm -rf .venv-lock
	$(PYTHON) -m venv .venv-lock
	.venv-lock/bin/pip install -q pip==$(PIP_VERSION)
	.venv-lock/bin/pip install -q setuptools
	.venv-lock/bin/pip install -q --no-build-isolation -e '.[test]'
	{ echo "# The lock: every run and test dependency and the build backend"; \
	  echo "# (setuptools) as a fresh resolution gave it on $$(date +%F) (Python 3.11, CPU)."; \
	  echo "# Regenerate: make lock. Newest: make test-latest."; \
	  .venv-lock/bin/pip freeze --all --exclude-editable | grep -v -e '^#' -e '^pip=='; } \
	  > requirements.txt
	rm -rf .venv-lock

# The tests against today's newest releases, in a venv of their own (the lock is untouched).
test-latest:
	rm -rf .venv-latest
	$(PYTHON) -m venv .venv-latest
	.venv-latest/bin/pip install -q -e '.[test]'
	.venv-latest/bin/pytest -q

clean:
	rm -rf $(VENV) .venv-lock .venv-latest .pytest_cache .ruff_cache
