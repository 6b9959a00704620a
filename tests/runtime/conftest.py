"""Runtime tests compile many step programs (each budget, plan and model its own): drop them
after every test, so one pytest process does not keep hundreds of executables alive (XLA:CPU
crashed compiling, late in a full run, when they were kept)."""

import jax
import pytest


@pytest.fixture(autouse=True)
def _fresh_compile_cache():
    yield
    jax.clear_caches()
