"""int8 dense matrices at decode row counts: a Pallas Triton kernel, XLA otherwise.

An int8 matrix w [K, N] with a per-output-channel scale [N] is applied as `model.linear` does,
y = (x @ w.astype(x.dtype)) * scale.astype(x.dtype). XLA compiles that as a convert of the whole
matrix to x's dtype (fused into the GEMM's operand or written out as a bf16 copy) and a GEMM
whose library kernels are tuned for more rows than a decode step has: at 1-16 rows it runs
slower than the bf16 GEMV it was meant to halve the bytes of (2.4x slower on an H100 at one
row). The kernel here reads the int8 bytes once, in [bk, bn] blocks, converts each block to x's
dtype in registers and multiplies it with `jnp.dot` into a float32 accumulator; `split_k`
programs per output block each reduce a contiguous K range, and their partial sums are added
after the kernel by `layers.ordered_sum` in index order (a fixed order, no atomics). The sum is
then rounded to x's dtype and multiplied by the scale in x's dtype: the XLA formula's rounding
sequence, so the two differ only by the order of the float32 sum.

Rows are independent in a dot, and padded rows are zeros: a row's result does not depend on the
other rows' values. The compiled program depends on the padded row count (16 or 32).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from strata_jax.ops.expert_kernels import triton_params
from strata_jax.ops.layers import ordered_sum

MAX_ROWS = 32  # decode shapes; more rows take the XLA path
ROW_TILE = 16  # fewest rows a Triton dot takes
MIN_BLOCK = 16  # smallest dot dimension Triton takes
TARGET_PROGRAMS = 264  # two waves of an H100's 132 SMs
KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


@dataclass(frozen=True, kw_only=True)
class Int8Tiles:
    """Triton tile sizes and launch settings of `int8_matmul`, the dense int8 matmul: one
    [bk, bn] block per step of one output block, unlike `expert_kernels.FloatTiles` (the
    grouped SwiGLU's gate/up and down blocks over pool slots) and `int4_kernel.Int4Tiles`
    (the Mosaic int4 expert kernel's), hence a type of its own."""

    bk: int = 256
    """Rows of w (reduction steps' length) per loop step; a power of two >= 16."""
    bn: int = 64
    """Output columns per program; a power of two >= 16."""
    split_k: int = 4
    """Programs per output block, each reducing an equal contiguous range of K."""
    num_warps: int = 4
    """Warps per program."""
    num_stages: int = 3
    """Software pipeline depth of the K loop (loads in flight)."""


INT8_TILES = Int8Tiles()  # bk, bn and the launch settings `int8_tiles_for` starts from


def _is_block(size: int) -> bool:
    return size >= MIN_BLOCK and size & (size - 1) == 0


def _misfit(k: int, n: int, tiles: Int8Tiles) -> str | None:
    """Why `tiles` cannot run w [K, N], or None if they can."""
    if not (_is_block(tiles.bk) and _is_block(tiles.bn)):
        return f"bk={tiles.bk} and bn={tiles.bn} must be powers of two >= {MIN_BLOCK}"
    if tiles.split_k < 1 or tiles.num_warps < 1 or tiles.num_stages < 1:
        return f"split_k, num_warps and num_stages must be >= 1: {tiles}"
    if n % tiles.bn:
        return f"N={n} is not a multiple of bn={tiles.bn}"
    if k % (tiles.bk * tiles.split_k):
        return f"K={k} is not a multiple of bk * split_k = {tiles.bk} * {tiles.split_k}"
    return None


def int8_fits(k: int, n: int, tiles: Int8Tiles) -> bool:
    """Whether `tiles` divide w [K, N]: whole bn blocks of N, and whole bk steps of K in
    `split_k` equal ranges."""
    return _misfit(k, n, tiles) is None


def _halvings(size: int) -> list[int]:
    return [size >> i for i in range(size.bit_length()) if size >> i >= MIN_BLOCK]


def _split_for(blocks: int, steps: int) -> int:
    """The fewest splits of `steps` (a divisor) that launch TARGET_PROGRAMS programs over
    `blocks` output blocks, else the most (every program one step)."""
    divisors = [s for s in range(1, steps + 1) if steps % s == 0]
    return next((s for s in divisors if blocks * s >= TARGET_PROGRAMS), divisors[-1])


def int8_tiles_for(k: int, n: int, base: Int8Tiles | None = None) -> Int8Tiles | None:
    """`base` (default INT8_TILES) with split_k picked by `_split_for`, and with bn, then bk,
    halved where w [K, N] does not divide into them; None if no block of 16 or more does."""
    base = base or INT8_TILES
    for bn in _halvings(base.bn):
        for bk in _halvings(base.bk):
            if n % bn or k % bk:
                continue
            split = _split_for(n // bn, k // bk)
            return dataclasses.replace(base, bk=bk, bn=bn, split_k=split)
    return None


def use_int8_kernel(m: int, k: int, n: int) -> bool:
    """The one place that picks the int8 dense path: the kernel on a GPU for decode-sized row
    counts of shapes that tile, XLA otherwise. `STRATA_INT8_KERNEL=0` in the environment
    (read when a program is traced) keeps XLA's path everywhere, for A/B measurements."""
    if os.environ.get("STRATA_INT8_KERNEL", "1") == "0":
        return False
    return jax.default_backend() == "gpu" and 0 < m <= MAX_ROWS and int8_tiles_for(k, n) is not None


def _kernel(x_ref, w_ref, o_ref, *, tiles: Int8Tiles, steps: int):
    s, j = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(pl.multiple_of(j * tiles.bn, tiles.bn), tiles.bn)

    def body(i, acc):
        rows = pl.ds(pl.multiple_of((s * steps + i) * tiles.bk, tiles.bk), tiles.bk)
        x = x_ref[:, rows]
        w = w_ref[rows, cols].astype(x.dtype)  # int8 read from memory, converted in registers
        return acc + jnp.dot(x, w, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros(o_ref.shape[1:], jnp.float32))
    o_ref[...] = acc[None]


def _check_operands(x: jax.Array, w: jax.Array, scale: jax.Array, tiles: Int8Tiles) -> None:
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0] or scale.shape != w.shape[1:]:
        raise ValueError(f"need x [M, K], w [K, N], scale [N]: {x.shape}, {w.shape}, "
                         f"{scale.shape}")
    if w.dtype != jnp.int8 or x.dtype not in KERNEL_DTYPES:
        raise ValueError(f"need int8 w and bf16/f32 x, got {w.dtype}, {x.dtype}")
    if not 0 < x.shape[0] <= MAX_ROWS:
        raise ValueError(f"the kernel takes 1..{MAX_ROWS} rows, got {x.shape[0]}")
    reason = _misfit(*w.shape, tiles)
    if reason:
        raise ValueError(reason)


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
def int8_matmul(x: jax.Array, w: jax.Array, scale: jax.Array, *,
                tiles: Int8Tiles | None = None, interpret: bool = False) -> jax.Array:
    """x [M, K] (bf16 or f32, M <= MAX_ROWS) @ w int8 [K, N], times scale [N]: [M, N] in x's
    dtype, rounded as `(x @ w.astype(x.dtype)) * scale.astype(x.dtype)` rounds. `tiles`:
    default `int8_tiles_for(K, N)`."""
    tiles = tiles or int8_tiles_for(*w.shape) or INT8_TILES
    _check_operands(x, w, scale, tiles)
    (m, k), n = x.shape, w.shape[1]
    rows = -(-m // ROW_TILE) * ROW_TILE
    xp = jnp.pad(x, ((0, rows - m), (0, 0)))
    partial = pl.pallas_call(
        functools.partial(_kernel, tiles=tiles, steps=k // tiles.bk // tiles.split_k),
        grid=(tiles.split_k, n // tiles.bn),
        out_shape=jax.ShapeDtypeStruct((tiles.split_k, rows, n), jnp.float32),
        out_specs=pl.BlockSpec((1, rows, tiles.bn), lambda s, j: (s, 0, j)),
        compiler_params=triton_params(tiles),
        interpret=interpret,
    )(xp, w)
    y = ordered_sum(partial[:, :m], 0)
    return y.astype(x.dtype) * scale.astype(x.dtype)


def int8_linear(x: jax.Array, w: jax.Array, scale: jax.Array) -> jax.Array:
    """x [..., K] @ w int8 [K, N] * scale [N] -> [..., N] in x's dtype: the kernel where
    `use_int8_kernel` picks it for the flattened rows, else `model.linear`'s XLA formula."""
    k, n = w.shape
    m = math.prod(x.shape[:-1])
    if (use_int8_kernel(m, k, n) and x.dtype in KERNEL_DTYPES and w.dtype == jnp.int8
            and scale.shape == (n,)):
        return int8_matmul(x.reshape(m, k), w, scale).reshape(*x.shape[:-1], n)
    return (x @ w.astype(x.dtype)) * scale.astype(x.dtype)
