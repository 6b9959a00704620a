"""The expert pool: every expert weight stacked on a slot axis, float or packed int4."""

from __future__ import annotations

from typing import NamedTuple

import jax

from strata_jax.quant import dequantize_int4_jnp


class ExpertPool(NamedTuple):
    """Expert weights on a slot axis.

    Float: w1/w3 [S, D, F] (gate/up), w2 [S, F, D]. Packed int4 (symmetric, g = 128 along the
    input dim, output-major K-pair nibbles, see docs/quantization.md): w1/w3 uint8 [S, F, D/2],
    w2 uint8 [S, D, F/2], and bf16 scales *_scale [S, in/128, out].
    """

    w1: jax.Array
    w3: jax.Array
    w2: jax.Array
    w1_scale: jax.Array | None = None
    w3_scale: jax.Array | None = None
    w2_scale: jax.Array | None = None

    @property
    def quantized(self) -> bool:
        return self.w1_scale is not None

    @property
    def num_slots(self) -> int:
        return self.w1.shape[0]

    @property
    def intermediate_size(self) -> int:
        return self.w1.shape[-2] if self.quantized else self.w1.shape[-1]

    def dense_weights(self, kind: str, slots: jax.Array, dtype) -> jax.Array:
        """The weights of `slots` as [C, in, out] in `dtype` (dequantized if packed)."""
        w = getattr(self, kind)[slots]
        if not self.quantized:
            return w.astype(dtype)
        return dequantize_int4_jnp(w, getattr(self, f"{kind}_scale")[slots], dtype)
