"""Runs in a subprocess of tests/step/test_expert_parallel.py and tests/runtime/
test_engine_devices.py (`launch`): JAX's device count and distributed runtime are fixed when
it starts, so the settings need a process of their own. One process runs several jobs
(`JOB -- JOB ...`, each job's JSON in a list) over its 4 devices, starting JAX once:

    python -m tests.ep_worker CKPT devices N,N,...   -> JSON: per N, tokens and logits equal?
    python -m tests.ep_worker CKPT offload N:R:S:P ...  -> JSON: per setting (N devices, R
        experts per layer and device in HBM, S per staging half, predictor P), tokens equal,
        and whether every routed expert was served once (hit, prefetched or copied)
    python -m tests.ep_worker CKPT process ID PORT   -> JSON: this process's tokens (2 devices,
        a job alone)
    python -m tests.ep_worker CKPT engine-process ID PORT  -> JSON: the offload engine over
        the 4 devices of two processes (PROCESS_CASE): this process's view of its tokens,
        a digest of every decode step's logits, its stats and what its shares hold (a job
        alone)
    python -m tests.ep_worker CKPT engine N:CASE ...  -> JSON: per setting (the offload engine
        over N devices with the knobs of ENGINE_CASES[CASE]), tokens and every decode step's
        logits equal to the one-device resident engine's, whether every device's tables hold
        only its own experts, whether its per-device counters sum to the totals, and the
        counters that say each mechanism ran; N:bench: `strata bench`'s per-device figures
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEP = "--"  # between two jobs of one worker
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 4, 90, 3, 17]]
NEW = 8


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a test's subprocess of `devices` CPU devices: this process's flags (so
    both compile alike: `make test` lowers the LLVM optimization level) with the device count
    set, not added to one already there."""
    keep = [f for f in os.environ.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join([*keep, f"--xla_force_host_platform_device_count={devices}"])


def launch(*jobs: list[str]) -> subprocess.Popen:
    """This worker in a subprocess of its own (the repository first on its path), running
    `jobs` (each [CKPT, MODE, ARGS...]) in turn."""
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    args = [a for i, job in enumerate(jobs) for a in ([SEP] if i else []) + list(job)]
    return subprocess.Popen([sys.executable, "-m", "tests.ep_worker", *args], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result(proc: subprocess.Popen, timeout: int = 600) -> list[dict]:
    """Each job's JSON, as a worker launched by `launch` printed it (its stderr's tail if it
    failed)."""
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def _generate(model, sampled: bool):
    from strata_jax.step.sampling import SamplingParams

    sampling = SamplingParams(temperature=0.8, top_k=20, seed=5) if sampled else None
    kw = {"sampling": sampling} if sampled else {}
    return strata_jax.generate(model, PROMPTS, max_new_tokens=NEW, batch_capacity=2, **kw)


def _cli(ckpt: str, n: int) -> list[int]:
    """`strata generate --expert-devices n`'s new ids of the first prompt, in the rows of
    `_generate` (its programs, compiled once)."""
    import contextlib
    import io

    from strata_runtime.cli.main import main

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        ids = ",".join(map(str, PROMPTS[0]))
        assert main(["generate", ckpt, "--prompt-ids", ids, "--max-new-tokens", str(NEW),
                     "--batch-capacity", "2", "--expert-devices", str(n), "--json", "-"]) == 0
    return json.loads(text.getvalue())["requests"][0]["new_ids"]


def devices(ckpt: str, counts: list[int]) -> dict:
    import numpy as np

    from strata_jax.step import loaded

    model = strata_jax.load(ckpt)
    tokens = np.array([[3, 5, 6, 7, 8, 9]], np.int32)
    ref = {s: _generate(model, s) for s in (False, True)}
    ref_logits = strata_jax.api.logits(model, tokens)
    out = {"devices": len(jax.devices())}
    for n in counts:
        sharded = loaded.shard(model, n)
        out[n] = {"greedy": _generate(sharded, False) == ref[False],
                  "sampled": _generate(sharded, True) == ref[True],
                  "logits": bool(np.array_equal(strata_jax.api.logits(sharded, tokens),
                                                ref_logits)),
                  "pool_shards": len(sharded.experts.w1.addressable_shards)}
        # the CLI loads with strata_jax.load(expert_devices=n): no device holds every expert
        out[n]["cli"] = _cli(ckpt, n) == strata_jax.generate(
            model, PROMPTS[:1], max_new_tokens=NEW, batch_capacity=2)[0]
    return out


ENGINE_SHAPE = {"batch_capacity": 4, "max_len": 32}
HEAT = "the reference run's heat"  # a case's heat_file: the one-device engine's routing
ENGINE_CASES = {
    "resident": {},  # every expert in its owner's slots
    # staging passes, cache admissions, the next-gate prefetch and rebalancing swaps
    "tight": {"resident_experts": 3, "staging_slots": 1, "cache_fraction": 0.34,
              "policy": "lfru", "predictor": "next-gate", "rebalance_every": 2},
    # experts dealt to the devices by heat, one tier-1 expert per device: stalls and resumes
    "disk": {"resident_experts": 2, "host_experts": 4, "cache_fraction": 0.5,
             "heat_file": HEAT},
    "bench": {},  # `strata bench --expert-devices N --resident-experts 1`: per-device figures
}
ENGINE_PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8], [42]]  # <= 8 tokens: one prefill program
ENGINE_NEW = 6
COUNTED = ("hits", "fetched", "issued", "admissions", "disk_loads")  # per device and in all


def _owners_only(engine) -> bool:
    """Every device's page tables and slots hold only experts it owns."""
    for share in engine.shares:
        r, mine = share.residency, engine.layout.owner == share.device
        held = [k for k in r.slot_key + r.host_key if k is not None]
        if (r.page[~mine] >= 0).any() or (r.host_page[~mine] >= 0).any():
            return False
        if not all(mine[k] for k in held) or not all(mine[k] for k in share.pinned):
            return False
    return True


def _engine_case(ckpt: str, n: int, case: str, reference) -> dict:
    import numpy as np

    from strata_jax.step.expert_parallel import owners
    from strata_runtime.engine.config import EngineConfig
    from strata_runtime.engine.offload import Engine
    from tests.runtime.contract import run_rows

    if case == "bench":
        return _bench(ckpt, n)
    knobs = {k: reference[2] if v == HEAT else v for k, v in ENGINE_CASES[case].items()}
    config = EngineConfig(**ENGINE_SHAPE, expert_devices=n, **knobs)
    with Engine.from_checkpoint(ckpt, config) as engine:
        tokens, logits = run_rows(engine, ENGINE_PROMPTS, ENGINE_NEW)
        stats = engine.stats()
        own = _owners_only(engine)
    cfg = engine.cfg
    devices = stats["devices"]
    return {"tokens": bool(np.array_equal(tokens, reference[0])),
            "logits": bool(np.array_equal(logits, reference[1])),
            "owners": own, "devices": len(devices),
            "by_heat": not np.array_equal(engine.layout.owner, owners(cfg.num_layers,
                                                               cfg.num_experts, n)),
            "sums": all(sum(d[k] for d in devices) == getattr(engine.counters, k)
                        for k in COUNTED)
            and sum(d["h2d_bytes"] for d in devices) == stats["h2d_bytes"],
            **{k: stats[k] for k in ("tier0_experts", "admissions", "disk_loads",
                                     "resumed_layers", "rebalance_swaps", "misses_per_step")}}


def _bench(ckpt: str, n: int) -> dict:
    """`strata bench` over n devices: its summary's per-device link figures."""
    import contextlib
    import io
    import tempfile

    from strata_runtime.cli.main import main

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.jsonl")
        with contextlib.redirect_stdout(io.StringIO()) as text:
            assert main(["bench", ckpt, "--expert-devices", str(n), "--resident-experts", "1",
                         "--batch-capacity", "4", "--max-len", "32", "--prompts", "3",
                         "--prompt-len", "5", "--new", "4", "--repeats", "1",
                         "--warmup-new", "2", "--json-out", out]) == 0
        with open(out) as f:
            summary = json.loads(f.read().splitlines()[-1])
    devices = summary["devices"]
    return {"devices": len(devices), "lines": text.getvalue().count("\ndevice "),
            "h2d_sum": sum(d["h2d_bytes"] for d in devices) == summary["bytes"]["h2d"],
            "rates": all(d["h2d_gbps"] > 0 and d["link_gbps"] > 0 and d["link_busy"] > 0
                         for d in devices)}


def engine(ckpt: str, settings: list[str]) -> dict:
    """The offload engine over several devices against the one-device resident engine."""
    import tempfile

    from strata_runtime.engine.config import EngineConfig
    from strata_runtime.engine.offload import Engine
    from tests.runtime.contract import run_rows

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        heat = os.path.join(tmp, "heat.json")
        with Engine.from_checkpoint(ckpt, EngineConfig(**ENGINE_SHAPE)) as one:
            assert one.layout.resident
            tokens, logits = run_rows(one, ENGINE_PROMPTS, ENGINE_NEW)
            one.save_heat(heat)
        for setting in settings:
            n, case = setting.split(":")
            out[setting] = _engine_case(ckpt, int(n), case, (tokens, logits, heat))
    return out


def process(ckpt: str, pid: int, port: str) -> dict:
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=pid)

    model = strata_jax.load(ckpt, expert_devices=len(jax.devices()))
    return {"process": pid, "devices": len(jax.devices()), "local": len(jax.local_devices()),
            "tokens": _generate(model, False)}


# per device: 2 HBM slots (one a cache slot), 2 tier-1 experts; half the experts on disk only
PROCESS_CASE = {"hbm_budget": "200KiB", "host_budget": "100KiB", "workspace": "64KiB",
                "cache_fraction": 0.5, "rebalance_every": 2}
PROCESS_PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8], [42]]  # one prefill bucket: one compile
PROCESS_STATS = ("processes", "expert_devices", "tier0_experts", "tier1_experts", "disk_loads",
                 "resumed_layers", "admissions", "rebalance_swaps", "failed_requests")


def digest(logits) -> str:
    """A digest of float arrays' bits (equal digests: bit-identical logits)."""
    import hashlib

    import numpy as np

    return hashlib.sha256(np.ascontiguousarray(logits, np.float32).tobytes()).hexdigest()


def engine_process(ckpt: str, pid: int, port: str) -> dict:
    """One of two processes running the same offload engine calls over all 4 devices: the
    tokens, a request sampled without a seed, then the same engine on a copy of the
    checkpoint with a chunk of the last device's (process 1's) corrupt; and the refusal of
    devices that leave out a process."""
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=pid)
    from strata_jax.step.sampling import SamplingParams
    from strata_runtime.engine.config import EngineConfig
    from strata_runtime.engine.offload import Engine
    from tests.runtime.contract import run_rows

    config = EngineConfig(**ENGINE_SHAPE, expert_devices=len(jax.devices()), **PROCESS_CASE)
    with Engine.from_checkpoint(ckpt, config) as engine:
        tokens, logits = run_rows(engine, PROCESS_PROMPTS, ENGINE_NEW)
        more = engine.generate(PROCESS_PROMPTS, ENGINE_NEW)  # through the scheduler
        bad = _corrupt_copy(ckpt, engine, pid)  # by these prompts' routing
        # each process's scheduler draws its own seed: the engine takes the first's
        sampled = engine.generate(PROCESS_PROMPTS[:1], ENGINE_NEW,
                                  SamplingParams(temperature=0.8, top_k=20))
        stats = engine.stats()
        shares = [s.device for s in engine.shares]
        own = _owners_only(engine)
    with Engine.from_checkpoint(bad[0], config) as engine:  # the same programs: no compile
        failing = [[r.tokens, r.error] for r in engine.generate_results(PROCESS_PROMPTS,
                                                                        ENGINE_NEW)]
    try:
        Engine.from_checkpoint(ckpt, dataclasses.replace(config, expert_devices=2))
        refused = None
    except ValueError as err:
        refused = str(err)
    devices = stats["devices"]
    return {"process": pid, "local": len(jax.local_devices()), "shares": shares,
            "owners": own, "tokens": tokens.tolist(), "logits": digest(logits),
            "generate": more, "sampled": sampled, **{k: stats[k] for k in PROCESS_STATS},
            "fetched": sum(d["fetched"] for d in devices),
            "devices": [{k: d[k] for k in COUNTED} for d in devices],
            "corrupt": bad[1], "failing": failing, "refused": refused}


def _corrupt_copy(ckpt: str, engine, pid: int) -> tuple[str, list[int]]:
    """A copy of `ckpt` with one chunk broken: the least routed expert of the last device
    that it does not pin (it is read into tier 1 or from disk, by process 1 alone); the
    first process writes it, both wait for it. Returns (its path, [layer, expert])."""
    import shutil

    from jax.experimental import multihost_utils

    from strata_runtime.residency.heat import ranked

    last = len(engine.layout.devices) - 1
    theirs = [k for k in ranked(engine.cfg, None) if engine.layout.owner[k] == last][2:]
    layer, expert = min((k for k in theirs if engine.heat.counts[k] > 0),
                        key=lambda k: engine.heat.counts[k])
    bad = f"{ckpt}-bad"
    if pid == 0:
        shutil.copytree(ckpt, bad)
        target = Path(bad, "experts", "w1", "c", str(layer), str(expert), "0", "0")
        data = bytearray(target.read_bytes())
        data[7] ^= 0x55
        target.write_bytes(bytes(data))
    multihost_utils.sync_global_devices("the corrupt copy is written")
    return bad, [int(layer), int(expert)]


def _jobs(argv: list[str]) -> list[list[str]]:
    jobs = [[]]
    for a in argv:
        if a == SEP:
            jobs.append([])
        else:
            jobs[-1].append(a)
    return jobs


if __name__ == "__main__":
    jobs = _jobs(sys.argv[1:])
    distributed = any(job[1] in ("process", "engine-process") for job in jobs)
    assert not distributed or len(jobs) == 1, "a process job runs alone"
    count = 2 if distributed else 4
    os.environ["XLA_FLAGS"] = xla_flags(count)
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_default_matmul_precision", "highest")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    import strata_jax

    results = []
    for ckpt, mode, *rest in jobs:
        if mode == "devices":
            results.append(devices(ckpt, [int(n) for n in rest[0].split(",")]))
        elif mode == "engine":
            results.append(engine(ckpt, rest))
        elif mode == "engine-process":
            results.append(engine_process(ckpt, int(rest[0]), rest[1]))
        else:
            results.append(process(ckpt, int(rest[0]), rest[1]))
    print("RESULT " + json.dumps(results), flush=True)
