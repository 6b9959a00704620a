"""prefill + decode_step equal the full causal forward, for every family."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax import api
from strata_jax import model as mdl
from tests.helpers import random_model, tiny_config

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]


def _rel(a, b):
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_decode_match_full_forward(family):
    cfg = tiny_config(family)
    m = random_model(cfg, seed=1)
    rng = np.random.default_rng(2)
    total = 14
    tokens = rng.integers(0, cfg.vocab_size, (3, total)).astype(np.int32)
    full = api.logits(m, tokens)
    lengths = np.array([8, 5, 2], np.int32)
    prompt = np.where(np.arange(8)[None, :] < lengths[:, None], tokens[:, :8], 0)
    args = (m.params, m.experts, m.slot_table)
    prefill = jax.jit(mdl.prefill, static_argnums=(0, 5))
    decode = jax.jit(mdl.decode_step, static_argnums=0)
    pre, cache = prefill(cfg, *args, jnp.asarray(prompt), 32)
    for b, n in enumerate(lengths):
        assert _rel(pre[b, :n], full[b, :n]) <= 1e-5
    pos = lengths.copy()
    while pos.max() < total:
        step, cache = decode(cfg, *args, cache, jnp.asarray(tokens[np.arange(3), pos]),
                                      jnp.asarray(pos))
        assert _rel(step, full[np.arange(3), pos]) <= 1e-5
        pos += 1


def test_generate_batched_equals_single():
    cfg = tiny_config("qwen2_moe")
    m = random_model(cfg, seed=3)
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [42]]
    batched = api.generate(m, prompts, 6)
    assert batched == [api.generate(m, [p], 6)[0] for p in prompts]
    assert all(len(o) == 6 for o in batched)


def test_generate_matches_argmax_of_logits():
    cfg = tiny_config("mixtral")
    m = random_model(cfg, seed=4)
    seq = [3, 14, 15, 92]
    out = api.generate(m, [seq], 5)[0]
    full = api.logits(m, np.array([seq + out]))[0]
    assert out == np.argmax(full[len(seq) - 1 : -1], axis=-1).tolist()


def test_bad_tokens_are_rejected():
    m = random_model(tiny_config())
    with pytest.raises(ValueError, match="token ids"):
        api.logits(m, np.array([[0, 97]]))
    with pytest.raises(ValueError, match="batch, time"):
        api.logits(m, np.array([1, 2]))


def test_resident_slot_table_addresses_every_expert_once():
    cfg = tiny_config()
    table = np.asarray(mdl.resident_slot_table(cfg))
    assert sorted(table.ravel().tolist()) == list(range(cfg.num_layers * cfg.num_experts))
