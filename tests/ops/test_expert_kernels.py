"""Expert kernels against a float64 numpy reference on fresh random inputs."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from strata_jax.model.moe import Routing, active_experts, apply_experts
from strata_jax.ops import expert_kernels as ek
from strata_jax.ops import int4_kernel
from strata_jax.ops.pool import ExpertPool, tile_major


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


@pytest.mark.parametrize("tiles", [ek.FloatTiles(bd=32, split_k=1),
                                   ek.FloatTiles(bd=64, split_k=2)])
@pytest.mark.parametrize("n", [1, 5, 16])
def test_pallas_kernel_matches_float64(tiles, n):
    x, w1, w3, w2 = _inputs(n, n)
    slots = np.array([6, 0, 3], np.int32)
    y = ek.grouped_swiglu_pallas(x, slots, ExpertPool(w1, w3, w2), tiles=tiles, interpret=True)
    y = y.sum(1)
    ref = _reference(x, slots, w1, w3, w2)
    assert np.abs(np.asarray(y) - ref).max() / np.abs(ref).max() < 1e-5


@pytest.mark.parametrize("quantized", [False, True])
def test_rows_per_entry_match_float64(quantized):
    """x [C, R, D]: entry c multiplies its own rows (the expert-grouped row chunks)."""
    pool, (d1, d3, d2) = _pool(12, quantized)
    x = np.random.default_rng(13).normal(size=(3, 5, 256)).astype(np.float32)
    slots = np.array([4, 0, 4], np.int32)
    outs = [ek.grouped_swiglu_xla(x, slots, pool).sum(1)]
    if not quantized:  # the Triton kernel takes float pools
        outs.append(ek.grouped_swiglu_pallas(x, slots, pool, tiles=ek.FloatTiles(bd=64, split_k=2),
                                             interpret=True).sum(1))
    for c, s in enumerate(slots):
        ref = _reference(x[c], [s], d1, d3, d2)[0]
        for got in outs:
            assert np.abs(np.asarray(got[c]) - ref).max() / np.abs(ref).max() < 1e-5


def test_pallas_kernel_casts_bf16_weights_to_float32_activations_like_xla():
    """A bf16 pool (host-dequantized experts) under float32 activations: the Triton dot needs
    one element type, and both paths compute in the activations' dtype."""
    x, w1, w3, w2 = _inputs(3, 4)
    pool = ExpertPool(*(jnp.asarray(w, jnp.bfloat16) for w in (w1, w3, w2)))
    slots = np.array([1, 5], np.int32)
    y = ek.grouped_swiglu_pallas(x, slots, pool, tiles=ek.FloatTiles(bd=64, split_k=1),
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
    """A packed int4 pool plus its exact float64 dequantization (independent of the model):
    bytes [S, out, in/2], byte [o, i] = q[2i, o] | q[2i + 1, o] << 4 as two's-complement."""
    rng = np.random.default_rng(seed)

    def one(k, n):
        q = rng.integers(-8, 8, (slots, k, n))
        scales = rng.uniform(0.005, 0.02, (slots, k // 128, n)).astype(ml_dtypes.bfloat16)
        nib = np.swapaxes(q, 1, 2) & 0xF
        packed = (nib[..., 0::2] | (nib[..., 1::2] << 4)).astype(np.uint8)
        dense = q * np.repeat(scales.astype(np.float64), 128, axis=1)
        return packed, scales, dense

    (p1, s1, d1), (p3, s3, d3), (p2, s2, d2) = one(d, f), one(d, f), one(f, d)
    return ExpertPool(p1, p3, p2, s1, s3, s2), (d1, d3, d2)


def _pool(seed, quantized: bool):
    """A 6-slot pool (256 x 256 experts), int4 or float32, and its float64 weights."""
    if quantized:
        return _int4_pool(seed)
    _, w1, w3, w2 = _inputs(seed, 1, slots=6)
    return ExpertPool(w1, w3, w2), (w1, w3, w2)


@pytest.mark.parametrize("n", [1, 7])
def test_int4_xla_path_matches_float64(n):
    pool, (d1, d3, d2) = _int4_pool(n)
    x = np.random.default_rng(n + 100).normal(size=(n, 256)).astype(np.float32)
    slots = np.array([5, 1], np.int32)
    ref = _reference(x, slots, d1, d3, d2)
    y = ek.grouped_swiglu_xla(x, slots, pool).sum(1)
    assert np.abs(np.asarray(y) - ref).max() / np.abs(ref).max() < 1e-5


def _bf16_error(y, ref):
    return np.abs(np.asarray(y, np.float32) - ref).max() / np.abs(ref).max()


MOSAIC_TILES = [
    int4_kernel.Int4Tiles(), int4_kernel.Int4Tiles(64, 3, 2), int4_kernel.Int4Tiles(128, 4, 2),
    # persistent CTAs: 12 entries make more tiles than CTAs, so each CTA streams several
    int4_kernel.Int4Tiles(64, 3, 2, ctas_per_sm=1, down_splits=2),
    int4_kernel.Int4Tiles(64, 2, 2, ctas_per_sm=3, up_splits=2),
    # each group folded as soon as its wgmma is done
    int4_kernel.Int4Tiles(64, 2, 2, down_splits=2, fold_lag=0),
    int4_kernel.Int4Tiles(64, 2, 1, ctas_per_sm=1, fold_lag=0),
    # bfloat16 products
    int4_kernel.Int4Tiles(64, 2, 2, f16=False), int4_kernel.Int4Tiles(128, 4, 2, f16=False),
    int4_kernel.Int4Tiles(64, 2, 2, ctas_per_sm=3, up_splits=2, fold_lag=0, f16=False),
    # warp-specialized: compute warpgroups sharing one activation tile
    int4_kernel.Int4Tiles(64, 2, 2, compute_wgs=2),
    int4_kernel.Int4Tiles(64, 4, 1, up_splits=2, down_splits=2, fold_lag=0, compute_wgs=2),
    int4_kernel.Int4Tiles(64, 2, 1, ctas_per_sm=1, up_splits=2, compute_wgs=2),
    int4_kernel.Int4Tiles(64, 5, 2, ctas_per_sm=1, fold_lag=0, compute_wgs=2),  # deep pipeline
    # stream-K: equal runs of steps, tiles cut between CTAs
    int4_kernel.Int4Tiles(64, 2, 2, ctas_per_sm=1, stream_k=True,
                          down=int4_kernel.Int4Tiles(64, 4, 2, ctas_per_sm=1, stream_k=True)),
    # one CTA per gate/up tile, a stream-K down kernel
    int4_kernel.Int4Tiles(64, 3, 1, fold_lag=0, down=int4_kernel.Int4Tiles(
        64, 3, 1, ctas_per_sm=2, fold_lag=0, stream_k=True))]


@pytest.mark.parametrize("tiles", MOSAIC_TILES)
@pytest.mark.parametrize("tile_major", [False, True])
def test_int4_mosaic_kernel_lowers_for_cuda(tiles, tile_major):
    """Without a GPU: every tile setting the GPU test runs lowers to the two Mosaic GPU kernels
    (layouts, the register view, smem slicing and pipelines are checked by Mosaic here)."""
    d, f, c, rows = 512, 1024, 4, 16
    sds = jax.ShapeDtypeStruct
    packed = lambda *s: sds(s, jnp.uint8)  # noqa: E731
    scales = lambda *s: sds(s, jnp.bfloat16)  # noqa: E731
    r, b = int4_kernel.weight_tile(tiles)
    gate_up, down = ((packed(c, f // r, d // b, r, b // 2), packed(c, d // r, f // b, r, b // 2))
                     if tile_major else (packed(c, f, d // 2), packed(c, d, f // 2)))
    pool = ExpertPool(gate_up, gate_up, down,
                      scales(c, d // 128, f), scales(c, d // 128, f), scales(c, f // 128, d))
    lowered = int4_kernel.grouped_swiglu_int4.trace(
        sds((c, rows, d), jnp.bfloat16), sds((c,), jnp.int32), pool, None, tiles=tiles,
    ).lower(lowering_platforms=("cuda",)).as_text()
    assert lowered.count("custom_call @mosaic_gpu") == 2
    assert "int4_gate_up" in lowered and "int4_down" in lowered


@pytest.mark.skipif(not int4_kernel.is_hopper(), reason="the Mosaic GPU int4 kernel needs Hopper")
@pytest.mark.parametrize(("d", "f"), [(512, 1024), (256, 384)])
@pytest.mark.parametrize("tiles", MOSAIC_TILES)
def test_int4_mosaic_kernel_on_gpu_matches_float64(d, f, tiles):
    if not int4_kernel.int4_fits(d, f, tiles):
        pytest.skip(f"{tiles} does not tile D={d}, F={f}")
    pool, (d1, d3, d2) = _int4_pool(3, d=d, f=f)
    rng = np.random.default_rng(7)
    slots = rng.integers(0, 6, 12).astype(np.int32)
    valid = np.arange(12) % 4 != 1
    # shared rows (n = 5, padded to 8 inside) and per-entry rows (13, padded to 16)
    for x in (rng.normal(size=(5, d)), rng.normal(size=(12, 13, d))):
        x = x.astype(ml_dtypes.bfloat16)
        y = np.asarray(int4_kernel.grouped_swiglu_int4(x, slots, pool, valid, tiles).sum(1))
        tiled = pool.tiled_by(*int4_kernel.weight_tile(tiles))
        y_tiled = int4_kernel.grouped_swiglu_int4(x, slots, tiled, valid, tiles)
        np.testing.assert_array_equal(np.asarray(y_tiled.sum(1)), y)  # same bytes, same sums
        assert y.shape == (12, x.shape[-2], d)
        assert np.all(y[~valid] == 0.0)
        for c in np.flatnonzero(valid):
            xc = (x if x.ndim == 2 else x[c]).astype(np.float32)
            ref = _reference(xc, slots[c : c + 1], d1, d3, d2)[0]
            # bf16 activations and a bf16 intermediate h
            assert _bf16_error(y[c], ref) < 2e-2, (x.shape, c)
    assert ek.use_pallas(8, d, f, quantized=True)
    assert not ek.use_pallas(8, d, f, quantized=True, dtype=jnp.float32)


@pytest.mark.skipif(not int4_kernel.is_hopper(), reason="the Mosaic GPU int4 kernel needs Hopper")
def test_stream_k_on_gpu_cuts_tiles_and_matches_float64():
    """At one CTA per SM these shapes cut tiles between CTAs in both kernels: the joined sums
    match float64 and the whole-tile kernel to bf16 accuracy, and repeat bit for bit."""
    d, f, n_valid = 1024, 1536, 9
    tiles = int4_kernel.Int4Tiles(64, 2, 2, ctas_per_sm=1, stream_k=True)
    ctas = int4_kernel.sm_count()
    for o, k in ((f, d), (d, f)):  # gate/up, down: tiles of 64 rows, steps of 256 inputs
        steps = n_valid * (o // 64) * (k // 256)
        firsts = [int(int4_kernel._run_of_steps(p, steps, ctas, k // 256)[0])
                  for p in range(ctas)]
        assert any(first % (k // 256) for first in firsts), (o, k)
    pool, (d1, d3, d2) = _int4_pool(3, d=d, f=f)
    rng = np.random.default_rng(8)
    slots = rng.integers(0, 3, 12).astype(np.int32)
    valid = np.arange(12) % 4 != 1
    x = rng.normal(size=(12, 13, d)).astype(ml_dtypes.bfloat16)
    run = lambda t: np.asarray(int4_kernel.grouped_swiglu_int4(x, slots, pool, valid, t).sum(1))  # noqa: E731
    y = run(tiles)
    np.testing.assert_array_equal(run(tiles), y)
    whole = run(int4_kernel.Int4Tiles(64, 2, 2, ctas_per_sm=1))
    assert np.all(y[~valid] == 0.0)
    for c in np.flatnonzero(valid):
        ref = _reference(x[c].astype(np.float32), slots[c : c + 1], d1, d3, d2)[0]
        assert _bf16_error(y[c], ref) < 2e-2, c
        assert _bf16_error(y[c], whole[c]) < 2e-2, c


@pytest.mark.parametrize("quantized", [False, True])
def test_invalid_entries_give_zeros_and_leave_the_others_alone(quantized):
    pool, (d1, d3, d2) = _pool(8, quantized)
    x = np.random.default_rng(4).normal(size=(3, 256)).astype(np.float32)
    slots = np.array([3, 0, 5], np.int32)
    valid = np.array([True, False, True])
    ref = _reference(x, slots, d1, d3, d2)
    outs = [ek.grouped_swiglu_xla(x, slots, pool, valid)]
    if not quantized:  # the Triton kernel takes float pools
        outs.append(ek.grouped_swiglu_pallas(x, slots, pool, tiles=ek.FloatTiles(bd=64, split_k=2),
                                             interpret=True, valid=valid))
    for y in outs:
        y = np.asarray(y.sum(1))
        assert np.all(y[1] == 0.0)
        np.testing.assert_allclose(y[valid], ref[valid], rtol=0, atol=1e-5 * np.abs(ref).max())


def test_triton_kernel_rejects_int4_pools():
    pool, _ = _int4_pool(2)
    with pytest.raises(ValueError, match="float pools"):
        ek.grouped_swiglu_pallas(np.ones((2, 256), np.float32), np.array([0]), pool,
                                 interpret=True)


def test_int4_kernel_fits_whole_steps_and_row_tiles():
    one = int4_kernel.Int4Tiles(64, 4, 1)
    assert int4_kernel.int4_fits(4096, 14336, one) and int4_kernel.int4_fits(2048, 768, one)
    assert not int4_kernel.int4_fits(4096, 14336 + 64, one)
    assert not int4_kernel.int4_fits(64, 128, one)
    assert int4_kernel.int4_tiles_for(4096, 14336) == int4_kernel.TUNED_TILES[4096, 14336]
    assert int4_kernel.int4_tiles_for(512, 1024) == int4_kernel.INT4_TILES
    split = int4_kernel.Int4Tiles(64, 2, 2, up_splits=2, down_splits=2)
    assert int4_kernel.int4_tiles_for(2048, 768, split).down_splits == 1  # 3 steps of 256 inputs
    assert int4_kernel.int4_tiles_for(128, 384).groups == 1  # 384 is not a multiple of 2 groups
    assert int4_kernel.int4_tiles_for(64, 128) is None
    assert not int4_kernel.int4_fits(512, 1024, int4_kernel.Int4Tiles(fold_lag=2))
    # warp-specialized CTAs: tiles of 64 rows per compute warpgroup, one tile per CTA
    two = int4_kernel.Int4Tiles(64, 2, 2, compute_wgs=2)
    assert int4_kernel.int4_fits(4096, 14336, two) and int4_kernel.int4_fits(2048, 768, two)
    three = int4_kernel.Int4Tiles(64, 2, 1, compute_wgs=3)
    assert int4_kernel.int4_fits(384, 768, three)
    assert not int4_kernel.int4_fits(256, 768, three)  # 256 is not a multiple of 3 x 64 rows
    # 4 compute warpgroups ask for more registers than the CTA is launched with (a hang)
    assert not int4_kernel.int4_fits(4096, 14336, int4_kernel.Int4Tiles(64, 2, 2, compute_wgs=4))
    assert [w for w in range(2, 8) if int4_kernel.ws_registers_fit(w)] == [2, 3, 5, 6, 7]
    assert not int4_kernel.int4_fits(512, 1024, int4_kernel.Int4Tiles(128, 2, 2, compute_wgs=2))
    assert int4_kernel.int4_fits(512, 1024, int4_kernel.Int4Tiles(64, 2, 2, 1, compute_wgs=2))
    assert not int4_kernel.int4_fits(512, 1024, int4_kernel.Int4Tiles(64, 2, 2, 2, compute_wgs=2))
    # stream-K needs persistent CTAs and an unsplit reduction, per kernel
    sk = int4_kernel.Int4Tiles(64, 2, 2, ctas_per_sm=1, stream_k=True)
    assert int4_kernel.int4_fits(512, 1024, sk)
    assert not int4_kernel.int4_fits(512, 1024, dataclasses.replace(sk, ctas_per_sm=0))
    assert not int4_kernel.int4_fits(512, 1024, dataclasses.replace(sk, up_splits=2))
    assert int4_kernel.int4_fits(512, 1024, int4_kernel.Int4Tiles(64, 2, 2, up_splits=2, down=sk))
    # the down kernel's own tiles: depth, persistence, stream-K, split; not the tile shape
    assert int4_kernel.int4_fits(512, 1024, int4_kernel.Int4Tiles(
        64, 2, 2, down=int4_kernel.Int4Tiles(64, 4, 2)))
    for other in (int4_kernel.Int4Tiles(128, 2, 2), int4_kernel.Int4Tiles(64, 2, 1),
                  int4_kernel.Int4Tiles(64, 2, 2, f16=False)):
        assert not int4_kernel.int4_fits(512, 1024, int4_kernel.Int4Tiles(64, 2, 2, down=other))
    split_down = int4_kernel.Int4Tiles(64, 2, 2, down=int4_kernel.Int4Tiles(64, 2, 2,
                                                                            down_splits=2))
    assert int4_kernel.int4_tiles_for(2048, 768, split_down).down.down_splits == 1


def test_deep_pipelines_shrink_to_fit_shared_memory():
    """A warp-specialized 5-stage pipeline fits a CTA's 227 KB at 16 activation rows, not at 32
    (Mosaic refuses 254 KB): there it runs 4 stages, and lowers."""
    deep = int4_kernel.Int4Tiles(64, 5, 2, ctas_per_sm=1, compute_wgs=2)
    assert int4_kernel.fitting_stages(deep, 16, 2, 2) == 5
    assert int4_kernel.fitting_stages(deep, 32, 2, 2) == 4
    assert int4_kernel.fitting_stages(int4_kernel.INT4_TILES, 64, 2, 2) == 2
    d, f, c = 1024, 512, 2
    sds = jax.ShapeDtypeStruct
    pool = ExpertPool(*(sds(s, jnp.uint8) for s in ((c, f, d // 2), (c, f, d // 2),
                                                    (c, d, f // 2))),
                      *(sds(s, jnp.bfloat16) for s in ((c, d // 128, f), (c, d // 128, f),
                                                       (c, f // 128, d))))
    int4_kernel.grouped_swiglu_int4.trace(
        sds((32, d), jnp.bfloat16), sds((c,), jnp.int32), pool, None, tiles=deep,
    ).lower(lowering_platforms=("cuda",))


def test_tile_major_pool_computes_the_same_on_the_xla_path():
    """A tile-major pool holds the same bytes: the jnp path gives the same sums, bit for bit,
    and the layout is self-describing (the tile and the expert dims come from the shapes)."""
    pool, _ = _int4_pool(4, d=512, f=768)
    tiled = pool.tiled_by(128, 256)
    assert tiled.tiled and tiled.tile == (128, 256) and not pool.tiled
    assert tiled.intermediate_size == pool.intermediate_size == 768
    x = np.random.default_rng(5).normal(size=(3, 512)).astype(np.float32)
    slots = np.array([3, 0, 2], np.int32)
    np.testing.assert_array_equal(np.asarray(ek.grouped_swiglu_xla(x, slots, tiled)),
                                  np.asarray(ek.grouped_swiglu_xla(x, slots, pool)))
    flat = np.asarray(tiled.w2).reshape(-1)  # w2 [4, 512, 384]: tile (s, block, step) in order
    for s, block, step in [(0, 0, 0), (1, 3, 1), (3, 2, 0)]:
        tile = np.asarray(pool.w2)[s, block * 128:(block + 1) * 128, step * 128:(step + 1) * 128]
        start = ((s * 4 + block) * 3 + step) * tile.size
        np.testing.assert_array_equal(flat[start:start + tile.size], tile.reshape(-1))
    with pytest.raises(ValueError, match="do not tile by 100 x 256"):
        tile_major(pool.w1, 100, 256)
    with pytest.raises(ValueError, match="tile-major by"):
        int4_kernel.grouped_swiglu_int4(x, slots, tiled, tiles=int4_kernel.INT4_TILES)


def test_tiles_that_do_not_divide_are_rejected():
    with pytest.raises(ValueError, match="not multiples"):
        ek.check_float_tiles(200, 256, ek.FloatTiles())
    with pytest.raises(ValueError, match="do not split"):
        ek.check_float_tiles(384, 256, ek.FloatTiles(split_k=1, unroll=2))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="Pallas Triton lowering needs a GPU")
def test_pallas_kernel_on_gpu_matches_float64():
    x, w1, w3, w2 = _inputs(21, 8, d=512, f=1024)
    slots = np.array([1, 4, 6], np.int32)
    pool = ExpertPool(w1, w3, w2)
    y = ek.grouped_swiglu_pallas(x, slots, pool, tiles=ek.float_tiles_for(512, 1024)).sum(1)
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


def test_float_tiles_for_shrinks_split_k_to_fit():
    # 48 K blocks: 4 splits would leave loops of 12 < MIN_SPLIT_STEPS; 3 splits give 16
    assert ek.float_tiles_for(2048, 6144, ek.FloatTiles(split_k=4)).split_k == 3
    assert ek.float_tiles_for(2048, 768, ek.FloatTiles(split_k=4)).split_k == 1
    assert ek.float_tiles_for(4096, 14336, ek.FloatTiles(split_k=4)).split_k == 4
    assert ek.float_tiles_for(100, 768) is None
