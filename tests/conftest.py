"""Test-wide settings: float32 references mean float32 matmuls, also when a GPU is present."""

import jax

jax.config.update("jax_default_matmul_precision", "highest")
