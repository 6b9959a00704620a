"""The offload engine's knobs (`EngineConfig`; every one an ablation axis, each with its
command-line flag generated from it: `cli/engine_flags.py`) and the checks made of them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax

from strata_jax.formats.checkpoint import CheckpointReader
from strata_jax.formats.config import ModelConfig
from strata_jax.model.misses import MODES as MISS_MODES
from strata_jax.model.misses import MissRates
from strata_jax.ops.int4_kernel import Int4Tiles, int4_fits
from strata_jax.step import programs as step
from strata_runtime.residency.cache_policy import (
    check_admit,
    check_policy,
)
from strata_runtime.residency.ledger import (
    ModelBytes,
    default_max_len,
    parse_bytes,
)

DEQUANT = ("device", "host")
LAYOUTS = ("auto", "rows", "tiles")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Engine knobs; every one is an ablation axis."""

    hbm_budget: int | str | None = None
    """HBM for the whole model ("24GB", bytes; None: every expert gets a slot), of each device
    over several (`expert_devices`). The ledger splits it among dense weights, KV cache,
    staging, workspace and expert slots."""
    host_budget: int | str | None = None
    """Pinned host memory for tier 1 (None: every expert), all devices' shares together; the
    rest is read from disk."""
    expert_devices: int = 1
    """Devices the experts are spread over, the first that many of `jax.devices()`
    (`strata_jax.step.expert_parallel`): each owns the same share of every layer's experts, holds
    them in its own slots, staging halves and share of tier 1, and copies its own misses over
    its own link; the dense weights and the KV cache are on every device. Per device:
    `hbm_budget`, `workspace`, `staging_slots`, `resident_experts` and the cache slots (the
    policy runs on each device's own); the whole engine's: `host_budget` and `host_experts`,
    split evenly into the devices' shares. Misses are fetched (`miss` "fetch"). Under
    `jax.distributed` (one process per host, each making the same engine calls) the devices
    are all processes' and must span every process: each process drives its own."""
    batch_capacity: int = 16
    """Rows of the compiled step (requests decoded together)."""
    max_len: int = 256
    """KV positions per row (prompt + generated tokens). `strata serve` and the lm-eval model,
    given none, take the model's context within the budget (`context_max_len`)."""
    prefill_rows: int | None = None
    """Most prompts whose chunks share a prefill program (`strata_jax.batching.packing`; None: the
    batch
    capacity): each expert a program routes to is read and copied once for all of them, and
    the running rows take their decode steps in the same programs (they ride along). 1: each
    prompt alone and nothing riding, so a row's bits never depend on what else runs."""
    prefill_chunk: int | None = None
    """Prompt tokens per prefill program (a power of two >= 8): each expert the chunk routes to
    is copied once per layer for all of them. None: the ledger's choice, the longest up to
    `step.MAX_PREFILL_CHUNK` whose workspace fits the budget (`plan_for`); the resident API
    with the same chunk gives the same bits."""
    workspace: int | str | None = None
    """HBM the ledger keeps for activations and compiler scratch. None: the scratch XLA reports
    for the compiled step programs at the planned layout (`runtime/residency/workspace.py`); a size
    ("256MiB", bytes) fixes it."""
    predictor: str = "next-gate"
    """"next-gate" copies layer l+1's predicted experts while layer l runs; "none" does not."""
    policy: str = "lfru"
    """Cache slots' eviction: "static" (no cache slots), "lru", "lfu", "lfru"."""
    cache_fraction: float = 0.25
    """Share of the HBM expert slots run as a cache (the rest: the pinned hottest experts)."""
    cache_admit: str = "hotter"
    """When the cache slots are full, an expert copied on demand takes the policy's victim's
    slot "always", or only if its routing heat exceeds the victim's ("hotter"): an admission
    copies the expert over the link a second time (`runtime/residency/cache_policy.py`)."""
    rebalance_every: int = 0
    """Decode steps between re-rankings of the pinned set by routing heat (0: never)."""
    hysteresis: float = 0.1
    """An expert replaces a pinned one only if (1 + hysteresis) times hotter."""
    heat_decay: float = 0.9
    """EMA decay of the per-step routing counts (the heat)."""
    timeline: bool = False
    """Record step and disk-load spans for `export_timeline`."""
    record_trace: str | None = None
    """Write every step's routing (per layer, the experts each live row picked, and the
    row's request) to this trace file (`runtime/engine/trace.py`) when the engine closes, for
    `strata trace stats` and `strata simulate`."""
    replay_trace: str | None = None
    """Route by this trace's picks (`runtime/engine/trace.py`) instead of the router's: a systems
    study of a recorded or synthetic workload's expert traffic (the tokens then follow the
    forced routing). Decode steps take the trace's decode steps in order, prefill chunks its
    prefill steps, cycling; replaying a run's own trace on the same prompts gives its
    tokens."""
    dequant: str = "device"
    """int4 experts: "device" (packed over the wire, dequantized in the kernel) or "host"
    (dequantized to bf16 when loaded into tier 1: 4x the bytes per copy)."""
    fetch_threads: int = 4
    """Threads reading tier 2 (disk) and filling tier 1, bound to the GPU's NUMA node."""
    disk_lookahead: bool = True
    """On a disk stall, also load the later layers' disk experts that the stalled step routed
    to, where tier 1 has room outside the step's routed experts: most steps then stall once,
    not at layer after layer. False: only the stalled layer's (ablations)."""
    read_ahead: int = 0
    """Experts found only on disk that tier 1 may read ahead of need, by routing heat, in the
    background between decode steps (at most this many reading at once; each replaces a tier-1
    expert colder by the hysteresis: `runtime/residency/read_ahead.py`). 0: tier 1 takes disk
    experts
    only in stalls, which already keep it ranked by the same heat (docs/design.md,
    "Read-ahead")."""
    resident_experts: int | None = None
    """Override the ledger's count of experts with HBM slots, each device's (ablations)."""
    host_experts: int | None = None
    """Override the count of experts in tier 1, all devices' together (ablations)."""
    heat_file: str | None = None
    """Routing statistics (`Engine.save_heat`) that rank the tiers at start-up."""
    staging_slots: int | None = None
    """Experts per staging half; None: what one layer can need in a decode step (ledger)."""
    row_chunks: bool | None = None
    """Each expert multiplies only its own rows; None: the kernel's default."""
    int4_tiles: Int4Tiles | None = None
    """Tiles of the Mosaic int4 kernel; None: tuned per expert shape."""
    weight_layout: str = "auto"
    """int4 slots "rows" as stored or "tiles" tile-major; "auto": tiles where the Mosaic
    kernel runs (Hopper)."""
    miss: str = "fetch"
    """A miss is "fetch": copied over the link (the resident bits); "host": computed on the
    host cores where tier 1 holds it; "auto": each layer's misses split between the two so
    the layer finishes soonest (`miss_rates`). Host compute rounds differently: a tested
    tolerance, not bits (docs/design.md, "Host compute of misses")."""
    miss_rates: str | None = None
    """The rates "auto" splits by, "link=GB/s,host=GB/s,row=X" (the host kernel's one-row
    rate, and each further row's relative cost); None: measured at start-up (the split,
    and so the rounding, then depends on the run: fix them to reproduce one)."""
    host_threads: int | None = None
    """Cores the host kernel uses; None: all but a quarter (`host_kernel.default_threads`: the
    rest keep the device fed)."""

    def __post_init__(self) -> None:
        check_policy(self.policy)
        check_admit(self.cache_admit)
        if self.predictor not in step.PREDICTORS:
            raise ValueError(f"predictor must be one of {step.PREDICTORS}, "
                             f"got {self.predictor!r}")
        if self.dequant not in DEQUANT:
            raise ValueError(f"dequant must be one of {DEQUANT}, got {self.dequant!r}")
        if self.weight_layout not in LAYOUTS:
            raise ValueError(f"weight_layout must be one of {LAYOUTS}, "
                             f"got {self.weight_layout!r}")
        if self.miss not in MISS_MODES:
            raise ValueError(f"miss must be one of {MISS_MODES}, got {self.miss!r}")
        if self.miss_rates is not None:
            MissRates.parse(self.miss_rates)
        if self.expert_devices < 1:
            raise ValueError(f"expert_devices must be >= 1, got {self.expert_devices}")
        if self.read_ahead < 0:
            raise ValueError(f"read_ahead must be >= 0, got {self.read_ahead}")
        if self.prefill_chunk is not None:
            step.check_prefill_chunk(self.prefill_chunk)
        if self.prefill_rows is not None and self.prefill_rows < 1:
            raise ValueError(f"prefill_rows must be >= 1, got {self.prefill_rows}")
        if self.batch_capacity < 1 or self.max_len < 8:
            raise ValueError(f"need batch_capacity >= 1 and max_len >= 8, got "
                             f"{self.batch_capacity}, {self.max_len}")


def check_expert_devices(config: EngineConfig) -> None:
    """What experts over several devices do not do (yet): compute misses on the host."""
    if config.expert_devices > 1 and config.miss != "fetch":
        raise ValueError(f"miss={config.miss!r} (--miss) computes misses on the host, which is "
                         f"not built for expert_devices={config.expert_devices} "
                         "(--expert-devices): use miss='fetch'")


def check_int4_tiles(tiles: Int4Tiles | None, cfg: ModelConfig) -> None:
    d, f = cfg.hidden_size, cfg.expert_intermediate_size
    if tiles is not None and not int4_fits(d, f, tiles):
        raise ValueError(f"EngineConfig.int4_tiles={tiles} does not tile the experts "
                         f"(hidden {d}, intermediate {f}): see int4_kernel.int4_fits")


def context_max_len(config: EngineConfig, reader: CheckpointReader) -> tuple[EngineConfig, str]:
    """`config` with the max_len `ledger.default_max_len` gives the checkpoint (the model's
    context within the budget: the HBM budget offloaded, else the first device's memory less
    the model's bytes, where the device tells it), and why: what `strata serve` and the
    lm-eval model take when no max_len is given."""
    model = ModelBytes.from_reader(reader)
    if config.hbm_budget is not None:
        budget = parse_bytes(config.hbm_budget)
    else:
        limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
        budget = max(0, limit - model.total) if limit else None
    length, why = default_max_len(model, reader.config.max_position, config.batch_capacity,
                                  budget)
    return dataclasses.replace(config, max_len=length), why
