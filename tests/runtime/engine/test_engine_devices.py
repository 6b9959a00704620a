"""The offload engine over several devices (EngineConfig.expert_devices): the tokens and every
decode step's logits of the one-device resident engine at every budget, each move made at the
expert's owner, the per-device counters summing to the totals; the refusals by name. The
settings run in one subprocess of 4 CPU devices (tests/ep_worker.py, mode "engine"), the
float model's and then the int4 one's."""

from __future__ import annotations

import pytest

from strata_runtime.cli.main import main
from strata_runtime.engine.config import EngineConfig
from strata_runtime.engine.offload import Engine
from tests.ep_worker import launch, result
from tests.helpers import tiny_config, write_checkpoint, write_quantized_checkpoint

FLOAT = ["4:resident", "3:tight", "4:disk"]  # 16 experts a layer: 3 devices own 6, 5, 5
INT4 = ["4:tight", "4:bench"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine_devices") / "ck"
    write_checkpoint(tiny_config("qwen2_moe", num_experts=16), path, seed=5)
    return path


@pytest.fixture(scope="module")
def runs(ckpt, tmp_path_factory):
    """Both jobs' results: the float model's settings and the int4 one's."""
    quantized = write_quantized_checkpoint(tmp_path_factory.mktemp("engine_devices_q"),
                                           num_experts=8)
    floats, int4 = result(launch([str(ckpt), "engine", *FLOAT],
                                 [str(quantized), "engine", *INT4]))
    return {**floats, **{f"int4 {k}": v for k, v in int4.items()}}


def _exact(run: dict) -> None:
    assert run["tokens"] and run["logits"], run
    assert run["owners"] and run["sums"], run  # moves at the owners; per device sums to all


def test_every_expert_in_its_owners_slots(runs):
    run = runs["4:resident"]
    _exact(run)
    assert run["devices"] == 4 and run["tier0_experts"] == 2 * 16
    assert run["misses_per_step"] == 0 and run["admissions"] == 0 and not run["by_heat"]


@pytest.mark.parametrize("setting", ["3:tight", "int4 4:tight"])
def test_a_tight_budget_admits_and_rebalances_per_device(runs, setting):
    """3 slots per device (one a cache slot), one expert per staging half: passes, cache
    admissions, the next-gate prefetch and rebalancing swaps, each on its owner."""
    run = runs[setting]
    _exact(run)
    assert run["misses_per_step"] > 0 and run["admissions"] > 0 and run["rebalance_swaps"] > 0


def test_the_disk_tier_stalls_and_resumes_over_the_mesh(runs):
    """Experts dealt to the devices by a heat file, one tier-1 expert per device: steps stall
    on disk, load into the owner's share and resume from the stalled layer."""
    run = runs["4:disk"]
    _exact(run)
    assert run["by_heat"]
    assert run["disk_loads"] > 0 and run["resumed_layers"] > 0 and run["admissions"] > 0


def test_strata_bench_reports_each_devices_link(runs):
    """`strata bench --expert-devices 4` (the engine flags' path of generate and serve too):
    its summary row and lines give each device's host -> device bytes (summing to the run's),
    their rate and the share of its own measured link."""
    assert runs["int4 4:bench"] == {"devices": 4, "lines": 4, "h2d_sum": True, "rates": True}


def test_expert_devices_beyond_the_devices_present_is_refused_by_name(ckpt, capsys):
    assert main(["generate", str(ckpt), "--prompt-ids", "5,6", "--hbm", "1GB",
                 "--expert-devices", "2"]) == 2
    assert "expert_devices=2 (--expert-devices): this process sees 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"miss='auto' \(--miss\).*expert_devices=2"):
        Engine.from_checkpoint(ckpt, EngineConfig(expert_devices=2, miss="auto"))
    with pytest.raises(ValueError, match="expert_devices must be >= 1"):
        EngineConfig(expert_devices=0)


def test_strata_plan_shows_each_devices_figures_and_all_of_theirs(ckpt, capsys):
    args = ["plan", str(ckpt), "--hbm", "200KiB", "--host-mem", "100KiB", "--workspace", "64KiB",
            "--max-len", "32", "--batch-capacity", "2"]
    assert main([*args, "--expert-devices", "3"]) == 0  # planned without the devices present
    out = capsys.readouterr().out
    assert "HBM budget 200.00 KiB (0.00 GB) per device; 3 devices: 600.00 KiB in all" in out
    assert "over 3 devices owning 12, 10, 10" in out and "2 / 2 / 2" in out
    assert main(args) == 0
    assert "per device" not in capsys.readouterr().out
