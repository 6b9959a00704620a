"""Experts over several devices (strata_jax/expert_parallel.py): the layout, then tokens and
logits on 2, 3 and 4 CPU devices and over two `jax.distributed` processes, each against one
device, bit for bit. The device settings run in subprocesses (tests/ep_worker.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import strata_jax
from strata_jax.expert_parallel import Layout
from tests.helpers import tiny_config, write_checkpoint

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("layers", "experts", "devices"), [(2, 16, 4), (3, 10, 4), (1, 5, 2)])
def test_layout_puts_every_expert_in_one_slot_of_its_owner(layers, experts, devices):
    layout = Layout(layers, experts, devices)
    page = layout.page()
    assert page.shape == (devices, layers, experts)
    assert ((page >= 0).sum(axis=0) == 1).all()  # one owner each
    for d in range(devices):
        owned = page[d] >= 0
        assert (np.nonzero(owned)[1] % devices == d).all()  # expert e on device e mod n
        slots = page[d][owned]
        assert len(set(slots.tolist())) == len(slots) < layout.slots_per_device + 1
    src = layout.source_slots().reshape(devices, -1)
    for d in range(devices):
        layers_, experts_ = np.nonzero(page[d] >= 0)
        np.testing.assert_array_equal(src[d, page[d][layers_, experts_]],
                                      layers_ * experts + experts_)
    assert sorted(s for s in src.ravel() if s >= 0) == list(range(layers * experts))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ep") / "ck"
    write_checkpoint(tiny_config(), path, seed=3)
    return path


def _worker(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    return subprocess.Popen([sys.executable, "-m", "tests.ep_worker", *args], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen, timeout: int = 300) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def test_tokens_and_logits_on_2_3_4_devices_are_one_devices(ckpt):
    result = _result(_worker(str(ckpt), "devices", "2,3,4"))
    assert result["devices"] == 4
    for n in ("2", "3", "4"):  # 3 devices: 16 experts leave one slot per layer empty
        assert result[n] == {"greedy": True, "sampled": True, "logits": True,
                             "pool_shards": int(n)}, n


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_distributed_processes_give_one_devices_tokens(ckpt):
    port = str(_free_port())
    procs = [_worker(str(ckpt), "process", str(pid), port) for pid in (0, 1)]
    results = [_result(p) for p in procs]
    from tests.ep_worker import NEW, PROMPTS

    reference = strata_jax.generate(strata_jax.load(ckpt), PROMPTS, max_new_tokens=NEW,
                                    batch_capacity=2)
    for r in results:
        assert (r["devices"], r["local"]) == (4, 2)
        assert r["tokens"] == reference
