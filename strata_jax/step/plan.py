"""What a step program is compiled for (`StepPlan`) and where it finds every expert besides
its device pool (`Tiers`): the types the model's modules take, apart from the programs that
apply them (`step.programs`), so the model never imports the programs."""

from __future__ import annotations

from dataclasses import dataclass

import chex
import jax

from strata_jax.model.misses import MODES as MISS_MODES
from strata_jax.model.misses import HostWork
from strata_jax.ops.int4_kernel import Int4Tiles
from strata_jax.ops.pool import ExpertPool

PREDICTORS = ("none", "next-gate")


@dataclass(frozen=True, kw_only=True)
class StepPlan:
    """What is compiled into a step program besides the model's shape."""

    staging: int = 0
    """Experts per staging half. 0: every expert has a slot and no miss handling is compiled.
    Otherwise the last `2 * staging` slots of the pool are the two staging halves."""
    predictor: str = "none"
    """"next-gate": while layer l computes, copy the experts that layer l+1's router picks on
    layer l's post-attention stream into the staging half layer l+1 reads first."""
    row_chunks: bool | None = None
    """Each expert multiplies only its own rows (`moe.routed_outputs`); None = the kernel's
    default for the row count."""
    int4_tiles: Int4Tiles | None = None
    """Tiles of the Mosaic int4 kernel, where it runs (None = tuned per expert shape)."""
    unroll: bool | None = None
    """Unroll the layer scan: no device loop (on a GPU each iteration costs a predicate read)
    and static layer slices instead of a copy of each layer's weights, for a longer compile.
    None: unrolled on GPUs, rolled elsewhere (where the loop is cheap and the compile is
    what costs). Every program compiles without excess precision (`COMPILER_OPTIONS`), so
    rolled and unrolled, resident and offloaded programs give the same bits
    (docs/design.md, "Measured")."""
    sample: bool = False
    """Compile the sampler into decode (`sampling.sample`): rows with a temperature draw,
    the others take the argmax of their penalized logits. False: the plain argmax, for
    batches whose live rows are all greedy (the sampler's filters are not free)."""
    resume: bool = False
    """Compile the resume from a layer (docs/design.md, "Disk stalls"): the step saves the
    input of the first layer that routed to an expert found only on disk, and the host, once
    it has loaded that layer's experts, runs the step again from that layer (the layers
    before it pass their input through and write nothing). Tier 1 then needs room for one
    layer's experts, not a whole step's. For engines whose tier 1 does not hold every
    expert."""
    replay: bool = False
    """Route by replayed picks (the step's `forced` argument, [L, N, k], -1: the router's)
    instead of the router's top-k: a routing trace replayed (docs/design.md, "The routing
    trace")."""
    miss: str = "fetch"
    """What a miss costs (`misses`): "fetch" copies it into a staging half (the resident
    bits); "host" computes it on the host cores where tier 1 holds it; "auto" splits each
    layer's misses between the two by `Tiers.host_work`'s rates. Host compute rounds
    differently (docs/design.md, "Host compute of misses")."""

    expert_axis: str | None = None
    """The mesh axis the expert slots are sharded over (`expert_parallel`: the step runs
    under `shard_map`, each device serves its own experts from its own slots, staging halves
    and pinned-host share, and a `psum` joins the picks, exactly, since every pick comes from
    one device); None: one device."""

    def __post_init__(self) -> None:
        if self.unroll is None:  # resolved now: the plan is a static argument, part of the key
            object.__setattr__(self, "unroll", jax.default_backend() == "gpu")
        if self.staging < 0:
            raise ValueError(f"StepPlan.staging must be >= 0, got {self.staging}")
        if self.predictor not in PREDICTORS:
            raise ValueError(f"StepPlan.predictor must be one of {PREDICTORS}, "
                             f"got {self.predictor!r}")
        if self.expert_axis is not None and self.miss != "fetch":
            raise ValueError("host compute of misses (StepPlan.miss) is not built for experts "
                             "over several devices")
        if self.miss not in MISS_MODES:
            raise ValueError(f"StepPlan.miss must be one of {MISS_MODES}, got {self.miss!r}")


@chex.dataclass(frozen=True)
class Tiers:
    """Where every expert lies besides the device pool (which travels apart, so the staging
    halves can be donated). `page` int32 [L, E]: an expert's pool slot, or -1; `host`: the
    pinned-host tier 1, slots on axis 0 (None when every expert has a device slot);
    `host_page` int32 [L, E]: an expert's host slot, or -1 when it lies only on disk;
    `host_work`: the host kernel's tier and rates, for plans whose `miss` is not "fetch";
    `owner` int32 [L, E]: over an expert axis, the device that owns each expert (whose slots,
    tier-1 share and link serve it; `expert_parallel.owners`), None on one device."""

    page: jax.Array
    host: ExpertPool | None
    host_page: jax.Array
    host_work: HostWork | None = None
    owner: jax.Array | None = None
