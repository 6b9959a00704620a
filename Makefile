# Two entry points: `make demo` and `make test`. Each creates .venv on a fresh machine: `demo`
# installs the run lock, requirements.txt (what the package needs to run, and the build
# backend, each at one exact version), `test` adds the test lock, requirements-test.txt. Every
# pin comes from the public package index (`make lock-check`).
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

.PHONY: demo test lint lock lock-check clean

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

$(VENV)/.installed-test: requirements-test.txt $(VENV)/.installed
	$(BIN)/pip install -q --no-deps -r requirements-test.txt
	$(BIN)/pip check
	touch $@

demo: $(VENV)/.installed
	$(BIN)/python -m strata_runtime.cli.demo

lint: $(VENV)/.installed-test
	$(BIN)/ruff check .

test: $(VENV)/.installed-test
	$(BIN)/ruff check .
	XLA_FLAGS="$(TEST_XLA_FLAGS) $$XLA_FLAGS" $(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=12

# Re-resolve every dependency at its newest release from the public index into the run and test
# locks, and the GPU install's wheels against them (requirements-cuda12.txt), by pip's dry runs:
# nothing is installed. Review the diff, then `make test`: the locks change only when someone
# asks for it. `lock-check`: every pin of the three locks is on the public index (CI runs it).
lock: | $(BIN)/python
	$(BIN)/python tools/lock.py

lock-check: | $(BIN)/python
	$(BIN)/python tools/lock.py --check

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
