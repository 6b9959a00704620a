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

.PHONY: demo test lint lock clean

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

# Re-resolve every dependency at its newest release into the lock, and the GPU install's wheels
# against it (requirements-cuda12.txt), by pip's dry runs: nothing is installed. Review the
# diff, then `make test`: the locks change only when someone asks for it.
lock: | $(BIN)/python
	$(BIN)/python tools/lock.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
