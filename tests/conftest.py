"""Test-wide settings: float32 references mean float32 matmuls, also when a GPU is present;
the CLI's persistent compilation cache stays off in the test process (tests that want it
turn it on in a subprocess of their own)."""

import os

import jax

from strata_runtime.engine.compile_cache import ENV

os.environ[ENV] = "off"
jax.config.update("jax_default_matmul_precision", "highest")
