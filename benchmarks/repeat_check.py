"""Do repeats of one engine give the same tokens? A diagnostic for the GPU machine.

The H200 seed ladder's first rungs (bf16 seed-125b shape, 6 layers, 8 GB of tier 1, disk read
during decode) gave different greedy tokens on each of their three repeats, while the CPU gives
the same bits (this script, and tests/runtime/engine/test_engine.py). This runs a small seed-shaped
model (qwen2_moe, top-4, 32 experts, shared expert, skewed routing) through engines that differ
in one thing each, three repeats of the same prompts per engine, and writes per repeat whether
the tokens equal those of the engine that holds every expert in HBM, and the first differing
step:

- `resident`: every expert in a device slot (the reference);
- `host`: every expert not in HBM in tier 1 (no disk, no resume compiled);
- `disk`: tier 1 smaller than the experts (disk loads, steps resumed from a layer);
- `disk-lfru`: the same with cache slots and next-gate prefetch.

Run it twice on the GPU, the second time with XLA_FLAGS=--xla_gpu_deterministic_ops=true: if
only the first run differs, an XLA op without a fixed order is to blame; if `host` differs,
neither the disk tier nor the resume is.

With `--checkpoint`, the engines run on that checkpoint instead (the seed ladder's, on the GPU
machine): `resident` holds every expert in HBM, `ladder-naive` is the ladder's first rung (24
GB of HBM, 12 GB of tier 1, the cold experts read from disk), `ladder-no-disk` the same with
every expert in tier 1. Two diagnostics reach into the engine's privates to vary one thing
each: `ladder-no-disk-resume` compiles the resume into a rung that never stalls, and
`ladder-naive-from-start` runs a stalled step again from its first layer. `--check-tiers`
compares every occupied slot with its expert read from disk after the repeats.

    python -m benchmarks.repeat_check --out $OUT [--dtype float32]
    python -m benchmarks.repeat_check --out $OUT --checkpoint /tmp/strata_seed6_bf16 \
        --prompts 2 --prompt-len 32 --new 16 --batch 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.formats.checkpoint import CheckpointReader
from strata_jax.tools import synth
from strata_runtime.engine import offload as engine_module
from strata_runtime.engine.config import EngineConfig
from strata_runtime.engine.offload import Engine
from strata_runtime.lab.bench import synthetic_prompts
from strata_runtime.residency.tiers import Residency
from tests.runtime.contract import run_rows

SHAPE = "seed-mini"
ENGINES = {
    "resident": {},
    "host": dict(resident_experts=8, policy="static", cache_fraction=0.0),
    "disk": dict(resident_experts=8, host_experts=16, policy="static", cache_fraction=0.0),
    "disk-lfru": dict(resident_experts=8, host_experts=12, policy="lfru", cache_fraction=0.25,
                      predictor="next-gate"),
}
LADDER = dict(hbm_budget="24GB", host_budget="12GB", policy="static", cache_fraction=0.0)
ON_CHECKPOINT = {"resident": {}, "ladder-no-disk": {**LADDER, "host_budget": None},
                 "ladder-naive": LADDER,
                 # two diagnostics of the disk tier's difference on the GPU: the no-disk rung
                 # with the resume compiled (no stall ever), and the naive rung re-running a
                 # stalled step from its first layer instead of the stalled one
                 "ladder-no-disk-resume": {**LADDER, "host_budget": None},
                 "ladder-naive-from-start": LADDER}


MAX_RESUMES = 1000


class _ResumeCompiled(Engine):
    """An engine whose steps are compiled with the resume even when no step can stall."""

    def _shares(self, heat):
        shares = super()._shares(heat)
        self._disk_possible = True
        return shares


@contextlib.contextmanager
def _from_start_resumes():
    """A stalled step runs again from its first layer (the engine's resume at layer -1). A
    layer's loads may evict an earlier layer's experts, which the next run then stalls on:
    past `MAX_RESUMES` runs again, this raises instead of looping."""
    real_step, real_spliced = engine_module.step, engine_module._spliced

    resumes = [0]

    def resume(layer, saved):
        resumes[0] += 1
        if resumes[0] > MAX_RESUMES:
            raise RuntimeError(f"{MAX_RESUMES} runs again from the first layer: the loads of "
                               "one layer evict another's")
        return real_step.Resume(layer=jax.device_put(jnp.full((), -1, jnp.int32),
                                                     layer.sharding), saved=saved)

    engine_module.step = types.SimpleNamespace(**{**vars(real_step), "Resume": resume})
    engine_module._spliced = lambda done, record, layer: (
        record if layer < 0 else real_spliced(done, record, layer))
    try:
        yield
    finally:
        engine_module.step, engine_module._spliced = real_step, real_spliced


def _engine(name: str, reader, config):
    if name == "ladder-no-disk-resume":
        return contextlib.nullcontext(), _ResumeCompiled(reader, config)
    if name == "ladder-naive-from-start":
        return _from_start_resumes(), Engine(reader, config)
    return contextlib.nullcontext(), Engine(reader, config)


ADMITTED: list[tuple[int, tuple[int, int], int, tuple[int, int] | None]] = []
"""(id of the residency, key, host slot, the slot's occupant before) of each admission from
disk (`--check-tiers`)."""


@contextlib.contextmanager
def _logged_admissions():
    real = Residency.admit_host

    def admit_host(self, key, arrays, victim):
        before = list(self.host_key)
        real(self, key, arrays, victim)
        slot = int(self.host_page[key])
        ADMITTED.append((id(self), key, slot, before[slot]))

    Residency.admit_host = admit_host
    try:
        yield
    finally:
        Residency.admit_host = real


def _equal(engine: Engine, pool, slot: int, key) -> bool:
    return all(np.array_equal(np.asarray(getattr(pool, n)[slot]), np.asarray(a))
               for n, a in engine._load(key).items())


def tier_mismatches(engine: Engine, limit: int = 8) -> dict[str, object]:
    """Slots whose contents differ from their expert as read from disk now: tier-1 slots and
    device slots (the keys and, for tier 1, the admissions into the slot, up to `limit` of
    each, and the counts checked). A slot written from a load that was still in flight, or
    overwritten while a copy read it, shows here."""
    out: dict[str, object] = {}
    for share in engine.shares:
        res = share.residency
        mine = [a[1:] for a in ADMITTED if a[0] == id(res)]
        for tier, pool, keys in (("host", res.host, res.host_key),
                                 ("device", res.pool, res.slot_key)):
            if pool is None:
                continue
            bad, details, checked = [], [], 0
            for slot, key in enumerate(keys):
                if key is None:
                    continue
                checked += 1
                if _equal(engine, pool, slot, key):
                    continue
                bad.append(list(key))
                if tier == "host" and len(details) < limit:
                    into = [a for a in mine if a[1] == slot]
                    details.append({"slot": slot, "admissions_into_slot": len(into),
                                    "key_admitted": sum(a[0] == key for a in mine),
                                    "holds_previous": bool(
                                        into and into[-1][2] is not None
                                        and _equal(engine, pool, slot, into[-1][2]))})
            out[f"{tier}_{share.device}"] = {"checked": checked, "differ": len(bad),
                                             "keys": bad[:limit], "admissions": details}
    return out


def seed_mini() -> None:
    """A small model of the seed-125b family (top-4 of 32, a shared expert) as a shape."""
    synth.SHAPES.setdefault(SHAPE, synth.SHAPES["seed-125b"].replace(
        vocab_size=512, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
        head_dim=64, num_experts=32, expert_intermediate_size=128,
        shared_intermediate_size=512))


def first_difference(a: list[list[int]], b: list[list[int]]) -> list[int | None]:
    """Per request: the first step whose token differs (None: equal)."""
    return [next((i for i, (x, y) in enumerate(zip(ra, rb, strict=True)) if x != y), None)
            for ra, rb in zip(a, b, strict=True)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--path", default="/tmp/strata_seed_mini")
    ap.add_argument("--checkpoint", help="run resident and the ladder's rungs on this one")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engines", help="comma-separated names (default: all; a name given "
                                      "again runs a fresh engine again)")
    ap.add_argument("--logits", action="store_true",
                    help="every prompt in its own row at once (--prompts <= --batch): compare "
                         "each decode step's logits too, which show a prefill that differs "
                         "in its low bits even where the tokens agree")
    ap.add_argument("--check-tiers", action="store_true",
                    help="after the repeats, compare every occupied tier-1 and device slot "
                         "of each engine but resident with its expert read from disk "
                         "(tier_mismatches)")
    ap.add_argument("--row-chunks", choices=("default", "on", "off"), default="default",
                    help="EngineConfig.row_chunks for every engine")
    args = ap.parse_args()
    if args.checkpoint:
        path, engines = Path(args.checkpoint), ON_CHECKPOINT
    else:
        seed_mini()
        path, engines = Path(f"{args.path}_{args.dtype}"), ENGINES
        if not (path / "config.json").exists():
            synth.synthesize(SHAPE, path, skew=0.7, seed=0, dtype=args.dtype)
    # a name given twice runs twice, each time a fresh engine (start-up races show there)
    engines = ([(n, engines[n]) for n in args.engines.split(",")] if args.engines
               else list(engines.items()))
    reader = CheckpointReader(path)
    prompts = synthetic_prompts(reader.config.vocab_size, args.prompts, args.prompt_len, 0)
    reference = None
    for name, knobs in engines:
        chunks = {"default": None, "on": True, "off": False}[args.row_chunks]
        config = EngineConfig(batch_capacity=args.batch, row_chunks=chunks,
                              max_len=args.prompt_len + args.new + 8, **knobs)
        t0 = time.perf_counter()
        logits = []
        patch, engine = _engine(name, reader, config)
        ADMITTED.clear()
        logged = _logged_admissions() if args.check_tiers else contextlib.nullcontext()
        with logged, patch, engine:
            if args.logits:
                runs = [run_rows(engine, prompts, args.new) for _ in range(args.repeats)]
                outs = [t.tolist() for t, _ in runs]
                logits = [np.asarray(lg, np.float32) for _, lg in runs]
            else:
                outs = [engine.generate(prompts, args.new) for _ in range(args.repeats)]
            stats = engine.stats()
            tiers = (tier_mismatches(engine) if args.check_tiers and name != "resident"
                     else None)
        if reference is None:
            reference, reference_logits = outs[0], logits[:1]
        row = {"engine": name, "checkpoint": str(path), "batch": args.batch, "knobs": knobs,
               "row_chunks": args.row_chunks,
               "xla_flags": os.environ.get("XLA_FLAGS", ""),
               "equal_to_resident": [o == reference for o in outs],
               "first_difference": [first_difference(o, reference) for o in outs],
               "equal_across_repeats": all(o == outs[0] for o in outs),
               "disk_loads": stats.get("disk_loads"), "seconds": time.perf_counter() - t0,
               "startup_s": engine.startup}
        if tiers is not None:
            row["tier_mismatches"] = tiers
        if logits:  # per repeat, per decode step: the largest |logit - resident's|
            row["max_abs_logit_diff"] = [
                np.abs(lg - reference_logits[0]).max(axis=(1, 2)).tolist() for lg in logits]
        print(json.dumps(row), flush=True)
        with open(Path(args.out) / "repeat_check.jsonl", "a") as f:  # kept if a later one is cut
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
