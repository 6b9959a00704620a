"""The MLA decode kernel against a float64 numpy reference and against `attend_mla`'s XLA math
on fresh random inputs (Pallas interpret mode off the GPU, the Triton lowering on it): rows of
length 1, of a length inside a block, and of the full cache; its tiling and its dispatch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.model.decoder import attend_mla, mla_scale
from strata_jax.ops import mla_kernel as mk
from strata_jax.ops.layers import einsum_f32
from tests.helpers import tiny_config

INTERPRET = jax.default_backend() != "gpu"
B, H, R, DR, S = 3, 16, 64, 16, 96  # S = 3 blocks of 32
LENGTHS = (1, 45, 96)  # one position; inside the second block; the whole cache
SMALL = dict(block_s=32, splits=2)
# Error bounds as fractions of max |latent| (the output is a convex mix of latent rows). bf16:
# the kernel rounds each unnormalized probability to bf16 (relative 2**-9) but divides by the
# float32 sum of the unrounded ones, so the mix is off by at most 2 * 2**-9 of max |latent|;
# float32: the float32 sums' rounding only.
TOL = {jnp.bfloat16: 2.0**-8, jnp.float32: 1e-5}


def _inputs(seed: int, dtype=jnp.bfloat16, b: int = B, h: int = H, s: int = S):
    """Normal q_lat [b,h,R], q_rope [b,h,DR], latent [b,s,R], k_rope [b,s,DR]."""
    rng = np.random.default_rng(seed)
    shapes = ((b, h, R), (b, h, DR), (b, s, R), (b, s, DR))
    return tuple(jnp.asarray(rng.normal(size=shape), dtype) for shape in shapes)


def _reference(q_lat, q_rope, latent, k_rope, lengths, scale: float) -> np.ndarray:
    """The formula in float64, one row at a time over its valid positions only."""
    ql, qr, lat, kr = (np.asarray(a, np.float64) for a in (q_lat, q_rope, latent, k_rope))
    out = np.zeros(ql.shape)
    for row, n in enumerate(np.asarray(lengths)):
        scores = scale * (ql[row] @ lat[row, :n].T + qr[row] @ kr[row, :n].T)
        p = np.exp(scores - scores.max(axis=-1, keepdims=True))
        out[row] = (p / p.sum(axis=-1, keepdims=True)) @ lat[row, :n]
    return out


def _assert_close(got, want, latent, dtype) -> float:
    """err <= TOL of max |latent|; returns err / max |want| (what the report quotes)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = np.abs(got - want).max()
    bound = TOL[dtype] * np.abs(np.asarray(latent, np.float64)).max()
    assert err <= bound, f"max error {err:.3g} over the bound {bound:.3g}"
    return err / np.abs(want).max()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("sharpness", [1.0, 30.0])  # 30: scores of +-100, exp overflows raw
def test_kernel_matches_float64(dtype, sharpness):
    args = _inputs(0, dtype)
    lengths = jnp.array(LENGTHS, jnp.int32)
    scale = sharpness / np.sqrt(R + DR)
    got = mk.mla_decode(*args, lengths, scale, **SMALL, interpret=INTERPRET)
    assert got.shape == (B, H, R) and got.dtype == jnp.float32
    _assert_close(got, _reference(*args, lengths, scale), args[2], dtype)


@pytest.mark.parametrize("tiles", [dict(block_s=16, splits=1), dict(block_s=32, splits=1),
                                   dict(block_s=16, splits=4), dict(block_s=32, splits=8),
                                   dict(block_h=16, block_s=32, splits=2), {}])  # {}: picked
def test_tiles_match_float64(tiles):
    """Two head blocks (H=32), 1..8 splits: with 8 splits most get no blocks of a short row."""
    args = _inputs(1, h=32)
    lengths = jnp.array((17, 96, 64), jnp.int32)
    got = mk.mla_decode(*args, lengths, 0.1, **tiles, interpret=INTERPRET)
    _assert_close(got, _reference(*args, lengths, 0.1), args[2], jnp.bfloat16)


def test_positions_past_the_length_are_not_attended():
    """Rows at and past each length replaced by large values: the same bits (their
    probabilities are exactly zero, and blocks past the length are not read). A row of
    length 0 gives zeros."""
    q_lat, q_rope, latent, k_rope = _inputs(2)
    lengths = jnp.array((0, 45, 70), jnp.int32)
    junk = jnp.arange(S)[None, :, None] >= lengths[:, None, None]
    call = lambda lat, kr: mk.mla_decode(q_lat, q_rope, lat, kr, lengths, 0.1,  # noqa: E731
                                         **SMALL, interpret=INTERPRET)
    clean = call(latent, k_rope)
    dirty = call(jnp.where(junk, 1e4, latent).astype(latent.dtype),
                 jnp.where(junk, -1e4, k_rope).astype(k_rope.dtype))
    np.testing.assert_array_equal(np.asarray(clean), np.asarray(dirty))
    assert not np.any(np.asarray(clean[0]))


def test_kernel_matches_the_xla_formula():
    """`mla_decode_xla` rounds the normalized probabilities to bf16, the kernel the
    unnormalized ones: at most the bf16 bound apart (reported: err / max |out|)."""
    args = _inputs(3)
    lengths = jnp.array(LENGTHS, jnp.int32)
    got = mk.mla_decode(*args, lengths, 0.1, **SMALL, interpret=INTERPRET)
    want = mk.mla_decode_xla(*args, lengths, 0.1)
    rel = _assert_close(got, want, args[2], jnp.bfloat16)
    assert rel < 1e-2


@pytest.mark.parametrize("dtype, rtol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_kernel_in_attend_mla(dtype, rtol):
    """`attend_mla` at T=1 (W_uk absorbed into q, W_uv applied to the mix) with its attention
    core replaced by the kernel: the same [B, 1, H * v_head_dim] within `rtol` of its max (bf16:
    attend_mla rounds the mix and the output to bf16, the kernel keeps the mix in float32)."""
    cfg = tiny_config("deepseek_v3", num_heads=H, head_dim=32, kv_lora_rank=R,
                      qk_rope_head_dim=DR, v_head_dim=16)
    dn, dv = cfg.qk_nope_head_dim, cfg.v_head_dim
    rng = np.random.default_rng(4)
    wkv_b = jnp.asarray(rng.normal(0, 0.2, (R, H * (dn + dv))), dtype)
    q_nope = jnp.asarray(rng.normal(size=(B, 1, H, dn)), dtype)
    _, q_rope, latent, k_rope = _inputs(5, dtype)
    positions = jnp.array(LENGTHS, jnp.int32) - 1
    mask = (jnp.arange(S)[None, :] <= positions[:, None])[:, None]  # [B, T=1, S]
    want = attend_mla(cfg, {"wkv_b": wkv_b}, (q_nope, q_rope[:, None]), latent[:, :, None],
                      k_rope[:, :, None], mask)
    w = wkv_b.reshape(R, H, dn + dv)
    q_lat = einsum_f32("bhn,rhn->bhr", q_nope[:, 0], w[..., :dn]).astype(dtype)
    mixed = mk.mla_decode(q_lat, q_rope, latent, k_rope, positions + 1, mla_scale(cfg),
                          **SMALL, interpret=INTERPRET)
    got = einsum_f32("bhr,rhv->bhv", mixed.astype(dtype), w[..., dn:]).reshape(want.shape)
    want64, got64 = np.asarray(want, np.float64), np.asarray(got, np.float64)
    assert np.abs(got64 - want64).max() <= rtol * np.abs(want64).max()


def test_tile_picking_and_dispatch():
    deepseek = mk.mla_tiles_for(1, 128, 512, 64, 32768)
    assert (deepseek.block_h, deepseek.block_s, deepseek.num_warps) == (64, 32, 8)
    assert deepseek.splits == 64  # 2 head blocks x 64 splits: about one wave of 132 SMs
    small = mk.mla_tiles_for(B, H, R, DR, S)
    assert small.block_h == 16 and S % small.block_s == 0
    assert mk.mla_tiles_for(1, 128, 576, 64, 4096) is None  # r not a power of two
    assert mk.mla_tiles_for(1, 8, 512, 64, 4096) is None  # fewer heads than a dot's 16 rows
    assert mk.mla_tiles_for(1, 128, 512, 64, 40) is None  # S not a multiple of 16
    # at S=4096 a split's partial (8*H*r bytes) is 1/9 of a row's cache: at most 8 splits
    assert mk.mla_splits_for(1, 128, 512, 64, 4096, 64, 32) == 8
    assert mk.use_mla_kernel(1, 128, 512, 64, 4096, jnp.bfloat16) == (not INTERPRET)
    with pytest.raises(ValueError, match="multiple"):
        mk.mla_decode(*_inputs(6), jnp.ones((B,), jnp.int32), 0.1, block_s=64,
                      interpret=INTERPRET)


@pytest.mark.parametrize("tiles", [{}, dict(block_h=16, block_s=64, splits=4, num_warps=4)])
def test_lowers_to_triton_at_deepseek_dims(tiles):
    """The kernel lowers to a Triton call at H=128, r=512, dr=64 (bf16) from any backend:
    Pallas' Triton rules (power-of-two blocks, 2-D dots, a fori loop with a bound loaded
    from memory) hold without a GPU; Triton's own compile to PTX happens on one only."""
    b, s = 2, 4096
    shapes = ((b, 128, 512), (b, 128, 64), (b, s, 512), (b, s, 64))
    args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in shapes]
    args.append(jax.ShapeDtypeStruct((b,), jnp.int32))
    decode = jax.jit(lambda *a: mk.mla_decode(*a, 0.07, **tiles))
    text = decode.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "xla.gpu.triton" in text
