"""The offload engine over several hosts: one process per host under `jax.distributed`, each
running the same engine calls on the same prompts (SPMD). Two CPU processes of two devices
each (tests/ep_worker.py, mode "engine-process", Gloo collectives) run one engine over the 4
devices with a budget that leaves half the experts on disk: the tokens and every decode
step's logits are the one-device resident engine's, every tier moved, each process holds and
moves only its own devices' experts, and both report the same tokens and stats; a request
sampled without a seed, and a corrupt chunk that only one process reads, give both the same
outcome; experts over fewer devices than the processes' are refused by name."""

from __future__ import annotations

import socket

import pytest

from strata_runtime.engine.config import EngineConfig
from strata_runtime.engine.offload import Engine
from tests.ep_worker import (
    ENGINE_NEW,
    ENGINE_SHAPE,
    PROCESS_PROMPTS,
    digest,
    launch,
    result,
)
from tests.helpers import tiny_config, write_checkpoint
from tests.runtime.contract import run_rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both processes' results, and the one-device resident engine's tokens and logits
    (computed here while the workers start)."""
    ckpt = tmp_path_factory.mktemp("engine_processes") / "ck"
    write_checkpoint(tiny_config("qwen2_moe", num_experts=16), ckpt, seed=5)
    port = str(_free_port())
    procs = [launch([str(ckpt), "engine-process", str(pid), port]) for pid in (0, 1)]
    with Engine.from_checkpoint(ckpt, EngineConfig(**ENGINE_SHAPE)) as one:
        assert one.layout.resident
        tokens, logits = run_rows(one, PROCESS_PROMPTS, ENGINE_NEW)
        generated = one.generate(PROCESS_PROMPTS, ENGINE_NEW)
    return [result(p)[0] for p in procs], (tokens.tolist(), digest(logits), generated)


def test_two_processes_give_the_one_device_resident_engines_bits(runs):
    results, (tokens, logits, generated) = runs
    for r in results:
        assert r["tokens"] == tokens and r["logits"] == logits and r["generate"] == generated


def test_every_tier_moves_and_each_process_moves_only_its_own(runs):
    results, _ = runs
    for pid, r in enumerate(results):
        assert (r["processes"], r["expert_devices"], r["local"]) == (2, 4, 2)
        assert r["shares"] == [2 * pid, 2 * pid + 1] and r["owners"]
        assert r["tier0_experts"] > 0 and r["tier1_experts"] > 0
        assert r["disk_loads"] > 0 and r["resumed_layers"] > 0 and r["fetched"] > 0
        assert r["admissions"] > 0 and r["rebalance_swaps"] > 0 and not r["failed_requests"]
        # every device took part: its own misses, loads and admissions
        assert all(d["fetched"] > 0 and d["disk_loads"] > 0 for d in r["devices"]), r


def test_both_processes_agree(runs):
    first, second = runs[0]
    assert {**first, "process": 1, "shares": second["shares"],
            "failing": second["failing"]} == second


def test_a_corrupt_chunk_read_by_one_process_fails_the_same_requests_on_both(runs):
    """The chunk is the last device's: process 1 fails to read it, process 0 learns so."""
    results, (_, _, generated) = runs
    layer, expert = results[0]["corrupt"]
    failing = results[0]["failing"]
    assert results[1]["failing"] != failing  # the same requests, but each its own message
    assert [t for t, _ in results[1]["failing"]] == [t for t, _ in failing]
    errors = [e for _, e in failing if e]
    assert errors and all(f"expert {expert} of layer {layer}: its owner's process" in e
                          for e in errors)
    assert all(f"expert {expert} of layer {layer}" in e for _, e in results[1]["failing"] if e)
    assert all(t == g for (t, e), g in zip(failing, generated, strict=True) if e is None)


def test_sampling_without_a_seed_agrees_and_too_few_devices_are_refused(runs):
    results, _ = runs
    assert results[0]["sampled"] == results[1]["sampled"]
    for r in results:
        assert "expert_devices=2 (--expert-devices) spans the devices of 1 of the 2 " \
               "jax.distributed processes" in r["refused"]
