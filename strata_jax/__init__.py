"""Strata-JAX: pure model math, checkpoint format and resident inference for MoE models."""

from strata_jax.api import Model, generate, load, logits, score
from strata_jax.formats.config import ModelConfig

__all__ = ["Model", "ModelConfig", "generate", "load", "logits", "score"]
__version__ = "0.1.0"
