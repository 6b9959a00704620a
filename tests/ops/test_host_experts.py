"""The host expert kernel (`host_experts`) against a float64 numpy reference, reading a real
pinned-host pool in place."""

import jax
import ml_dtypes
import numpy as np
import pytest

from strata_jax.formats import quant
from strata_jax.ops import host_experts
from strata_jax.ops.pool import ExpertPool

D, F, SLOTS, E, K = 64, 96, 5, 8, 2


def _pool(dtype, seed=0):
    rng = np.random.default_rng(seed)
    pinned = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    shapes = {"w1": (SLOTS, D, F), "w3": (SLOTS, D, F), "w2": (SLOTS, F, D)}
    arrays = {k: (rng.normal(0, 0.2, s)).astype(dtype) for k, s in shapes.items()}
    return ExpertPool(**{k: jax.device_put(a, pinned) for k, a in arrays.items()}), arrays


def _reference(arrays, slot, x):
    w1, w3, w2 = (np.asarray(arrays[k][slot], np.float64) for k in ("w1", "w3", "w2"))
    x = np.asarray(x, np.float64)
    gate, up = x @ w1, x @ w3
    return (gate / (1 + np.exp(-gate)) * up) @ w2


def _int4_pool(d, f, seed=0, tile=None):
    """A pinned int4 pool and its exactly dequantized float weights."""
    rng = np.random.default_rng(seed)
    pinned = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    arrays, dense = {}, {}
    for k, shape in (("w1", (d, f)), ("w3", (d, f)), ("w2", (f, d))):
        qs = [quant.quantize_int4_rtn(rng.normal(0, 0.2, shape).astype(np.float32))
              for _ in range(SLOTS)]
        arrays[k] = np.stack([q.packed for q in qs])
        arrays[f"{k}_scale"] = np.stack([q.scales for q in qs])
        dense[k] = np.stack([quant.dequantize_int4(q) for q in qs])
    pool = ExpertPool(**{k: jax.device_put(a, pinned) for k, a in arrays.items()})
    return (pool if tile is None else pool.tiled_by(*tile)), dense


@pytest.mark.parametrize(("dtype", "tol"), [(np.float32, 1e-5), (ml_dtypes.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [1, 3, 16, 64])
def test_picks_match_float64(dtype, tol, rows):
    pool, arrays = _pool(dtype, seed=rows)
    rng = np.random.default_rng(rows)
    h = rng.normal(0, 1, (rows, D)).astype(dtype)
    experts = np.stack([rng.choice(E, K, replace=False) for _ in range(rows)]).astype(np.int32)
    live = np.ones(rows, bool)
    live[-1] = rows == 1  # a padding row computes nothing
    hosted = np.zeros(E, bool)
    hosted[[1, 4, 6]] = True
    host_row = np.array([0, 2, -1, 1, 4, -1, 3, -1], np.int32)
    tier = host_experts.register(pool)
    try:
        out = host_experts.collect(host_experts.submit(tier, h, experts, live, hosted,
                                                       host_row), None)
        stats = host_experts.tier(tier)
    finally:
        host_experts.release(tier)
    assert out.shape == (rows, K, D) and out.dtype == np.float32
    computed = 0
    for n in range(rows):
        for j in range(K):
            e = experts[n, j]
            if not (hosted[e] and live[n]):
                assert not out[n, j].any()
                continue
            ref = _reference(arrays, host_row[e], h[n][None])[0]
            err = np.abs(out[n, j] - ref).max() / np.abs(ref).max()
            assert err < tol, (n, j, err)
            computed += 1
    assert computed > 0 and stats.experts > 0 and stats.busy_s > 0


def test_the_views_follow_writes_to_the_pool_buffer():
    """The kernel reads the pinned buffer itself: a donated in-place update of a slot is what
    the next call computes with."""
    pool, arrays = _pool(np.float32)
    put = jax.jit(lambda buf, new: buf.at[2].set(new), donate_argnums=0)
    new_w2 = np.full((F, D), 0.5, np.float32)
    pool2 = pool._replace(w2=put(pool.w2, new_w2))
    tier = host_experts.register(pool2)
    try:
        x = np.ones((1, D), np.float32)
        y = host_experts.compute(tier, x, np.array([[3, 0]], np.int32), np.ones(1, bool),
                                 np.eye(E, dtype=bool)[3], np.array([0, 0, 0, 2] + [0] * 4))
    finally:
        host_experts.release(tier)
    arrays["w2"][2] = new_w2
    np.testing.assert_allclose(y[0, 0], _reference(arrays, 2, x)[0], rtol=1e-5)


@pytest.mark.parametrize("tile", [None, (8, 128)], ids=["rows", "tiles"])
def test_int4_pools_are_computed(tile):
    """A packed int4 tier 1, row-major or tile-major as the int4 kernel's pools are, against
    the float64 product of its dequantized weights."""
    d, f = 128, 256
    pool, dense = _int4_pool(d, f, seed=1, tile=tile)
    host_experts.check_pool(pool)
    rng = np.random.default_rng(2)
    h = rng.normal(0, 1, (3, d)).astype(ml_dtypes.bfloat16)
    experts = np.array([[1, 2], [2, 0], [1, 3]], np.int32)
    hosted = np.array([False, True, True, False])
    host_row = np.array([0, 4, 2, 1], np.int32)
    tier = host_experts.register(pool)
    try:
        out = host_experts.compute(tier, h, experts, np.ones(3, bool), hosted, host_row)
        gbps, growth = host_experts.measure(tier, repeats=1)
        link, gbps_shared, growth_shared = host_experts.measure_with_copies(
            tier, jax.devices()[0], nbytes=1 << 20)
    finally:
        host_experts.release(tier)
    assert gbps > 0 and growth >= 0
    assert link > 0 and gbps_shared > 0 and growth_shared >= 0
    for n in range(3):
        for j in range(2):
            e = experts[n, j]
            if not hosted[e]:
                assert not out[n, j].any()
                continue
            ref = _reference(dense, host_row[e], h[n][None])[0]
            assert np.abs(out[n, j] - ref).max() / np.abs(ref).max() < 2e-2


def test_bad_pools_and_stale_tiers_are_refused():
    pool, _ = _pool(np.float32)
    packed = pool._replace(w1_scale=pool.w1, w3_scale=pool.w3, w2_scale=pool.w2)
    with pytest.raises(ValueError, match="packed int4 experts take uint8 weights"):
        host_experts.register(packed)
    with pytest.raises(ValueError, match="float experts, got int32"):
        host_experts.check_pool(pool._replace(w1=pool.w1.astype(np.int32)))
    tier = host_experts.register(pool)
    host_experts.release(tier)
    with pytest.raises(KeyError, match=f"host tier {tier} is not registered"):
        host_experts.tier(tier)


def test_views_read_a_just_transferred_pool():
    """The views are taken once the pool's transfer has landed: a pointer taken while the copy
    is in flight reads whatever the allocator left there."""
    pinned = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    for seed in range(60):
        rng = np.random.default_rng(seed)
        arrays = {k: rng.normal(0, 1, (SLOTS, D, F)).astype(np.float32)
                  for k in ("w1", "w3", "w2")}
        tier = host_experts.register(ExpertPool(**{k: jax.device_put(a, pinned)
                                                   for k, a in arrays.items()}))
        try:
            views = host_experts.tier(tier).views
            for k, a in arrays.items():
                np.testing.assert_array_equal(views[k], a, err_msg=f"{k}, seed {seed}")
        finally:
            host_experts.release(tier)


def test_round_trips_are_timed():
    """Each collected layer share is one round trip, its times in order, its experts and
    rows those the kernel computed, summed into the tier's counters."""
    pool, _ = _pool(np.float32, seed=9)
    rng = np.random.default_rng(9)
    h = rng.normal(0, 1, (3, D)).astype(np.float32)
    experts = np.array([[1, 4], [4, 6], [0, 2]], np.int32)
    hosted = np.zeros(E, bool)
    hosted[[1, 4]] = True
    host_row = np.array([0, 2, -1, 1, 4, -1, 3, -1], np.int32)
    tier = host_experts.register(pool)
    host_experts.record_round_trips(True)
    try:
        host_experts.collect(host_experts.submit(tier, h, experts, np.ones(3, bool), hosted,
                                                 host_row), None)
        (trip,) = host_experts.recent_round_trips()
        stats = host_experts.tier(tier)
    finally:
        host_experts.record_round_trips(False)
        host_experts.release(tier)
    assert trip.submitted <= trip.started <= trip.ended <= trip.returned
    assert trip.collected <= trip.returned
    assert (trip.experts, trip.rows) == (2, 3)  # expert 1: row 0; expert 4: rows 0 and 1
    assert stats.trips == 1 and stats.experts == 2
    assert stats.queue_s == trip.started - trip.submitted
    assert stats.wait_s == trip.returned - trip.collected
    assert host_experts.recent_round_trips() == []
