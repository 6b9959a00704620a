"""Routing glue: expert-grouped row chunks, and chunked vs dense expert outputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_jax.model.moe import Routing, chunk_capacity, chunk_picks, routed_outputs
from strata_jax.ops import expert_kernels as ek
from strata_jax.ops.pool import ExpertPool


def _picks(seed, n, k, e):
    rng = np.random.default_rng(seed)
    return np.stack([rng.choice(e, k, replace=False) for _ in range(n)]).astype(np.int32)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 40), k=st.integers(1, 4),
       e=st.integers(4, 12), rows=st.sampled_from([2, 4, 16]))
def test_chunk_picks_place_every_taken_pick_once(seed, n, k, e, rows):
    experts = _picks(seed, n, k, e)
    take = np.random.default_rng(seed + 1).random(e) < 0.7
    ch = jax.tree.map(np.asarray, chunk_picks(jnp.asarray(experts), jnp.asarray(take), e, rows))
    assert ch.rows.shape == (chunk_capacity(n, k, e, rows), rows)
    seen = set()
    for t in range(n):
        for j in range(k):
            if not take[experts[t, j]]:
                continue
            c, r = ch.pick_chunk[t, j], ch.pick_row[t, j]
            assert ch.valid[c] and ch.expert[c] == experts[t, j]
            assert ch.rows[c, r] == t
            seen.add((c, r))
    counts = np.bincount(experts[take[experts]], minlength=e)
    assert ch.valid.sum() == sum(-(-c // rows) for c in counts)
    used = {(c, r) for c in range(len(ch.rows)) for r in range(rows) if ch.rows[c, r] < n}
    assert used == seen  # no row is filled twice or left dangling
    assert np.all(ch.expert[~ch.valid] == e)


@pytest.mark.parametrize("n", [5, 23])
def test_chunked_outputs_equal_dense_outputs(n):
    rng = np.random.default_rng(n)
    e, k, d, f = 6, 2, 64, 96
    x = rng.normal(size=(n, d)).astype(np.float32)
    w1, w3 = (rng.normal(size=(e + 2, d, f)).astype(np.float32) / 8 for _ in range(2))
    w2 = rng.normal(size=(e + 2, f, d)).astype(np.float32) / 8
    routing = Routing(jnp.asarray(_picks(n, n, k, e)), None, None)
    slot_of_expert = jnp.asarray(rng.permutation(e + 2)[:e].astype(np.int32))
    take = jnp.asarray(np.arange(e) % 3 != 1)
    pool = ExpertPool(w1, w3, w2)
    dense = routed_outputs(x, routing, pool, slot_of_expert, take, row_chunks=False)
    chunked = routed_outputs(x, routing, pool, slot_of_expert, take, row_chunks=True)
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(dense), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(dense)[~np.asarray(take)[np.asarray(routing.experts)]] == 0)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the Pallas path runs on GPUs")
@pytest.mark.parametrize("quantized", [False, True])
def test_chunked_outputs_are_bit_identical_to_dense_on_gpu(quantized):
    """Rows keep their bits whichever other rows share their tile (offload passes rely on it)."""
    from tests.ops.test_expert_kernels import _int4_pool

    rng = np.random.default_rng(0)
    e, k, d, f, n = 6, 2, 256, 256, 29
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.bfloat16)
    if quantized:
        pool = _int4_pool(2, slots=e, d=d, f=f)[0]
    else:
        pool = ExpertPool(*(jnp.asarray(rng.normal(size=s) / 16, jnp.bfloat16)
                            for s in ((e, d, f), (e, d, f), (e, f, d))))
    routing = Routing(jnp.asarray(_picks(1, n, k, e)), None, None)
    take = jnp.ones(e, bool)
    assert ek.use_row_chunks(n, d, f, quantized)
    args = (x, routing, pool, jnp.arange(e, dtype=jnp.int32), take)
    dense = routed_outputs(*args, row_chunks=False)
    chunked = routed_outputs(*args, row_chunks=True)
    np.testing.assert_array_equal(np.asarray(chunked), np.asarray(dense))


def _swiglu64(x, w1, w3, w2):
    gate, up = x @ w1, x @ w3
    return (gate / (1 + np.exp(-gate)) * up) @ w2


def test_sorted_outputs_match_float64_and_split_into_passes_exactly():
    """The XLA path for any token count (`moe._sorted_outputs`, what the CPU and GPU prefill
    chunks run): every taken pick equals a float64 reference, experts with more picks than a
    tile (SORTED_ROWS) included, untaken picks are zero, and two passes over complementary
    `take` masks sum to the one-pass result bit for bit (what an offloaded layer relies on)."""
    from strata_jax.model.moe import SORTED_ROWS

    rng = np.random.default_rng(3)
    n, k, e, d, f = 300, 2, 4, 32, 48  # 600 picks over 4 experts: several tiles each
    x = rng.normal(size=(n, d)).astype(np.float32)
    w1, w3 = (rng.normal(size=(e + 1, d, f)).astype(np.float32) / 6 for _ in range(2))
    w2 = rng.normal(size=(e + 1, f, d)).astype(np.float32) / 6
    experts = _picks(4, n, k, e)
    assert np.bincount(experts.ravel(), minlength=e).max() > SORTED_ROWS
    slot_of_expert = np.array([4, 0, 2, 1], np.int32)
    pool = ExpertPool(w1, w3, w2)
    routing = Routing(jnp.asarray(experts), None, None)
    whole = np.asarray(routed_outputs(x, routing, pool, slot_of_expert, jnp.ones(e, bool)))
    x64 = x.astype(np.float64)
    for t in range(0, n, 7):
        for j in range(k):
            s = slot_of_expert[experts[t, j]]
            want = _swiglu64(x64[t], *(w.astype(np.float64)[s] for w in (w1, w3, w2)))
            np.testing.assert_allclose(whole[t, j], want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    take = np.array([True, False, True, False])
    first = np.asarray(routed_outputs(x, routing, pool, slot_of_expert, jnp.asarray(take)))
    second = np.asarray(routed_outputs(x, routing, pool, slot_of_expert, jnp.asarray(~take)))
    assert np.all(first[~take[experts]] == 0) and np.all(second[take[experts]] == 0)
    np.testing.assert_array_equal(first + second, whole)
