"""Runtime tests compile many step programs (each budget, plan and model its own): drop them
after every test, so one pytest process does not keep hundreds of executables alive (XLA:CPU
crashed compiling, late in a full run, when they were kept). A module that sets
`KEEP_PROGRAMS = True` shares its programs across its tests and drops them at its end."""

import jax
import pytest


def _keeps(request) -> bool:
    return getattr(request.module, "KEEP_PROGRAMS", False)


@pytest.fixture(autouse=True)
def _fresh_compile_cache(request):
    yield
    if not _keeps(request):
        jax.clear_caches()


@pytest.fixture(scope="module", autouse=True)
def _programs_of_the_module(request):
    yield
    if _keeps(request):
        jax.clear_caches()
