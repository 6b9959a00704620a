"""Grouped SwiGLU over pool slots: a Pallas (Triton) kernel for decode, an XLA path otherwise.

Both compute, for each active slot c, y[c] = (silu(x @ w1[s_c]) * (x @ w3[s_c])) @ w2[s_c],
reading each slot's weights straight out of the pool (no gathered copy of the experts).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from strata_jax.layers import einsum_f32

PALLAS_MAX_ROWS = 32  # decode shapes; larger row counts take the XLA path


@dataclass(frozen=True)
class Tiles:
    """Pallas tile sizes: reduction block, gate/up output block, down output block, K splits."""

    bk: int = 128
    bf: int = 64
    bd: int = 64
    split_k: int = 4
    num_warps: int = 4
    num_stages: int = 4


def _compiler_params(tiles: Tiles):
    try:
        from jax.experimental.pallas import triton as pltriton

        return pltriton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    except (ImportError, AttributeError):  # CPU-only installs lack the Triton lowering
        return None


def _gate_up_kernel(slots_ref, x_ref, w1_ref, w3_ref, h_ref, *, tiles: Tiles):
    c, j = pl.program_id(0), pl.program_id(1)
    slot = slots_ref[c]
    n, d = x_ref.shape
    bk, bf = tiles.bk, tiles.bf

    def body(k, accs):
        a1, a3 = accs
        xk = x_ref[:, pl.ds(k * bk, bk)]
        cols = pl.ds(j * bf, bf)
        a1 += jnp.dot(xk, w1_ref[slot, pl.ds(k * bk, bk), cols], preferred_element_type=jnp.float32)
        a3 += jnp.dot(xk, w3_ref[slot, pl.ds(k * bk, bk), cols], preferred_element_type=jnp.float32)
        return a1, a3

    zero = jnp.zeros((n, bf), jnp.float32)
    a1, a3 = jax.lax.fori_loop(0, d // bk, body, (zero, zero))
    h_ref[...] = (jax.nn.silu(a1) * a3).astype(h_ref.dtype)[None]


def _down_kernel(slots_ref, h_ref, w2_ref, y_ref, *, tiles: Tiles):
    c, s, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = slots_ref[c]
    n, f = h_ref.shape[1], h_ref.shape[2]
    bk, bd = tiles.bk, tiles.bd
    steps = f // bk // tiles.split_k
    first = s * steps

    def body(k, acc):
        rows = pl.ds((first + k) * bk, bk)
        hk = h_ref[c, :, rows]
        return acc + jnp.dot(hk, w2_ref[slot, rows, pl.ds(j * bd, bd)],
                             preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((n, bd), jnp.float32))
    y_ref[...] = acc[None, None]


def check_tiles(d: int, f: int, tiles: Tiles) -> None:
    if d % tiles.bk or f % tiles.bk or f % tiles.bf or d % tiles.bd:
        raise ValueError(f"expert dims D={d}, F={f} are not multiples of the tiles {tiles}")
    if (f // tiles.bk) % tiles.split_k:
        raise ValueError(f"F={f} / bk={tiles.bk} is not divisible by split_k={tiles.split_k}")


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
def grouped_swiglu_pallas(x, slots, w1, w3, w2, tiles: Tiles = Tiles(), interpret: bool = False):
    """x [N, D] (N <= PALLAS_MAX_ROWS), slots [C] -> partial sums [C, split_k, N, D] float32."""
    n0, d = x.shape
    f = w1.shape[-1]
    check_tiles(d, f, tiles)
    n = max(16, -(-n0 // 16) * 16)  # Triton dots need >= 16 rows
    xp = jnp.zeros((n, d), x.dtype).at[:n0].set(x)
    c = slots.shape[0]
    params = _compiler_params(tiles)
    h = pl.pallas_call(
        functools.partial(_gate_up_kernel, tiles=tiles),
        grid=(c, f // tiles.bf),
        out_shape=jax.ShapeDtypeStruct((c, n, f), x.dtype),
        out_specs=pl.BlockSpec((1, n, tiles.bf), lambda ci, j: (ci, 0, j)),
        compiler_params=params,
        interpret=interpret,
    )(slots, xp, w1, w3)
    partial = pl.pallas_call(
        functools.partial(_down_kernel, tiles=tiles),
        grid=(c, tiles.split_k, d // tiles.bd),
        out_shape=jax.ShapeDtypeStruct((c, tiles.split_k, n, d), jnp.float32),
        out_specs=pl.BlockSpec((1, 1, n, tiles.bd), lambda ci, s, j: (ci, s, 0, j)),
        compiler_params=params,
        interpret=interpret,
    )(slots, h, w2)
    return partial[:, :, :n0]


def grouped_swiglu_xla(x, slots, w1, w3, w2):
    """Same contract (with split_k = 1) via a gather of the active slots and einsums (any N)."""
    w1, w3, w2 = w1[slots], w3[slots], w2[slots]
    gate = jnp.einsum("nd,cdf->cnf", x, w1)
    up = jnp.einsum("nd,cdf->cnf", x, w3)
    return einsum_f32("cnf,cfd->cnd", jax.nn.silu(gate) * up, w2)[:, None]


TILES = Tiles()  # tuned on the H200 for Mixtral-8x7B experts: benchmarks/README.md


def tiles_for(d: int, f: int, base: Tiles = TILES) -> Tiles | None:
    """`base` with the largest split_k <= base.split_k that divides the K steps, or None."""
    for split in range(base.split_k, 0, -1):
        tiles = dataclasses.replace(base, split_k=split)
        try:
            check_tiles(d, f, tiles)
        except ValueError:
            continue
        return tiles
    return None


def use_pallas(n: int, d: int, f: int) -> bool:
    """The one place that picks the expert path: Pallas on GPU for decode-sized batches."""
    return jax.default_backend() == "gpu" and n <= PALLAS_MAX_ROWS and tiles_for(d, f) is not None


def grouped_swiglu(x, slots, w1, w3, w2):
    """Partial sums [C, S, N, D] float32 for the active slots (sum over S gives each slot's
    output), by the path `use_pallas` picks."""
    d, f = x.shape[1], w1.shape[-1]
    if use_pallas(x.shape[0], d, f):
        return grouped_swiglu_pallas(x, slots, w1, w3, w2, tiles=tiles_for(d, f))
    return grouped_swiglu_xla(x, slots, w1, w3, w2)
