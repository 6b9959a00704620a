"""Expert kernels against a float64 numpy reference on fresh random inputs."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from strata_jax import expert_kernels as ek
from strata_jax.moe import Routing, active_experts, apply_experts
from strata_jax.pool import ExpertPool


def _reference(x, slots, w1, w3, w2):
    out = []
    for s in slots:
        g = x.astype(np.float64) @ w1[s].astype(np.float64)
        u = x.astype(np.float64) @ w3[s].astype(np.float64)
        out.append(((g / (1.0 + np.exp(-g))) * u) @ w2[s].astype(np.float64))
    return np.stack(out)


def _inputs(seed, n, slots=7, d=256, f=256):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32)
    w1, w3 = (rng.normal(size=(slots, d, f)).astype(np.float32) / 16 for _ in range(2))
    w2 = rng.normal(size=(slots, f, d)).astype(np.float32) / 16
    return x, w1, w3, w2


@pytest.mark.parametrize("tiles", [ek.Tiles(bd=32, split_k=1), ek.Tiles(bd=64, split_k=2)])
@pytest.mark.parametrize("n", [1, 5, 16])
def test_pallas_kernel_matches_float64(tiles, n):
    x, w1, w3, w2 = _inputs(n, n)
    slots = np.array([6, 0, 3], np.int32)
    y = ek.grouped_swiglu_pallas(x, slots, ExpertPool(w1, w3, w2), tiles=tiles, interpret=True)
    y = y.sum(1)
    ref = _reference(x, slots, w1, w3, w2)
    assert np.abs(np.asarray(y) - ref).max() / np.abs(ref).max() < 1e-5


@pytest.mark.parametrize("quantized", [False, True])
def test_pallas_kernel_with_rows_per_entry_matches_float64(quantized):
    """x [C, R, D]: entry c multiplies its own rows (the expert-grouped row chunks)."""
    pool, (d1, d3, d2) = _pool(12, quantized)
    x = np.random.default_rng(13).normal(size=(3, 5, 256)).astype(np.float32)
    slots = np.array([4, 0, 4], np.int32)
    y = ek.grouped_swiglu_pallas(x, slots, pool, tiles=ek.Tiles(bd=64, split_k=2),
                                 interpret=True).sum(1)
    y_xla = ek.grouped_swiglu_xla(x, slots, pool).sum(1)
    for c, s in enumerate(slots):
        ref = _reference(x[c], [s], d1, d3, d2)[0]
        for got in (y[c], y_xla[c]):
            assert np.abs(np.asarray(got) - ref).max() / np.abs(ref).max() < 1e-5


def test_pallas_kernel_casts_bf16_weights_to_float32_activations_like_xla():
    """A bf16 pool (host-dequantized experts) under float32 activations: the Triton dot needs
    one element type, and both paths compute in the activations' dtype."""
    x, w1, w3, w2 = _inputs(3, 4)
    pool = ExpertPool(*(jnp.asarray(w, jnp.bfloat16) for w in (w1, w3, w2)))
    slots = np.array([1, 5], np.int32)
    y = ek.grouped_swiglu_pallas(x, slots, pool, tiles=ek.Tiles(bd=64, split_k=1),
                                 interpret=True).sum(1)
    ref = _reference(x, slots, *(np.asarray(w.astype(jnp.float32)) for w in pool[:3]))
    assert np.abs(np.asarray(y) - ref).max() / np.abs(ref).max() < 1e-5


def test_xla_path_matches_float64():
    x, w1, w3, w2 = _inputs(11, 40)
    slots = np.array([2, 5], np.int32)
    y = ek.grouped_swiglu_xla(x, slots, ExpertPool(w1, w3, w2)).sum(1)
    ref = _reference(x, slots, w1, w3, w2)
    assert np.abs(np.asarray(y) - ref).max() / np.abs(ref).max() < 1e-5


def _int4_pool(seed, slots=6, d=256, f=256):
    """A packed int4 pool plus its exact float64 dequantization (independent of the model)."""
    rng = np.random.default_rng(seed)

    def one(k, n):
        q = rng.integers(-8, 8, (slots, k, n))
        scales = rng.uniform(0.005, 0.02, (slots, k // 128, n)).astype(ml_dtypes.bfloat16)
        g = q.reshape(slots, k // 128, 2, 64, n)
        packed = ((g[:, :, 0] + 8) | ((g[:, :, 1] + 8) << 4)).astype(np.uint8)
        dense = q * np.repeat(scales.astype(np.float64), 128, axis=1)
        return packed.reshape(slots, k // 2, n), scales, dense

    (p1, s1, d1), (p3, s3, d3), (p2, s2, d2) = one(d, f), one(d, f), one(f, d)
    return ExpertPool(p1, p3, p2, s1, s3, s2), (d1, d3, d2)


def _pool(seed, quantized: bool):
    """A 6-slot pool (256 x 256 experts), int4 or float32, and its float64 weights."""
    if quantized:
        return _int4_pool(seed)
    _, w1, w3, w2 = _inputs(seed, 1, slots=6)
    return ExpertPool(w1, w3, w2), (w1, w3, w2)


@pytest.mark.parametrize(("fold", "magic"), [(True, False), (False, False), (False, True)])
@pytest.mark.parametrize("n", [1, 7])
def test_int4_pallas_kernel_matches_float64(n, fold, magic):
    pool, (d1, d3, d2) = _int4_pool(n)
    x = np.random.default_rng(n + 100).normal(size=(n, 256)).astype(np.float32)
    slots = np.array([5, 1], np.int32)
    ref = _reference(x, slots, d1, d3, d2)
    tiles = ek.Tiles(bd=64, split_k=2, fold_offset=fold, magic=magic)
    y = ek.grouped_swiglu_pallas(x, slots, pool, tiles=tiles, interpret=True).sum(1)
    assert np.abs(np.asarray(y) - ref).max() / np.abs(ref).max() < 1e-5
    y_xla = ek.grouped_swiglu_xla(x, slots, pool).sum(1)
    assert np.abs(np.asarray(y_xla) - ref).max() / np.abs(ref).max() < 1e-5


@pytest.mark.parametrize(("fold", "magic", "unroll", "transpose"),
                         [(True, True, 1, False), (False, True, 1, False),
                          (True, False, 1, False), (False, True, 2, False),
                          (False, True, 1, True), (True, True, 2, True)])
def test_int4_pallas_kernel_bf16_matches_float64(fold, magic, unroll, transpose):
    """bf16 activations: magic planes with the 128 + 8 offset folded into a row sum."""
    pool, (d1, d3, d2) = _int4_pool(5)
    x = np.random.default_rng(9).normal(size=(5, 256)).astype(ml_dtypes.bfloat16)
    slots = np.array([2, 4], np.int32)
    ref = _reference(x.astype(np.float32), slots, d1, d3, d2)
    tiles = ek.Tiles(bd=64, split_k=1, fold_offset=fold, magic=magic, unroll=unroll,
                     transpose=transpose)
    y = ek.grouped_swiglu_pallas(x, slots, pool, tiles=tiles, interpret=True).sum(1)
    # the bf16 intermediate h dominates the error
    assert np.abs(np.asarray(y) - ref).max() / np.abs(ref).max() < 2e-2


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="Pallas Triton lowering needs a GPU")
def test_int4_pallas_kernel_on_gpu_matches_float64():
    pool, (d1, d3, d2) = _int4_pool(3, d=512, f=1024)
    x = np.random.default_rng(7).normal(size=(4, 512)).astype(ml_dtypes.bfloat16)
    slots = np.array([0, 4, 2], np.int32)
    ref = _reference(x.astype(np.float32), slots, d1, d3, d2)
    base = ek.tiles_for(512, 1024, quantized=True)
    variants = [dict(fold_offset=fold, magic=magic, unroll=unroll, asm=asm, transpose=t)
                for fold, magic, unroll, asm, t in (
                    (True, False, 1, False, False), (False, True, 1, False, False),
                    (True, True, 1, False, False), (False, True, 2, False, False),
                    (False, True, 1, True, False), (True, True, 1, True, False),
                    (False, True, 1, True, True), (False, True, 1, False, True))]
    for v in variants:
        y = ek.grouped_swiglu_pallas(x, slots, pool, tiles=dataclasses.replace(base, **v))
        # bf16 activations and a bf16 intermediate h: bf16-level error
        err = np.abs(np.asarray(y.sum(1)) - ref).max() / np.abs(ref).max()
        assert err < 2e-2, (v, err)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="inline PTX needs a GPU")
@pytest.mark.parametrize("offset", [True, False])
def test_ptx_nibbles_match_magic_nibbles_for_every_byte(offset):
    from jax.experimental import pallas as pl

    packed = jnp.asarray(np.arange(64 * 128).reshape(64, 128) * 7 % 256, jnp.uint8)

    def kernel(p_ref, lo_ref, hi_ref):
        lo_ref[...], hi_ref[...] = ek._asm_nibbles(p_ref[...], offset)

    plane = jax.ShapeDtypeStruct(packed.shape, jnp.bfloat16)
    lo, hi = pl.pallas_call(kernel, out_shape=(plane, plane))(packed)
    want = [ek._magic_nibbles(q, jnp.bfloat16, offset) for q in (packed & 0xF, packed >> 4)]
    np.testing.assert_array_equal(np.asarray(lo, np.float32), np.asarray(want[0], np.float32))
    np.testing.assert_array_equal(np.asarray(hi, np.float32), np.asarray(want[1], np.float32))


@pytest.mark.parametrize("quantized", [False, True])
def test_invalid_entries_give_zeros_and_leave_the_others_alone(quantized):
    pool, (d1, d3, d2) = _pool(8, quantized)
    x = np.random.default_rng(4).normal(size=(3, 256)).astype(np.float32)
    slots = np.array([3, 0, 5], np.int32)
    valid = np.array([True, False, True])
    ref = _reference(x, slots, d1, d3, d2)
    for y in (ek.grouped_swiglu_pallas(x, slots, pool, tiles=ek.Tiles(bd=64, split_k=2),
                                       interpret=True, valid=valid),
              ek.grouped_swiglu_xla(x, slots, pool, valid)):
        y = np.asarray(y.sum(1))
        assert np.all(y[1] == 0.0)
        np.testing.assert_allclose(y[valid], ref[valid], rtol=0, atol=1e-5 * np.abs(ref).max())


def test_tiles_that_do_not_divide_are_rejected():
    with pytest.raises(ValueError, match="not multiples"):
        ek.check_tiles(200, 256, ek.Tiles())
    with pytest.raises(ValueError, match="do not split"):
        ek.check_tiles(384, 256, ek.Tiles(split_k=1, unroll=2))
    with pytest.raises(ValueError, match="group size"):
        ek.check_tiles(256, 256, ek.Tiles(bk=64, split_k=1), quantized=True)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="Pallas Triton lowering needs a GPU")
def test_pallas_kernel_on_gpu_matches_float64():
    x, w1, w3, w2 = _inputs(21, 8, d=512, f=1024)
    slots = np.array([1, 4, 6], np.int32)
    pool = ExpertPool(w1, w3, w2)
    y = ek.grouped_swiglu_pallas(x, slots, pool, tiles=ek.tiles_for(512, 1024)).sum(1)
    ref = _reference(x, slots, w1, w3, w2)
    # float32 inputs run the dots on tensor cores in tf32
    assert np.abs(np.asarray(y) - ref).max() / np.abs(ref).max() < 3e-3


def test_apply_experts_weights_each_token_by_its_routing():
    rng = np.random.default_rng(5)
    x, w1, w3, w2 = _inputs(6, 4, slots=6, d=128, f=128)
    experts = np.array([[0, 2], [2, 5], [5, 0], [1, 2]], np.int32)
    weights = rng.uniform(0.1, 1.0, experts.shape).astype(np.float32)
    slot_of_expert = np.array([3, 0, 1, 5, 4, 2], np.int32)
    routing = Routing(experts, weights, np.zeros((4, 6), np.float32))
    y = np.asarray(apply_experts(x, routing, ExpertPool(w1, w3, w2), slot_of_expert))
    for n in range(4):
        ref = sum(weights[n, j] * _reference(x[n : n + 1], [slot_of_expert[e]], w1, w3, w2)[0, 0]
                  for j, e in enumerate(experts[n]))
        np.testing.assert_allclose(y[n], ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())


def test_active_experts_lists_distinct_ids_first():
    ids, valid = active_experts(np.array([[4, 1], [1, 4]]), num_experts=6, capacity=4)
    assert np.asarray(ids)[:2].tolist() == [1, 4]
    assert np.asarray(valid).tolist() == [True, True, False, False]


def test_tiles_for_shrinks_split_k_to_fit():
    # 48 K blocks: 4 splits would leave loops of 12 < MIN_SPLIT_STEPS; 3 splits give 16
    assert ek.tiles_for(2048, 6144, ek.Tiles(split_k=4)).split_k == 3
    assert ek.tiles_for(2048, 768, ek.Tiles(split_k=4)).split_k == 1
    assert ek.tiles_for(4096, 14336, ek.Tiles(split_k=4)).split_k == 4
    assert ek.tiles_for(100, 768) is None


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_magic_nibbles_are_exact(dtype):
    nibbles = jnp.arange(16, dtype=jnp.uint8)
    got = np.asarray(ek._magic_nibbles(nibbles, dtype).astype(jnp.float32))
    np.testing.assert_array_equal(got, np.arange(16) - 8.0)
