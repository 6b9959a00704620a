"""Test-wide settings: float32 references mean float32 matmuls, also when a GPU is present;
the CLI's persistent compilation cache stays off in the test process (tests that want it
turn it on in a subprocess of their own). JAX's own persistent cache is on, in a folder of
this run alone that the xdist workers and the tests' subprocesses share (they inherit the
environment): many tests compile the same programs, and a run starts with none."""

import atexit
import os
import shutil
import tempfile

import jax

from strata_runtime.compile_cache import ENV

RUN_CACHE = "STRATA_TEST_JAX_CACHE"
if RUN_CACHE not in os.environ:  # the first process of the run (xdist's controller) makes it
    os.environ[RUN_CACHE] = tempfile.mkdtemp(prefix="strata-test-jax-")
    atexit.register(shutil.rmtree, os.environ[RUN_CACHE], True)
os.environ.update(JAX_COMPILATION_CACHE_DIR=os.environ[RUN_CACHE],
                  JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                  JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
jax.config.update("jax_compilation_cache_dir", os.environ[RUN_CACHE])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
os.environ[ENV] = "off"
jax.config.update("jax_default_matmul_precision", "highest")
