# Two entry points: `make demo` and `make test`. Each creates .venv on a fresh machine and
# installs the lock, requirements.txt (every run and test dependency and the build backend,
# each at one exact version), and nothing else.
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

# Both entry points install exactly the lock and nothing else: --no-deps, so pip resolves
# nothing (a package the lock lacks fails `pip check` instead of arriving at the newest
# release of the day), then the package itself on top, built in the venv by the lock's
# setuptools (no isolated build environment, which would fetch the newest setuptools).
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q pip==$(PIP_VERSION)

$(VENV)/.installed: pyproject.toml requirements.txt | $(BIN)/python
	$(BIN)/pip install -q --no-deps -r requirements.txt
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	$(BIN)/pip check
	touch $@

demo: $(VENV)/.installed
	$(BIN)/python -m strata_runtime.demo

lint: $(VENV)/.installed
	$(BIN)/ruff check .

test: $(VENV)/.installed
	$(BIN)/ruff check .
	XLA_FLAGS="$(TEST_XLA_FLAGS) $$XLA_FLAGS" $(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=12

# Re-resolve every dependency at its newest release into the lock (review the diff, then
# `make test`), and the GPU install's wheels against it (requirements-cuda12.txt): the locks
# change only when someone asks for it.
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
	.venv-lock/bin/pip install -q --dry-run --ignore-installed --report .venv-lock/cuda12.json \
	  -c requirements.txt 'jax[cuda12]'
	.venv-lock/bin/python tools/lock_cuda12.py .venv-lock/cuda12.json > requirements-cuda12.txt
	rm -rf .venv-lock

# The tests against today's newest releases, in a venv of their own (the lock is untouched).
test-latest:
	rm -rf .venv-latest
	$(PYTHON) -m venv .venv-latest
	.venv-latest/bin/pip install -q -e '.[test]'
	.venv-latest/bin/pytest -q

clean:
	rm -rf $(VENV) .venv-lock .venv-latest .pytest_cache .ruff_cache
