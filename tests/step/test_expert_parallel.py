"""Experts over several devices (strata_jax/step/expert_parallel.py): the layout, then tokens and
logits on 3 and 4 CPU devices (float and int4 experts) and over two `jax.distributed`
processes, each against one device, bit for bit (offloaded budgets over a mesh:
tests/runtime/engine/test_engine_devices.py). The device settings run in subprocesses
(tests/ep_worker.py): both checkpoints' in one, the two processes' apart."""

from __future__ import annotations

import socket

import numpy as np
import pytest

import strata_jax
from strata_jax.step.expert_parallel import Layout, owners, sources
from tests.ep_worker import launch, result
from tests.helpers import tiny_config, write_checkpoint, write_quantized_checkpoint


@pytest.mark.parametrize(("layers", "experts", "devices", "resident"),
                         [(2, 16, 4, None), (3, 10, 4, 1), (1, 5, 2, 0), (2, 16, 2, 3)])
def test_layout_puts_every_expert_in_one_slot_of_its_owner(layers, experts, devices, resident):
    layout = Layout(layers, experts, devices, resident)
    page, host = layout.pages()
    assert page.shape == host.shape == (devices, layers, experts)
    assert (((page >= 0) | (host >= 0)).sum(axis=0) == 1).all()  # one owner, one tier each
    assert not ((page >= 0) & (host >= 0)).any()
    for table, slots in ((page, layout.device_slots), (host, layout.host_slots)):
        for d in range(devices):
            owned = table[d] >= 0
            assert (np.nonzero(owned)[1] % devices == d).all()  # expert e on device e mod n
            assert len(set(table[d][owned].tolist())) == owned.sum()
            assert table[d].max(initial=-1) < slots
        src = sources(table, slots).reshape(devices, -1)
        for d in range(devices):
            layers_, experts_ = np.nonzero(table[d] >= 0)
            np.testing.assert_array_equal(src[d, table[d][layers_, experts_]],
                                          layers_ * experts + experts_)
    held = np.concatenate([sources(page, layout.device_slots),
                           sources(host, layout.host_slots)])
    assert sorted(s for s in held if s >= 0) == list(range(layers * experts))
    with pytest.raises(ValueError, match="resident experts per layer"):
        Layout(layers, experts, devices, layout.per_layer + 1)


@pytest.mark.parametrize(("experts", "devices"), [(16, 4), (10, 4), (6, 4), (6, 3)])
def test_experts_dealt_by_heat_give_every_device_a_like_share(experts, devices):
    """Snake order over each layer's experts, hottest first: the counts of e mod n (the first
    devices one more), and no two devices' heat apart by more than the layer's hottest
    expert."""
    heat = np.random.default_rng(experts).gamma(0.5, size=(3, experts))
    owner = owners(3, experts, devices, heat)
    default = owners(3, experts, devices)
    assert (default == np.arange(experts) % devices).all() and not (owner == default).all()
    for layer in range(3):
        counts = np.bincount(owner[layer], minlength=devices)
        np.testing.assert_array_equal(counts, np.bincount(default[layer], minlength=devices))
        shares = np.bincount(owner[layer], weights=heat[layer], minlength=devices)
        assert shares.max() - shares.min() <= heat[layer].max()
    layout = Layout(3, experts, devices, 1, owner=owner)
    page, host = layout.pages()
    for d in range(devices):  # each device's tables hold exactly its own experts
        np.testing.assert_array_equal((page[d] >= 0) | (host[d] >= 0), owner == d)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ep") / "ck"
    write_checkpoint(tiny_config(), path, seed=3)
    return path


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """int8 dense + int4 g128 experts (packed pools, with scales)."""
    return write_quantized_checkpoint(tmp_path_factory.mktemp("ep_q"), num_experts=8)


@pytest.fixture(scope="module")
def on_devices(ckpt, quantized):
    """One worker: the int4 checkpoint over 4 devices, then the float one over 3."""
    return result(launch([str(quantized), "devices", "4"], [str(ckpt), "devices", "3"]))


def test_int4_experts_on_4_devices_are_one_devices(on_devices):
    assert on_devices[0]["4"] == {
        "greedy": True, "sampled": True, "logits": True, "pool_shards": 4, "cli": True}


def test_tokens_and_logits_on_3_devices_are_one_devices(on_devices):
    """16 experts over 3 devices leave one slot per layer empty on the last device."""
    got = on_devices[1]
    assert got["devices"] == 4
    assert got["3"] == {"greedy": True, "sampled": True, "logits": True, "pool_shards": 3,
                        "cli": True}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_distributed_processes_give_one_devices_tokens(ckpt):
    port = str(_free_port())
    procs = [launch([str(ckpt), "process", str(pid), port]) for pid in (0, 1)]
    results = [result(p)[0] for p in procs]
    from tests.ep_worker import NEW, PROMPTS

    reference = strata_jax.generate(strata_jax.load(ckpt), PROMPTS, max_new_tokens=NEW,
                                    batch_capacity=2)
    for r in results:
        assert (r["devices"], r["local"]) == (4, 2)
        assert r["tokens"] == reference
