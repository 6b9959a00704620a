"""`strata bench`: fingerprinted JSON lines (a row per repeat and a summary), the same tokens
for the same seed, a median inside its interval, the bound's arithmetic."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax import api
from strata_jax.ops.pool import ExpertPool
from strata_runtime.cli.main import main
from strata_runtime.engine.stats import DeviceCounts, PhaseCounts
from strata_runtime.lab import ceilings, kernel_rates
from strata_runtime.lab.bench import median_interval, synthetic_prompts
from strata_runtime.lab.cost_model import (
    HardwareProfile,
    bound,
    prediction_error,
    run_prediction,
)
from strata_runtime.lab.counting import Counts, Sizes, device_figures
from strata_runtime.lab.fingerprint import hardware_fingerprint
from strata_runtime.lab.kernel_rates import dense_kernel_gbps, expert_kernel_gbps, step_link
from tests.helpers import random_arrays, random_mlp_layers, tiny_config, write_checkpoint

FINGERPRINT = ("gpu", "device_kind", "jax", "jaxlib", "host_cores", "numa_nodes",
               "pinned_h2d_gbps", "pcie_gen", "git", "python")
# 3 of the 12 experts in HBM: demand copies and prefetches happen
FLAGS = ["--resident-experts", "3", "--host-experts", "8", "--batch-capacity", "2",
         "--max-len", "32", "--prompts", "3", "--prompt-len", "5", "--new", "6",
         "--repeats", "3", "--warmup-new", "2"]


KEEP_PROGRAMS = True  # the bench runs share their compiled programs (tests/runtime/conftest.py)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "ck"
    write_checkpoint(tiny_config(), path, seed=3)
    return path


def bench(ckpt, out, *extra: str) -> list[dict]:
    assert main(["bench", str(ckpt), *FLAGS, "--json-out", str(out), *extra]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.fixture(scope="module")
def rows(ckpt, tmp_path_factory):
    return bench(ckpt, tmp_path_factory.mktemp("out") / "a.jsonl", "--seed", "7")


def test_rows_carry_the_fingerprint_the_seed_and_the_repeats(rows, capsys):
    assert [r["kind"] for r in rows] == ["repeat"] * 3 + ["summary"]
    assert [r["repeat"] for r in rows[:3]] == [0, 1, 2]
    for r in rows:
        assert r["seed"] == 7
        assert set(FINGERPRINT) <= r["fingerprint"].keys()
        assert r["fingerprint"]["gpu"] == ("cpu" if jax.default_backend() == "cpu"
                                           else jax.devices()[0].device_kind)
        predicted = r["predicted"]
        assert predicted["binding"] in ("hbm", "compute", "pcie", "host-read", "disk", "engine")
        # the engine's own host time a step (measured) paces the loop where it is the longer
        assert predicted["inputs"]["engine_s"] > 0
        if r["kind"] == "repeat":  # the engine's host work and the calls that return early
            c = r["counts"]
            assert predicted["inputs"]["engine_s"] == pytest.approx(
                (c["host_s"] + c["launch_s"]) / c["decode_steps"])
        assert predicted["step_ms"] >= 1e3 * predicted["inputs"]["engine_s"] * (1 - 1e-9)
        decode = r["counts"]["decode"] if r["kind"] == "repeat" else None
        if decode is not None and decode["disk_loads"]:  # the decode steps' own load rate
            inputs = r["predicted"]["inputs"]
            assert inputs["disk_gbps"] == pytest.approx(
                decode["disk_loads"] * inputs["bytes_per_expert"] / decode["disk_stall_s"] / 1e9)
            assert 0 < inputs["rerun"] <= decode["resumed_layers"]
        assert r["bound"]["binds"] in r["bound"]["seconds"]
        assert 0 < r["bound"]["bound_tok_s"]
    repeat = rows[0]
    assert repeat["counts"]["new_tokens"] == 3 * 6
    assert repeat["counts"]["fetched"] + repeat["counts"]["prefetched"] > 0  # offloaded
    assert repeat["stats"]["tier0_experts"] == 3
    s = rows[-1]
    assert s["settings"] == {"prompts": 3, "prompt_len": 5, "new": 6, "repeats": 3,
                             "warmup_new": 2, "seed": 7, "hardware": "measured"}
    for r in rows[:3]:  # the short warm-up compiled every program the timed runs call
        assert r["stats"]["compile_s"] == 0
    assert s["config"]["resident_experts"] == 3 and s["config"]["batch_capacity"] == 2
    assert s["tokens_equal_across_repeats"]
    assert s["tok_s"]["values"] == [r["tok_s"] for r in rows[:3]]
    phases = s["build_phases_s"]  # where the engine's start-up went
    assert set(phases) == {"ledger", "pools", "dense", "links"} and min(phases.values()) >= 0
    assert sum(phases.values()) <= s["build_s"]
    for key in ("pinned_h2d_gbps", "host_read_gbps", "hbm_read_gbps", "matmul_tflops"):
        assert s["ceilings"][key] > 0
    assert s["expert_read_gbps"] > 0  # the engine's expert kernel, timed on its pool
    assert s["dense_read_gbps"] > 0  # and its dense matmuls
    # a layer's worth of the warm-up's routed experts: 2 rows at top-2 route at most 4
    assert 1 <= s["expert_read_experts"] <= 4
    assert "kernel_rate_errors" not in s
    for key in ("expert_read_gbps", "dense_read_gbps"):
        assert all(r["predicted"]["inputs"][key] == s[key] for r in rows)
    link = s["step_link"]  # the link as the decode steps use it: the step's copies
    assert link["copy_bytes"] == s["sizes"]["bytes_per_expert"] and link["gbps"] > 0
    assert link["copies"] >= 1
    assert all(r["predicted"]["inputs"]["link_gbps"]
               == min(link["gbps"], s["ceilings"]["host_read_gbps"]) for r in rows)
    assert set(s["predicted"]["inputs"]) >= {"batch", "routed", "misses", "hidden",
                                             "bytes_per_expert", "flops_per_token"}
    # the summary's prediction is made from the repeats' summed counts: read against the
    # decode rate of the same sums, not the median of the repeats
    pooled = (sum(r["counts"]["decode_tokens"] for r in rows[:3])
              / sum(r["counts"]["decode_s"] for r in rows[:3]))
    assert s["decode_tok_s_pooled"] == pytest.approx(pooled)
    assert s["predicted"]["compare_with"] == "decode_tok_s_pooled"
    assert prediction_error(s) == pytest.approx(s["predicted"]["tok_s"] / pooled - 1)
    assert prediction_error(rows[0]) == pytest.approx(
        rows[0]["predicted"]["tok_s"] / rows[0]["decode_tok_s"] - 1)


def test_the_interval_contains_the_median(rows):
    for key in ("tok_s", "decode_tok_s"):
        iv = rows[-1][key]
        assert iv["lo"] <= iv["median"] <= iv["hi"]
        assert iv["median"] == pytest.approx(float(np.median(iv["values"])))
        assert "bootstrap" in iv["method"] and iv["level"] == 0.95
    rng = np.random.default_rng(0)
    for n in range(1, 9):
        values = rng.lognormal(size=n).tolist()
        iv = median_interval(values, seed=n)
        assert iv["lo"] <= iv["median"] <= iv["hi"]
        assert min(values) <= iv["lo"] and iv["hi"] <= max(values)
        assert iv == median_interval(values, seed=n)  # seeded


def test_same_seed_same_tokens_another_seed_other_prompts(ckpt, rows, tmp_path, capsys):
    again = bench(ckpt, tmp_path / "b.jsonl", "--seed", "7")
    assert again[-1]["tokens_sha256"] == rows[-1]["tokens_sha256"]
    assert [r["tokens_sha256"] for r in again[:3]] == [r["tokens_sha256"] for r in rows[:3]]
    other = bench(ckpt, tmp_path / "c.jsonl", "--seed", "8", "--repeats", "1")
    assert other[-1]["tokens_sha256"] != rows[-1]["tokens_sha256"]
    printed = capsys.readouterr().out
    assert "tok/s (generated / wall of the timed generate)" in printed
    assert "bound (counted bytes and FLOPs / ceilings)" in printed
    assert "cost model (profile measured)" in printed
    assert "kernel rates (timed on the engine): expert kernel " in printed
    assert synthetic_prompts(97, 3, 5, 7) == synthetic_prompts(97, 3, 5, 7)
    assert synthetic_prompts(97, 3, 5, 7) != synthetic_prompts(97, 3, 5, 8)


def _silu(x):
    return x / (1 + np.exp(-x))


def test_expert_kernel_rate_counts_the_slots_it_reads_chained_in_one_program(monkeypatch):
    """The rate is the bytes of the slots applied (at most the pool's) over the kernel's best
    time per call: with the clock fixed at one second for the program of `CHAIN` calls, the
    bytes times `CHAIN`. The program is the chain itself: each call applies the slots to the
    last one's (tanh-bounded) output, as a float64 reference computes it."""
    cfg = tiny_config()
    rng = np.random.default_rng(0)
    d, f, slots = cfg.hidden_size, cfg.expert_intermediate_size, 6
    weights = [rng.standard_normal(shape) * 0.3 for shape in ((slots, d, f), (slots, d, f),
                                                             (slots, f, d))]
    pool = ExpertPool(*(jnp.asarray(w, jnp.float32) for w in weights))
    assert expert_kernel_gbps(pool, d, "float32", rows=2, experts=4) > 0  # really timed
    timed = []  # `chained_seconds` times the chain by `ceilings.best_seconds`
    monkeypatch.setattr(ceilings, "best_seconds",
                        lambda fn, reps, warm_s=0.0: timed.append(fn()) or 1.0)
    per_slot, chain = 3 * d * f * 4, ceilings.CHAIN
    assert expert_kernel_gbps(pool, d, "float32", rows=2, experts=4) == chain * 4 * per_slot / 1e9
    assert expert_kernel_gbps(pool, d, "float32", rows=2, experts=99) == chain * 6 * per_slot / 1e9
    x = np.random.default_rng(0).standard_normal((2, d))  # the rows the function draws
    w1, w3, w2 = (w[:4] for w in weights)
    for _ in range(chain):
        x = np.tanh(np.einsum("cnf,cfd->nd", _silu(np.einsum("nd,cdf->cnf", x, w1))
                              * np.einsum("nd,cdf->cnf", x, w3), w2))
    np.testing.assert_allclose(np.asarray(timed[0]), x, rtol=1e-3, atol=5e-4)  # f32, 8 deep


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_dense_rate_runs_the_models_decode_without_its_experts(monkeypatch, family):
    """The dense rate's program is the model's own step without its experts: its logits and
    routing equal the resident model's forward of the same one-token rows where every expert
    gives zeros (random dense weights, zero expert weights; DeepSeek's dense-MLP layers and
    latent attention included), and its bytes are the dense params but the embedding table,
    as `counting.Sizes` counts them."""
    cfg = tiny_config(family)
    g, layers, experts = random_arrays(cfg)
    mlp = random_mlp_layers(cfg)
    params = api.from_arrays(cfg, g, layers, experts, mlp).params
    assert dense_kernel_gbps(cfg, params, rows=3, cache_len=8, unroll=False) > 0  # timed
    timed = []
    monkeypatch.setattr(kernel_rates, "best_seconds",
                        lambda fn, reps, warm_s=0.0: timed.append(fn()) or 1.0)
    dense = sum(a.nbytes for a in jax.tree.leaves(params)) - params["params"]["embed"].nbytes
    assert dense_kernel_gbps(cfg, params, rows=3, cache_len=8, unroll=True) == dense / 1e9
    logits, routed = (np.asarray(a) for a in timed[0])
    ids = np.random.default_rng(0).integers(cfg.vocab_size, size=3)[:, None]
    silent = api.from_arrays(cfg, g, layers, {k: np.zeros_like(v) for k, v in experts.items()},
                             mlp)
    np.testing.assert_allclose(logits, api.logits(silent, ids), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(routed, api.routing(silent, ids))


def test_the_step_link_copies_as_many_experts_as_a_layer_did_by_the_steps_copy():
    cpu = jax.devices("cpu")[0]
    pinned = jax.sharding.SingleDeviceSharding(cpu, memory_kind="pinned_host")
    rng = np.random.default_rng(0)
    host = ExpertPool(*(jax.device_put(rng.standard_normal((6, 8, 16)).astype(np.float32),
                                       pinned) for _ in range(3)))
    decode = PhaseCounts(calls=2, fetched=17, prefetched=7)  # 24 copies, 2 steps, 3 layers
    link = step_link(host, decode, layers=3, devices=1)
    assert link["copies"] == 4 and link["copy_bytes"] == 3 * 8 * 16 * 4 and link["gbps"] > 0
    # two links copy side by side: half each
    assert step_link(host, decode, layers=3, devices=2)["copies"] == 2
    more = PhaseCounts(calls=2, fetched=90)  # more than the pool holds
    assert step_link(host, more, layers=3, devices=1)["copies"] == 6
    # nothing copied: no link to measure
    assert step_link(host, PhaseCounts(calls=2), layers=3, devices=1) is None
    assert step_link(None, decode, layers=3, devices=1) is None  # resident: no tier 1


def test_the_bound_by_hand():
    c = Counts(wall_s=2.0, new_tokens=100, decode_steps=10, decode_tokens=90,
               prefill_tokens=10, prefill=PhaseCounts(calls=2, routed=8, fetched=1),
               decode=PhaseCounts(calls=10, routed=42, fetched=3, issued=6, prefetched=5,
                                  admissions=2, disk_loads=3))
    sizes = Sizes(bytes_per_expert=10**6, dense_bytes=10**7, kv_bytes=4 * 10**6, rows=4,
                  flops_per_token=10**6)
    ceilings = {"pinned_h2d_gbps": 1.0, "host_read_gbps": 2.0, "hbm_read_gbps": 100.0,
                "matmul_tflops": 0.1}
    hbm = 12 * 1e7 + 10 * 4e6 + 2 * 1e6 + 50 * 1e6  # dense, decode KV, prefill KV, experts
    b = bound(c, sizes, ceilings, disk_gbps=0.5)
    assert b["seconds"]["hbm"] == pytest.approx(hbm / 100e9)
    assert b["seconds"]["compute"] == pytest.approx(100 * 1e6 / 0.1e12)
    assert b["seconds"]["pcie"] == pytest.approx(12e6 / 1e9)  # (4 + 6 + 2) copies
    assert b["seconds"]["disk"] == pytest.approx(3e6 / 0.5e9)
    serial = max(hbm / 100e9, 1e-3) + 12e-3 + 6e-3
    assert b["bound_s"] == pytest.approx(serial)
    assert b["bound_tok_s"] == pytest.approx(100 / serial)
    assert b["ratio"] == pytest.approx(serial / 2.0)
    assert b["binds"] == "pcie"
    assert bound(c, sizes, ceilings, disk_gbps=None)["disk_unbounded"]
    faster = bound(c, sizes, ceilings, disk_gbps=0.5, link_gbps=1.5)  # the step link's rate
    assert faster["seconds"]["pcie"] == pytest.approx(12e6 / 1.5e9)
    capped = bound(c, sizes, ceilings, disk_gbps=0.5, link_gbps=3.0)  # a copy's source DRAM
    assert capped["seconds"]["host-read"] == pytest.approx(12e6 / 2e9)
    # 8 misses computed on the host (4 ms at 2 GB/s) beside the 12 ms of copies: hidden
    hosted = bound(dataclasses.replace(c, decode=dataclasses.replace(c.decode, hosted=8)),
                   sizes, ceilings, disk_gbps=0.5)
    assert hosted["seconds"]["host-compute"] == pytest.approx(4e-3)
    assert hosted["bound_s"] == pytest.approx(serial)
    # 30 of them (15 ms) outlast the copies
    hosted = bound(dataclasses.replace(c, prefill=dataclasses.replace(c.prefill, hosted=30)),
                   sizes, ceilings, disk_gbps=0.5)
    assert hosted["bound_s"] == pytest.approx(serial + 3e-3)


def test_over_devices_the_link_term_is_the_busiest_devices_by_hand():
    """12 copies over two links, 9 (4 + 3 + 2) on one: the bound waits for that one's 9 ms;
    each device's bytes and rate over the engine's 0.5 s."""
    devices = (DeviceCounts("a", 2.0, fetched=4, issued=3, admissions=2),
               DeviceCounts("b", 4.0, issued=3))
    c = Counts(wall_s=2.0, new_tokens=100, decode_steps=10, decode_tokens=90, decode_s=0.4,
               prefill_tokens=10, prefill_s=0.1, prefill=PhaseCounts(calls=2, routed=10),
               decode=PhaseCounts(calls=10, routed=40, fetched=4, issued=6, admissions=2),
               devices=devices)
    sizes = Sizes(bytes_per_expert=10**6, dense_bytes=10**7, kv_bytes=4 * 10**6, rows=4,
                  flops_per_token=10**6)
    ceilings = {"pinned_h2d_gbps": 1.0, "host_read_gbps": 2.0, "hbm_read_gbps": 100.0,
                "matmul_tflops": 0.1}
    assert bound(c, sizes, ceilings, disk_gbps=None)["seconds"]["pcie"] == pytest.approx(9e-3)
    a, b = device_figures(c, sizes)
    assert (a["h2d_bytes"], b["h2d_bytes"]) == (9 * 10**6, 3 * 10**6)
    assert a["h2d_GB_per_step"] == pytest.approx(9e-3 / 12)
    assert (a["h2d_gbps"], b["h2d_gbps"]) == pytest.approx((18e-3, 6e-3))  # GB/s over 0.5 s
    assert (a["link_busy"], b["link_busy"]) == pytest.approx((9e-3, 1.5e-3))
    summed = c + c
    assert summed.devices[0].fetched == 8 and summed.devices[1].device == "b"


def test_the_prediction_reads_the_decode_steps_by_hand():
    """Prefill chunks that route and stall far more than the decode steps: the inputs are the
    decode steps' means, the disk rate theirs, and the all-phase rate only without their
    stall time."""
    decode = PhaseCounts(calls=10, routed=40, hits=10, prefetched=6, fetched=24, issued=8,
                         admissions=5, disk_loads=4, disk_stall_s=0.02, resumed_layers=6)
    c = Counts(wall_s=3.0, new_tokens=40, decode_steps=10, decode_tokens=30, decode_s=1.0,
               prefill_tokens=64, prefill_s=2.0, decode=decode,
               prefill=PhaseCounts(calls=2, routed=2 * 12, hits=2, fetched=2 * 10,
                                   admissions=6, disk_loads=20, disk_stall_s=1.0,
                                   resumed_layers=8))
    sizes = Sizes(bytes_per_expert=10**6, dense_bytes=10**7, kv_bytes=4 * 10**6, rows=4,
                  flops_per_token=10**6)
    hw = HardwareProfile(name="hand", pcie_gbps=10.0, host_read_gbps=20.0, hbm_gbps=100.0,
                         hbm_gib=1.0, matmul_tflops=1.0, host_cores=2)
    layers = 3
    got = run_prediction(c, sizes, hw, layers)["inputs"]
    assert got["batch"] == pytest.approx(3.0)
    assert got["routed"] == pytest.approx(4.0)  # all calls: 64 / 12
    assert got["misses"] == pytest.approx(3.0)  # (24 + 6) / 10
    assert got["hidden"] == pytest.approx(0.2)  # 6 / 30
    assert got["admissions"] == pytest.approx(0.5)
    assert got["unused"] == pytest.approx(0.2)  # (8 issued - 6 used) / 10
    assert got["disk_loads"] == pytest.approx(0.4)  # all calls: 2.0
    assert got["rerun"] == pytest.approx(6 / (3 * 10))
    assert got["hosted"] == 0.0
    assert got["disk_gbps"] == pytest.approx(4e6 / 0.02 / 1e9)  # 0.2; all calls: 0.0235
    # decode loads without measurable stall time: the rate of every call's loads
    still = dataclasses.replace(c, decode=dataclasses.replace(decode, disk_stall_s=0.0))
    assert run_prediction(still, sizes, hw, layers)["inputs"]["disk_gbps"] == pytest.approx(
        24e6 / 1.0 / 1e9)  # 24 loads in the prefill's 1.0 s
    # only the prefill chunks read the disk: no disk term in a decode step
    calm = dataclasses.replace(c, decode=dataclasses.replace(
        decode, disk_loads=0, disk_stall_s=0.0, resumed_layers=0))
    inputs = run_prediction(calm, sizes, hw, layers)["inputs"]
    assert inputs["disk_loads"] == 0 and inputs["rerun"] == 0 and inputs["disk_gbps"] is None
    assert (c + c).decode == PhaseCounts(**{k: 2 * v for k, v in
                                            dataclasses.asdict(decode).items()})
    doc = json.loads(json.dumps(c.doc()))
    assert (doc["decode"]["routed"], doc["routed"], doc["prefill_chunks"]) == (40, 64, 2)
    assert run_prediction(dataclasses.replace(c, decode=PhaseCounts()), sizes, hw,
                          layers) is None


def test_fingerprint_reads_numa_nodes_and_git():
    fp = hardware_fingerprint()
    assert fp["host_cores"] >= 1 and fp["jax"] == jax.__version__
    assert fp["git"] is None or len(fp["git"]["commit"]) == 40
    assert fp["numa_nodes"] is None or fp["numa_nodes"] >= 1
