"""Grouped SwiGLU over pool slots: Pallas kernels for decode, an XLA path otherwise.

All compute, for each active slot c, y[c] = (silu(x @ w1[s_c]) * (x @ w3[s_c])) @ w2[s_c],
reading each slot's weights straight out of the pool (no gathered copy of the experts): a
Triton kernel for float pools, the Mosaic GPU kernel of `int4_kernel` for packed int4 pools on
Hopper, and XLA (dequantize + einsum) everywhere else, on the CPU in particular. Experts with
biases or another gate (GPT-OSS: `Glu`) take the XLA path on every backend: the kernels know
neither yet.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from strata_jax.formats.config import ModelConfig
from strata_jax.ops import int4_kernel
from strata_jax.ops.layers import einsum_f32
from strata_jax.ops.pool import ExpertPool


@dataclass(frozen=True, kw_only=True)
class Glu:
    """The gate between an expert's up and down projections (static under jit)."""

    limit: float | None = None
    """None: SwiGLU, silu(gate) * up. A limit: GPT-OSS's clamped form, gate clamped above at
    the limit and up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""
    alpha: float = 1.702
    """The sigmoid's gain in the clamped form."""

    @classmethod
    def of(cls, cfg: ModelConfig) -> Glu:
        """The gate of `cfg`'s experts (`ModelConfig.swiglu_limit`)."""
        if cfg.swiglu_limit is None:
            return SWIGLU
        return cls(limit=float(cfg.swiglu_limit), alpha=float(cfg.swiglu_alpha))

    def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        if self.limit is None:
            return jax.nn.silu(gate) * up
        gate = jnp.minimum(gate, self.limit)
        up = jnp.clip(up, -self.limit, self.limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * self.alpha))


SWIGLU = Glu()
"""silu(gate) * up: every family's but GPT-OSS's."""


def plain(pool: ExpertPool, glu: Glu) -> bool:
    """Whether the kernels take these experts: no biases, the plain SwiGLU gate."""
    return not pool.biased and glu == SWIGLU


PALLAS_MAX_ROWS = 32  # decode shapes; larger row counts take the XLA path
ROW_TILE = 16  # fewest rows a Triton dot takes; above it, experts get their own rows


@dataclass(frozen=True)
class FloatTiles:
    """Tiles of the Triton grouped-SwiGLU kernel for float pools (`grouped_swiglu_pallas`):
    reduction block, gate/up output block, down output block, K splits, launch settings.

    Not `int4_kernel.Int4Tiles` (the Mosaic GPU kernel for int4 pools: CTA rows, TMA stages,
    scale groups, persistence, warp specialization) nor `int8_kernel.Int8Tiles` (the Triton
    int8 dense matmul: one output block, no gate/up/down pair): each kernel takes its own
    parameters under its own divisibility rules, so each owns its tiles type and picker
    (`float_tiles_for`, `int4_tiles_for`, `int8_tiles_for`)."""

    bk: int = 128
    bf: int = 64
    bd: int = 64
    split_k: int = 4
    num_warps: int = 4
    num_stages: int = 4
    unroll: int = 1  # reduction blocks per loop iteration (more loads in flight per step)


def triton_params(tiles):
    """Triton's launch settings of `tiles` (its num_warps and num_stages), or None where the
    Triton lowering is not installed."""
    try:
        from jax.experimental.pallas import triton as pltriton

        return pltriton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    except (ImportError, AttributeError):  # CPU-only installs lack the Triton lowering
        return None


def _block_dot(x, w_ref, slot, k, cols, tiles: FloatTiles):
    """x[:, K block k] @ W[slot][K block k, cols] in float32, with the weights in x's dtype (as
    the XLA path computes them)."""
    w = w_ref[slot, pl.ds(k * tiles.bk, tiles.bk), cols].astype(x.dtype)
    return jnp.dot(x, w, preferred_element_type=jnp.float32)


def _reduce_blocks(steps: int, first, block, count: int, shape, tiles: FloatTiles):
    """The `count` sums of `block(k)` (a tuple) over k in [first, first + steps), with
    `tiles.unroll` blocks per iteration."""
    def body(i, accs):
        for u in range(tiles.unroll):
            parts = block(first + i * tiles.unroll + u)
            accs = tuple(a + part for a, part in zip(accs, parts, strict=True))
        return accs

    zero = jnp.zeros(shape, jnp.float32)
    return jax.lax.fori_loop(0, steps // tiles.unroll, body, (zero,) * count)


def _gate_up_kernel(slots_ref, valid_ref, x_ref, w1, w3, h_ref, *, tiles: FloatTiles):
    c, j = pl.program_id(0), pl.program_id(1)
    slot = slots_ref[c]
    xi = c if x_ref.shape[0] > 1 else 0  # rows per entry [C, n, D], or shared [1, n, D]
    n, d = x_ref.shape[1:]
    cols = pl.ds(j * tiles.bf, tiles.bf)

    def block(k):
        x = x_ref[xi, :, pl.ds(k * tiles.bk, tiles.bk)]  # loaded once for gate and up
        return (_block_dot(x, w1, slot, k, cols, tiles), _block_dot(x, w3, slot, k, cols, tiles))

    @pl.when(valid_ref[c] != 0)
    def _():
        a1, a3 = _reduce_blocks(d // tiles.bk, 0, block, 2, (n, tiles.bf), tiles)
        h_ref[...] = (jax.nn.silu(a1) * a3).astype(h_ref.dtype)[None]

    @pl.when(valid_ref[c] == 0)
    def _():
        h_ref[...] = jnp.zeros(h_ref.shape, h_ref.dtype)


def _down_kernel(slots_ref, valid_ref, h_ref, w2, y_ref, *, tiles: FloatTiles):
    c, s, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = slots_ref[c]
    n, f = h_ref.shape[1], h_ref.shape[2]
    steps = f // tiles.bk // tiles.split_k
    cols = pl.ds(j * tiles.bd, tiles.bd)

    def block(k):
        h = h_ref[c, :, pl.ds(k * tiles.bk, tiles.bk)]
        return (_block_dot(h, w2, slot, k, cols, tiles),)

    @pl.when(valid_ref[c] != 0)
    def _():
        (acc,) = _reduce_blocks(steps, s * steps, block, 1, (n, tiles.bd), tiles)
        y_ref[...] = acc[None, None]

    @pl.when(valid_ref[c] == 0)
    def _():
        y_ref[...] = jnp.zeros(y_ref.shape, y_ref.dtype)


def check_float_tiles(d: int, f: int, tiles: FloatTiles) -> None:
    """Raise ValueError unless `tiles` divide expert dims D, F for `grouped_swiglu_pallas`."""
    if d % tiles.bk or f % tiles.bk or f % tiles.bf or d % tiles.bd:
        raise ValueError(f"expert dims D={d}, F={f} are not multiples of the tiles {tiles}")
    if (f // tiles.bk) % tiles.split_k:
        raise ValueError(f"F={f} / bk={tiles.bk} is not divisible by split_k={tiles.split_k}")
    if (d // tiles.bk) % tiles.unroll or (f // tiles.bk // tiles.split_k) % tiles.unroll:
        raise ValueError(f"the reduction blocks of D={d}, F={f} do not split by {tiles}")


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
def grouped_swiglu_pallas(x, slots, pool: ExpertPool, tiles: FloatTiles = FloatTiles(),
                          interpret: bool = False, valid=None):
    """Float pools: x [N, D] (N <= PALLAS_MAX_ROWS), slots [C] -> partial sums
    [C, split_k, N, D] float32. x may also be [C, N, D]: each entry's own rows
    (`moe.chunk_picks`). Entries whose `valid` [C] is false read no weights and give zeros."""
    if pool.quantized:
        raise ValueError("the Triton kernel takes float pools; int4 pools use int4_kernel")
    x3 = x if x.ndim == 3 else x[None]
    n0, d = x3.shape[1:]
    f = pool.intermediate_size
    check_float_tiles(d, f, tiles)
    n = -(-n0 // ROW_TILE) * ROW_TILE  # Triton dots need >= 16 rows
    xp = jnp.zeros((x3.shape[0], n, d), x.dtype).at[:, :n0].set(x3)
    c = slots.shape[0]
    valid = jnp.ones((c,), jnp.int32) if valid is None else valid.astype(jnp.int32)
    params = triton_params(tiles)
    h = pl.pallas_call(
        functools.partial(_gate_up_kernel, tiles=tiles),
        grid=(c, f // tiles.bf),
        out_shape=jax.ShapeDtypeStruct((c, n, f), x.dtype),
        out_specs=pl.BlockSpec((1, n, tiles.bf), lambda ci, j: (ci, 0, j)),
        compiler_params=params,
        interpret=interpret,
    )(slots, valid, xp, pool.w1, pool.w3)
    partial = pl.pallas_call(
        functools.partial(_down_kernel, tiles=tiles),
        grid=(c, tiles.split_k, d // tiles.bd),
        out_shape=jax.ShapeDtypeStruct((c, tiles.split_k, n, d), jnp.float32),
        out_specs=pl.BlockSpec((1, 1, n, tiles.bd), lambda ci, s, j: (ci, s, 0, j)),
        compiler_params=params,
        interpret=interpret,
    )(slots, valid, h, pool.w2)
    return partial[:, :, :n0]


def grouped_swiglu_xla(x, slots, pool: ExpertPool, valid=None, glu: Glu = SWIGLU):
    """Same contract (with split_k = 1) via a gather of the active slots and einsums (any N);
    biased pools add their biases, `glu` gates."""
    w1, w3, w2 = (pool.dense_weights(kind, slots, x.dtype) for kind in ("w1", "w3", "w2"))
    rows = "cnd" if x.ndim == 3 else "nd"
    gate = jnp.einsum(f"{rows},cdf->cnf", x, w1)
    up = jnp.einsum(f"{rows},cdf->cnf", x, w3)
    biases = pool.biases(slots, x.dtype)
    if biases is not None:
        gate, up = gate + biases[0][:, None], up + biases[1][:, None]
    y = einsum_f32("cnf,cfd->cnd", glu(gate, up), w2)
    if biases is not None:
        y = y + biases[2].astype(jnp.float32)[:, None]
    y = y[:, None]
    return y if valid is None else jnp.where(valid[:, None, None, None], y, 0.0)


def swiglu_xla(x, w1, w3, w2, biases=None, glu: Glu = SWIGLU):
    """One expert's SwiGLU of rows x [R, D] [float32 out], the arithmetic of
    `grouped_swiglu_xla` for weights (and `biases` (b1, b3, b2), or None) already in x's
    dtype."""
    gate, up = x @ w1, x @ w3
    if biases is not None:
        gate, up = gate + biases[0], up + biases[1]
    y = einsum_f32("nf,fd->nd", glu(gate, up), w2)
    return y if biases is None else y + biases[2].astype(jnp.float32)


FLOAT_TILES = FloatTiles()
"""Tuned on the H200 for Mixtral-8x7B experts: benchmarks/archive/NOTES.md."""
MIN_SPLIT_STEPS = 16  # shorter split-K loops spend their time filling the load pipeline


def float_tiles_for(d: int, f: int, base: FloatTiles | None = None) -> FloatTiles | None:
    """`base` with the largest split_k <= base.split_k that divides the down projection's K
    steps into loops of at least MIN_SPLIT_STEPS (else 1), or None if nothing fits."""
    base = base or FLOAT_TILES
    for split in range(base.split_k, 0, -1):
        if split > 1 and f // base.bk // split < MIN_SPLIT_STEPS:
            continue
        tiles = dataclasses.replace(base, split_k=split)
        try:
            check_float_tiles(d, f, tiles)
        except ValueError:
            continue
        return tiles
    return None


def use_pallas(n: int, d: int, f: int, quantized: bool = False, dtype=jnp.bfloat16) -> bool:
    """The one place that picks the expert path: a Pallas kernel on the GPU for decode-sized
    batches (Mosaic GPU on Hopper with bf16 activations for int4 pools, Triton for float)."""
    if jax.default_backend() != "gpu" or n > PALLAS_MAX_ROWS:
        return False
    if quantized:
        return (int4_kernel.is_hopper() and jnp.dtype(dtype) == jnp.bfloat16
                and int4_kernel.int4_tiles_for(d, f) is not None)
    return float_tiles_for(d, f) is not None


def use_row_chunks(n: int, d: int, f: int, quantized: bool = False, dtype=jnp.bfloat16) -> bool:
    """Whether each expert should multiply only its own rows (chunks of ROW_TILE) rather than
    all n: on the Pallas path, where rows are padded anyway, once n exceeds ROW_TILE."""
    return n > ROW_TILE and use_pallas(n, d, f, quantized, dtype)


def grouped_swiglu(x, slots, pool: ExpertPool, valid=None, int4_tiles=None,
                   glu: Glu = SWIGLU):
    """Partial sums [C, S, N, D] float32 for the active slots (sum over S gives each slot's
    output; zeros where `valid` [C] is false), by the path `use_pallas` picks (XLA for
    biased experts or another `glu`). x is [N, D], or [C, N, D] with each entry's own rows.
    `int4_tiles`: the Mosaic int4 kernel's tiles (default `int4_kernel.int4_tiles_for`)."""
    d, f = x.shape[-1], pool.intermediate_size
    if not plain(pool, glu) or not use_pallas(x.shape[-2], d, f, pool.quantized, x.dtype):
        return grouped_swiglu_xla(x, slots, pool, valid, glu)
    if pool.quantized:
        return int4_kernel.grouped_swiglu_int4(x, slots, pool, valid, int4_tiles)
    return grouped_swiglu_pallas(x, slots, pool, tiles=float_tiles_for(d, f), valid=valid)
