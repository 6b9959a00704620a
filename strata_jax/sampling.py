"""Per-request sampling, done inside the compiled step.

docs/design.md, "Sampling". A request's `SamplingParams` become one row of `SamplerRows` when
it is prefilled; the step turns each live row's logits into its next token by that row's
settings. The random draw of the token at sequence position p is keyed by (the row's seed, p)
alone, so a seeded request gives the same tokens whatever else shares the batch, whichever row
it takes and however its prompt was chunked. Greedy rows (temperature 0) take the argmax of
their (penalized) logits: with no penalty, the bits of greedy decoding.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import chex
import jax
import jax.numpy as jnp


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request picks its tokens (host side; validated on construction)."""

    temperature: float = 0.0
    """0: greedy (argmax). Otherwise logits are divided by it before sampling."""
    top_k: int = 0
    """Sample among the k likeliest tokens only (0: no limit)."""
    top_p: float = 1.0
    """Sample among the smallest set of likeliest tokens whose probability reaches top_p."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the likeliest one."""
    repetition_penalty: float = 1.0
    """Tokens already in the sequence (prompt or generated) have a positive logit divided by
    it and a negative one multiplied by it (as transformers does); 1: off. Applies to greedy
    rows too."""
    seed: int | None = None
    """The draw of the token at position p depends on (seed, p) only: a seeded request is
    reproducible whatever shares its batch. None: a fresh random seed per request."""
    stop_ids: frozenset[int] = field(default_factory=frozenset)
    """Token ids that end the request (the stop token is returned)."""
    stop: tuple[str, ...] = ()
    """Strings that end the request; applied to the detokenized text (`strata_runtime.text`),
    which is cut before the stop string."""

    def __post_init__(self) -> None:
        checks = [
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (self.seed is None or 0 <= self.seed < 2**63, "seed must be in [0, 2**63)"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"{message}, got {self!r}")
        object.__setattr__(self, "stop_ids", frozenset(int(t) for t in self.stop_ids))
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def greedy(self) -> bool:
        """No draw and no penalty: the plain argmax the greedy programs compute."""
        return self.temperature == 0 and self.repetition_penalty == 1

    def resolved_seed(self) -> int:
        return secrets.randbits(63) if self.seed is None else self.seed


GREEDY = SamplingParams()
