"""The expert pool: every expert weight stacked on a slot axis, float or packed int4."""

from __future__ import annotations

import ctypes
from typing import Any, NamedTuple

import jax
import numpy as np

from strata_jax.formats.quant import dequantize_int4_jnp


class ExpertPool(NamedTuple):
    """Expert weights on a slot axis.

    Float: w1/w3 [S, D, F] (gate/up), w2 [S, F, D]. Packed int4 (symmetric, g = 128 along the
    input dim, output-major K-pair nibbles, see docs/quantization.md): w1/w3 uint8 [S, F, D/2],
    w2 uint8 [S, D, F/2], and bf16 scales *_scale [S, in/128, out]. Packed weights may also be
    tile-major, [S, out/r, in/b, r, b/2] (`tile_major`): the same bytes, each r x b tile that
    one step of the int4 kernel reads stored contiguously. Biased experts (GPT-OSS,
    `ModelConfig.expert_bias`) add b1/b3 [S, F] (gate/up) and b2 [S, D] (down), unquantized.
    """

    w1: jax.Array
    w3: jax.Array
    w2: jax.Array
    w1_scale: jax.Array | None = None
    w3_scale: jax.Array | None = None
    w2_scale: jax.Array | None = None
    b1: jax.Array | None = None
    b3: jax.Array | None = None
    b2: jax.Array | None = None

    @property
    def quantized(self) -> bool:
        return self.w1_scale is not None

    @property
    def biased(self) -> bool:
        """Whether the experts carry biases (b1, b3, b2)."""
        return self.b1 is not None

    def biases(self, slots: jax.Array, dtype) -> tuple[jax.Array, jax.Array, jax.Array] | None:
        """(b1, b3, b2) of `slots` as [C, F], [C, F], [C, D] in `dtype`; None if unbiased."""
        if not self.biased:
            return None
        return tuple(getattr(self, k)[slots].astype(dtype) for k in ("b1", "b3", "b2"))

    @property
    def num_slots(self) -> int:
        return self.w1.shape[0]

    @property
    def intermediate_size(self) -> int:
        if not self.quantized:
            return self.w1.shape[-1]
        return self.w1.shape[1] * self.w1.shape[3] if self.tiled else self.w1.shape[-2]

    @property
    def tiled(self) -> bool:
        """Whether the packed weights are tile-major."""
        return self.w1.ndim == 5

    @property
    def tile(self) -> tuple[int, int] | None:
        """(rows, inputs) of a tile of tile-major packed weights, else None."""
        return (self.w1.shape[3], 2 * self.w1.shape[4]) if self.tiled else None

    def tiled_by(self, rows: int, inputs: int) -> ExpertPool:
        """This pool with its packed weights tile-major by (rows, inputs) (`tile_major`)."""
        return self._replace(**{k: tile_major(getattr(self, k), rows, inputs)
                                for k in ("w1", "w3", "w2")})

    def dense_weights(self, kind: str, slots: jax.Array, dtype) -> jax.Array:
        """The weights of `slots` as [C, in, out] in `dtype` (dequantized if packed)."""
        w = getattr(self, kind)[slots]
        if self.tiled:
            w = row_major(w)
        if not self.quantized:
            return w.astype(dtype)
        return dequantize_int4_jnp(w, getattr(self, f"{kind}_scale")[slots], dtype)


def tile_major(packed: jax.Array, rows: int, inputs: int) -> jax.Array:
    """Packed weights [..., out, in/2] -> [..., out/rows, in/inputs, rows, inputs/2]."""
    *lead, o, half = packed.shape
    if o % rows or (2 * half) % inputs:
        raise ValueError(f"packed weights [{o}, {2 * half} inputs] do not tile by "
                         f"{rows} x {inputs}")
    n = len(lead)
    tiles = packed.reshape(*lead, o // rows, rows, 2 * half // inputs, inputs // 2)
    return tiles.transpose(*range(n), n, n + 2, n + 1, n + 3)


def row_major(tiled: jax.Array) -> jax.Array:
    """The inverse of `tile_major`."""
    *lead, blocks, steps, rows, width = tiled.shape
    n = len(lead)
    return tiled.transpose(*range(n), n, n + 2, n + 1, n + 3).reshape(
        *lead, blocks * rows, steps * width)


def free(*trees: Any) -> None:
    """Delete the device (and pinned-host) buffers of `trees` now, not when the garbage
    collector reaches them: engines built one after another in one process (a sweep, a
    notebook) would otherwise hold two engines' memory at once."""
    for leaf in jax.tree.leaves(trees):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            leaf.delete()


def host_view(array: jax.Array) -> np.ndarray:
    """A numpy array over a host-resident jax array's own buffer (no copy): the host kernel
    reads tier 1 through it and a disk load writes into it. The pointer is taken once the
    buffer is written: a transfer into it may still be in flight, and
    `unsafe_buffer_pointer` does not wait for it."""
    array.block_until_ready()
    dtype = np.dtype(array.dtype)
    raw = (ctypes.c_uint8 * (array.size * dtype.itemsize)).from_address(
        array.unsafe_buffer_pointer())
    return np.frombuffer(raw, dtype).reshape(array.shape)
