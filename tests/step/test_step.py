"""The one compiled step: prefill + decode equal the full forward; offloaded tiers give the
resident bits; one program per step with no device->host transfer inside it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from strata_jax import api
from strata_jax.model import decoder as mdl
from strata_jax.step import programs as step
from tests.helpers import random_model, tiny_config

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "minimax_m2", "deepseek_v3"]
PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [42]]


def _rel(a, b):
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


def _resident_args(m: api.Model):
    return (m.config, step.StepPlan(), m.params, m.experts, step.resident_tiers(m.slot_table))


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_decode_match_full_forward(family):
    cfg = tiny_config(family)
    m = random_model(cfg, seed=1)
    rng = np.random.default_rng(2)
    total = 14
    tokens = rng.integers(0, cfg.vocab_size, (3, total)).astype(np.int32)
    full = api.logits(m, tokens)
    lengths = [8, 5, 2]
    args = _resident_args(m)
    state = step.init_state(cfg, 4, 32)
    for row, n in enumerate(lengths):
        chunk = np.zeros(8, np.int32)
        chunk[:n] = tokens[row, :n]
        state, out, _ = step.prefill(*args, state, *_one_row(row, chunk, 0, n))
        assert _rel(out.logits[0], full[row, n - 1]) <= 1e-5
    pos = np.array(lengths + [0])
    while pos[:3].max() < total:
        nxt = np.zeros(4, np.int32)
        nxt[:3] = tokens[np.arange(3), np.minimum(pos[:3], total - 1)]
        state = state.replace(tokens=jnp.asarray(nxt))
        state, out, _ = step.decode(*args, state)
        logits = out.logits
        done = pos[:3] < total
        rows = np.arange(3)[done]
        assert _rel(np.asarray(logits)[rows], full[rows, pos[rows]]) <= 1e-5
        pos[:3] += 1


def test_generate_is_batch_invariant():
    cfg = tiny_config("qwen2_moe")
    m = random_model(cfg, seed=3)
    batched = api.generate(m, PROMPTS, 6, batch_capacity=4, max_len=32)
    assert batched == [api.generate(m, [p], 6, batch_capacity=4, max_len=32)[0]
                       for p in PROMPTS]
    # more prompts than rows: queued in groups, the same tokens
    assert api.generate(m, PROMPTS * 2, 6, batch_capacity=4, max_len=32) == batched * 2
    assert all(len(o) == 6 for o in batched)


def test_generate_matches_argmax_of_logits():
    m = random_model(tiny_config("mixtral"), seed=4)
    seq = [3, 14, 15, 92]
    out = api.generate(m, [seq], 5, max_len=32)[0]
    full = api.logits(m, np.array([seq + out]))[0]
    assert out == np.argmax(full[len(seq) - 1 : -1], axis=-1).tolist()


def test_long_prompt_prefills_in_chunks():
    m = random_model(tiny_config("olmoe"), seed=5)
    prompt = np.random.default_rng(6).integers(0, 97, 150).tolist()
    assert [c[0] for c in step.prefill_chunks(150, 64)] == [0, 64, 128]
    out = api.generate(m, [prompt], 3, max_len=160)[0]
    full = api.logits(m, np.array([prompt + out]))[0]
    assert out == np.argmax(full[len(prompt) - 1 : -1], axis=-1).tolist()


def test_bad_requests_are_named():
    m = random_model(tiny_config())
    with pytest.raises(ValueError, match="token id 97"):
        api.logits(m, np.array([[0, 97]]))
    with pytest.raises(ValueError, match="batch, time"):
        api.logits(m, np.array([1, 2]))
    with pytest.raises(ValueError, match="request 1: the prompt is empty"):
        api.generate(m, [[1], []], 4)
    with pytest.raises(ValueError, match="request 0: max_new_tokens"):
        api.generate(m, [[1]], 0)
    with pytest.raises(ValueError, match="request 0: 30 prompt \\+ 4 new tokens exceed"):
        api.generate(m, [[1] * 30], 4, max_len=32)
    with pytest.raises(ValueError, match="request 1: token id -3"):
        api.generate(m, [[1], [2, -3]], 4)


def test_resident_slot_table_addresses_every_expert_once():
    cfg = tiny_config()
    table = np.asarray(mdl.resident_slot_table(cfg))
    assert sorted(table.ravel().tolist()) == list(range(cfg.num_layers * cfg.num_experts))


# --- offloaded tiers ----------------------------------------------------------------------------


def offloaded(m: api.Model, keep: list[tuple[int, int]], staging: int, disk=()):
    """A device pool holding the experts `keep` plus 2 * staging staging slots, and a
    pinned-host tier holding every expert but those in `disk`."""
    cfg = m.config
    page = np.full((cfg.num_layers, cfg.num_experts), -1, np.int32)
    slots = np.zeros(len(keep) + 2 * staging, np.int32)
    for s, (layer, e) in enumerate(keep):
        page[layer, e], slots[s] = s, layer * cfg.num_experts + e
    pool = jax.device_put(jax.tree.map(lambda a: a[jnp.asarray(slots)], m.experts),
                          jax.devices()[0])
    host_sharding = SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    host = jax.tree.map(lambda a: jax.device_put(a, host_sharding), m.experts)
    host_page = np.asarray(m.slot_table).copy()
    for layer, e in disk:
        host_page[layer, e] = -1
    return pool, step.Tiers(page=jnp.asarray(page), host=host, host_page=jnp.asarray(host_page))


def _one_row(row: int, chunk: np.ndarray, start: int, count: int) -> tuple:
    """`step.prefill`'s arguments of one row's chunk (a program of one row)."""
    one = lambda v: np.array([v], np.int32)  # noqa: E731
    return one(row), chunk[None], one(start), one(count)


# <= 8 tokens (PROMPTS' 10-token prompt cut to 8): one prefill bucket, so a layout compiles one
# prefill program (the resident one that of test_prefill_and_decode_match_full_forward); the
# 8-token prompt still copies up to 6 experts into a layer, more than a staging half of 2 or 3
# holds, so prefill runs in several passes
STEP_PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8], [42]]


def run(m, plan, pool, tiers, steps=5, capacity=4):
    """Prefill STEP_PROMPTS into rows 0..2 of `capacity`, then decode: tokens, logits,
    records."""
    cfg = m.config
    prefill = step.PROGRAMS[plan.staging > 0].prefill
    decode = step.PROGRAMS[plan.staging > 0].decode
    state = step.init_state(cfg, capacity, 32)
    records = []
    for row, prompt in enumerate(STEP_PROMPTS):
        for start, size, count in step.prefill_chunks(len(prompt), 64):
            chunk = np.zeros(size, np.int32)
            chunk[:count] = prompt[start : start + count]
            state, out, new_pool = prefill(cfg, plan, m.params, pool, tiers, state,
                                           *_one_row(row, chunk, start, count))
            pool = new_pool if plan.staging else pool
            records.append(jax.device_get(out.record))
    tokens, logits = [], []
    for _ in range(steps):
        state, out, new_pool = decode(cfg, plan, m.params, pool, tiers, state)
        pool = new_pool if plan.staging else pool
        tokens.append(np.asarray(out.tokens)[:3])
        logits.append(np.asarray(out.logits)[:3])
        records.append(jax.device_get(out.record))
    return np.stack(tokens), np.stack(logits), records


@pytest.mark.parametrize("family,fraction,staging,predictor", [
    ("qwen2_moe", 0.5, 2, "none"), ("olmoe", 0.3, 3, "next-gate"),
    ("qwen2_moe", 0.0, 2, "next-gate"), ("olmoe", 0.0, 12, "none"),
    ("olmoe", 1.0, 1, "next-gate"), ("glm4_moe", 0.1, 2, "next-gate"),
    ("deepseek_v3", 0.2, 3, "next-gate"), ("minimax_m2", 0.1, 2, "none"),
])  # fmt: skip
def test_offloaded_tiers_give_the_resident_bits(family, fraction, staging, predictor):
    cfg = tiny_config(family)
    m = random_model(cfg, seed=7)
    ref_tokens, ref_logits, _ = run(m, step.StepPlan(), m.experts,
                                    step.resident_tiers(m.slot_table))
    rng = np.random.default_rng(8)
    keep = [(layer, e) for layer in range(cfg.num_layers) for e in range(cfg.num_experts)
            if rng.random() < fraction]
    pool, tiers = offloaded(m, keep, staging)
    plan = step.StepPlan(staging=staging, predictor=predictor)
    tokens, logits, records = run(m, plan, pool, tiers)
    np.testing.assert_array_equal(tokens, ref_tokens)
    np.testing.assert_array_equal(logits, ref_logits)
    for rec in records:  # every routed expert came from exactly one place
        routed = (rec.counts > 0).sum(axis=1)
        np.testing.assert_array_equal(rec.hits + rec.prefetched + rec.fetched, routed)
        assert not rec.disk.any()
    fetched = sum(int(r.fetched.sum()) for r in records)
    assert (fetched == 0) == (fraction == 1.0)
    if predictor == "next-gate" and fraction < 1.0:
        assert sum(int(r.prefetched.sum()) for r in records) > 0


def test_an_expert_only_on_disk_is_reported():
    cfg = tiny_config("mixtral")
    m = random_model(cfg, seed=9)
    pool, tiers = offloaded(m, [], 2, disk=[(e // cfg.num_experts, e % cfg.num_experts)
                                            for e in range(cfg.num_layers * cfg.num_experts)])
    *_, records = run(m, step.StepPlan(staging=2), pool, tiers, steps=1)
    rec = records[-1]
    np.testing.assert_array_equal(rec.disk, rec.counts > 0)
    assert rec.fetched.sum() == 0


def test_one_program_per_step_and_no_device_to_host_transfer():
    cfg = tiny_config("qwen3_moe")
    m = random_model(cfg, seed=10)
    pool, tiers = offloaded(m, [(0, 1), (1, 2)], 2)
    plan = step.StepPlan(staging=2, predictor="next-gate")
    state = step.init_state(cfg, 4, 32)
    state = state.replace(live=jax.device_put(jnp.ones(4, jnp.bool_), jax.devices()[0]))
    state, _, pool = step.decode_staged(cfg, plan, m.params, pool, tiers, state)  # compiles
    jax.block_until_ready(state)
    compiled = step.decode_staged._cache_size()
    # one jitted call is one executable; no transfer in either direction around it
    with jax.transfer_guard("disallow"):
        for _ in range(3):
            state, out, pool = step.decode_staged(cfg, plan, m.params, pool, tiers, state)
        jax.block_until_ready((state, out, pool))
    assert step.decode_staged._cache_size() == compiled  # nothing compiled again
    assert int(jax.device_get(out.record.counts).sum()) == cfg.num_layers * 4 * cfg.top_k
