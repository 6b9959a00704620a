"""One HBM budget, split and explained (`strata plan`).

The user gives one HBM budget. The ledger takes out, in order: the dense weights (embeddings,
lm_head, final norm, every layer's attention / norms / router / shared expert), the KV cache
for `batch_capacity` sequences of `max_len` tokens, the two staging buffers a transfer engine
double-buffers experts through, and a workspace for activations and compiler scratch. What
remains becomes the expert slot pool (tier 0). Experts that do not fit in HBM live in pinned host
memory (tier 1) as far as the host budget goes, and on disk (tier 2) after that.

If every expert fits next to the dense weights, KV cache and workspace, the model runs fully
resident: every expert gets a slot and no staging buffers are reserved (nothing is ever fetched).

Over several devices (`devices`, `strata_jax.step.expert_parallel`) the HBM budget is each device's:
each holds the dense weights, the KV cache, its workspace and staging and the slots of its own
share of the experts. The host budget is the whole tier 1, split evenly into the devices'
shares.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from strata_jax.formats.checkpoint import (
    ArraySpec,
    dense_layer_arrays,
    expert_arrays,
    global_shapes,
    mixer_arrays,
    mixer_counts,
    mlp_layer_arrays,
    numpy_dtype,
)
from strata_jax.formats.config import ModelConfig

KB, MB, GB, TB = 10**3, 10**6, 10**9, 10**12
KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40
UNITS = {
    "b": 1, "kb": KB, "mb": MB, "gb": GB, "tb": TB,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
}  # fmt: skip
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.ASCII | re.IGNORECASE)

DEFAULT_MAX_LEN = 4096
DEFAULT_BATCH = 16
# Activations, logits, compiler scratch and allocator slack: 5 % of the budget, at least 256 MiB.
WORKSPACE_FRACTION = 0.05
WORKSPACE_FLOOR = 256 * MiB
# A pass's copies (half the staging slots) should take long enough on the link to hide the host
# round trip between passes; larger staging only takes HBM from pinned experts. Measured on the
# H200 (Mixtral-8x7B bf16 experts of 336 MiB, B=16, 8 GiB budget): 2 slots 50.2 tok/s, one
# decode step's worth (8) 40.4 with the per-layer engine (benchmarks/archive/NOTES.md); the
# one-program step: 46.8 and 37.4 (benchmarks/results/step_decode.md).
STAGING_HALF_BYTES = 256 * MiB


class BudgetError(ValueError):
    """The HBM budget cannot hold the fixed components plus a minimum expert pool."""

    def __init__(self, message: str, ledger: Ledger, shortfall: int) -> None:
        super().__init__(message)
        self.ledger = ledger
        self.shortfall = shortfall


def parse_bytes(value: int | str) -> int:
    """'24GB' (10**9), '24GiB' (2**30), '512MiB', '1.5 GiB', '1000' or an int -> bytes."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"expected a byte count or a size like '24GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"byte count must be non-negative, got {value}")
        return value
    m = _SIZE.match(value)
    unit = m[2].lower() if m else ""
    if m is None or (unit and unit not in UNITS):
        raise ValueError(
            f"cannot parse size {value!r}: expected a number with an optional unit, one of "
            "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)"
        )
    return int(Fraction(m[1]) * UNITS[unit or "b"])


def fmt_bytes(n: int) -> str:
    """Human-readable binary size: 1536 -> '1.50 KiB'."""
    sign, n = ("-" if n < 0 else ""), abs(n)
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{n} B"


def _nbytes(specs: dict[str, ArraySpec]) -> int:
    return sum(math.prod(shape) * numpy_dtype(dtype).itemsize for shape, dtype in specs.values())


@dataclass(frozen=True)
class ModelBytes:
    """Byte sizes the ledger needs from a model, as stored in its checkpoint."""

    global_bytes: int  # embed, lm_head (if untied) and final norm; all stay resident
    dense_per_layer: int  # attention, norms, router, shared expert of one layer
    bytes_per_expert: int  # all stored arrays of one routed expert (scales included)
    num_layers: int
    experts_per_layer: int
    top_k: int
    kv_bytes_per_token: int  # the cache of every layer for one token, in the model dtype
    mlp_layers_bytes: int = 0  # the dense-MLP layers before the MoE ones, all of them
    mixer_bytes: int = 0  # the token mixers stored apart (a model with linear layers), all
    state_bytes_per_row: int = 0  # the linear layers' conv and recurrent state of one row

    def __post_init__(self) -> None:
        if self.bytes_per_expert <= 0 or self.num_layers <= 0 or self.experts_per_layer <= 0:
            raise ValueError(f"degenerate model sizes: {self}")

    @property
    def dense(self) -> int:
        return (self.global_bytes + self.num_layers * self.dense_per_layer
                + self.mlp_layers_bytes + self.mixer_bytes)

    @property
    def num_experts(self) -> int:
        return self.num_layers * self.experts_per_layer

    @property
    def expert_bytes(self) -> int:
        return self.num_experts * self.bytes_per_expert

    @property
    def total(self) -> int:
        return self.dense + self.expert_bytes

    @classmethod
    def from_specs(
        cls,
        config: ModelConfig,
        expert_specs: dict[str, ArraySpec],
        dense_specs: dict[str, ArraySpec],
        quant: dict[str, str] | None = None,
    ) -> ModelBytes:
        """From per-expert and per-layer array specs (`expert_arrays`, `dense_layer_arrays`);
        `quant`: the dense quantization the dense-MLP layers are stored in."""
        quant = quant or {"dense": "none", "experts": "none"}
        globals_specs = {k: (s, config.dtype) for k, s in global_shapes(config).items()}
        itemsize = numpy_dtype(config.dtype).itemsize
        return cls(
            global_bytes=_nbytes(globals_specs),
            dense_per_layer=_nbytes(dense_specs),
            bytes_per_expert=_nbytes(expert_specs),
            num_layers=config.num_layers,
            experts_per_layer=config.num_experts,
            top_k=config.top_k,
            kv_bytes_per_token=config.attention_layers * config.cache_width * itemsize,
            mlp_layers_bytes=config.dense_layers * _nbytes(mlp_layer_arrays(config, quant)),
            mixer_bytes=sum(n * _nbytes(mixer_arrays(config, kind, quant))
                            for kind, n in mixer_counts(config).items()),
            state_bytes_per_row=(_nbytes(dict(enumerate(config.linear_state_specs(1))))
                                 if config.linear_layers else 0),
        )

    @classmethod
    def from_config(
        cls, config: ModelConfig, quantization: dict[str, str] | None = None
    ) -> ModelBytes:
        quant = quantization or {"dense": "none", "experts": "none"}
        return cls.from_specs(
            config, expert_arrays(config, quant), dense_layer_arrays(config, quant), quant
        )

    @classmethod
    def from_reader(cls, reader: Any) -> ModelBytes:
        """From a `CheckpointReader` (uses its `config`, `expert_specs` and `dense_specs`)."""
        return cls.from_specs(reader.config, reader.expert_specs, reader.dense_specs,
                              reader.quantization)


KV_SHARE = 4
"""A default max_len's KV cache takes at most 1/KV_SHARE of the HBM budget: the rest holds
the dense weights, the workspace and the expert slots, whose hits make offloaded decode fast
(docs/design.md, "Budgets")."""
MIN_DEFAULT_MAX_LEN = 256
"""The shortest max_len a budget shortens the default to."""


def default_max_len(model: ModelBytes, context: int | None, batch_capacity: int,
                    budget: int | None) -> tuple[int, str]:
    """The max_len of a run that names none, and why: the model's `context` (None: not known,
    `DEFAULT_MAX_LEN`), halved (not below `MIN_DEFAULT_MAX_LEN`) while the KV cache of
    `batch_capacity` rows takes more than 1/`KV_SHARE` of `budget` bytes (None: not known,
    then at most `DEFAULT_MAX_LEN`)."""
    length = context or DEFAULT_MAX_LEN
    why = (f"the model's context, {context} tokens" if context else
           f"{DEFAULT_MAX_LEN} tokens (the model names no context)")
    if budget is None and length > DEFAULT_MAX_LEN:
        length, why = DEFAULT_MAX_LEN, f"{why}, cut to {DEFAULT_MAX_LEN} (no memory size known)"
    start = length
    kv = batch_capacity * model.kv_bytes_per_token
    while budget is not None and length > MIN_DEFAULT_MAX_LEN and kv * length > budget // KV_SHARE:
        length = max(MIN_DEFAULT_MAX_LEN, length // 2)
    if length < start:
        why += (f", halved to {length} so that the KV cache of {batch_capacity} rows "
                f"({fmt_bytes(kv * length)}) takes at most 1/{KV_SHARE} of "
                f"{fmt_bytes(budget)}")
    return length, f"max_len {length}: {why} (--max-len sets it)"


def device_experts(model: ModelBytes, devices: int) -> tuple[int, ...]:
    """The experts each of `devices` devices owns: an equal count of every layer, the first
    devices one more where the layer's experts do not divide evenly."""
    if not 1 <= devices <= model.experts_per_layer:
        raise ValueError(f"expert_devices must be in [1, {model.experts_per_layer}] (the "
                         f"experts of a layer), got {devices}")
    per_layer, extra = divmod(model.experts_per_layer, devices)
    return tuple(model.num_layers * (per_layer + (d < extra)) for d in range(devices))


def even_share(count: int, total: int, devices: int, most: int) -> int:
    """Each device's share of `count` of the `total` experts held over `devices` devices that
    own at most `most` each: all its own when `count` covers every expert, else an even share
    (rounded up)."""
    return most if count >= total else -(-count // devices)


@dataclass(frozen=True)
class Ledger:
    """Where every byte of the HBM budget goes, and which tier each expert lives in. Over
    several devices the HBM lines are each device's (`hbm_budget` is per device) and the
    expert counts are totals."""

    hbm_budget: int
    dense: int
    kv_cache: int
    staging: int  # two buffers of `staging_slots` experts each
    workspace: int
    pool_slots: int  # per device
    bytes_per_expert: int
    staging_slots: int
    num_experts: int
    host_budget: int | None  # None: unlimited; over several devices all their shares
    host_slots: int  # all devices' tier 1 together
    batch_capacity: int
    max_len: int
    resident_budget: int  # the smallest HBM budget (per device) that holds every expert
    owned: tuple[int, ...]  # the experts each device owns (`device_experts`)
    prefill_chunk: int = 0  # tokens per prefill program the workspace holds (0: not measured)
    recurrent: bool = False  # kv_cache holds the linear layers' per-row state too

    @property
    def devices(self) -> int:
        return len(self.owned)

    @property
    def most_owned(self) -> int:
        """The experts of the device that owns most."""
        return max(self.owned)

    @property
    def host_share(self) -> int:
        """Tier-1 experts of each device (`even_share` of `host_slots`)."""
        return even_share(self.host_slots, self.num_experts, self.devices, self.most_owned)

    @property
    def pool(self) -> int:
        return self.pool_slots * self.bytes_per_expert

    @property
    def used(self) -> int:
        return self.dense + self.kv_cache + self.staging + self.workspace + self.pool

    @property
    def free(self) -> int:
        """Unassigned HBM (less than one expert slot); negative when over budget."""
        return self.hbm_budget - self.used

    @property
    def tier0(self) -> int:
        """Experts in HBM slots (on every device)."""
        return sum(min(self.pool_slots, n) for n in self.owned)

    def device_tiers(self) -> list[tuple[int, int, int]]:
        """Each device's (tier 0, tier 1, tier 2) expert counts, of the experts it owns."""
        tiers = []
        for owned in self.owned:
            hbm = min(self.pool_slots, owned)
            host = min(owned - hbm, self.host_share)
            tiers.append((hbm, host, owned - hbm - host))
        return tiers

    @property
    def tier1(self) -> int:
        """Experts in pinned host memory (on every device's share)."""
        return sum(host for _, host, _ in self.device_tiers())

    @property
    def tier2(self) -> int:
        """Experts read from disk on demand."""
        return self.num_experts - self.tier0 - self.tier1

    @property
    def resident(self) -> bool:
        return self.tier0 == self.num_experts

    def render(self) -> str:
        """A table of components (bytes, GiB, MB, share of budget; over several devices each
        device's, and all devices' together) and the tier split (per device too)."""
        return "\n".join([*self._component_lines(), "", *self._tier_lines()])

    def _component_lines(self) -> list[str]:
        staging = f"2 x {self.staging_slots} experts" if self.staging_slots else "none: resident"
        rows = [
            ("dense + shared weights", self.dense),
            (f"KV cache ({self.batch_capacity} seq x {self.max_len} tokens"
             f"{', recurrent state' if self.recurrent else ''})", self.kv_cache),
            (f"staging ({staging})", self.staging),
            ("workspace (activations, scratch" + (
                f"; {self.prefill_chunk}-token prefill)" if self.prefill_chunk else ")"),
             self.workspace),
            (f"expert pool ({self.pool_slots} slots)", self.pool),
            ("free" if self.free >= 0 else "OVER BUDGET", self.free),
        ]
        n = self.devices
        budget = f"HBM budget {fmt_bytes(self.hbm_budget)} ({self.hbm_budget / GB:.2f} GB)"
        every = f"{f'x {n} GiB':>10}" if n > 1 else ""
        if n > 1:
            budget += f" per device; {n} devices: {fmt_bytes(n * self.hbm_budget)} in all"
        lines = [budget, f"  {'component':<42}{'bytes':>16}{'GiB':>10}{'MB':>12}{'share':>8}"
                         + every]
        for name, b in [*rows, ("total", self.hbm_budget)]:
            share = b / self.hbm_budget if self.hbm_budget else 0.0
            lines.append(f"  {name:<42}{b:>16,}{b / GiB:>10.3f}{b / MB:>12.2f}{share:>8.1%}"
                         + (f"{n * b / GiB:>10.3f}" if n > 1 else ""))
        return lines

    def _tier_lines(self) -> list[str]:
        host = "unlimited" if self.host_budget is None else fmt_bytes(self.host_budget)
        n, total = self.devices, self.num_experts
        lines = [f"experts: {total} of {fmt_bytes(self.bytes_per_expert)} each"]
        if n > 1:
            share = "" if self.host_budget is None else (
                f", the host budget in {n} shares of {fmt_bytes(self.host_budget // n)}")
            lines[0] += (f", over {n} devices owning {', '.join(map(str, self.owned))}{share} "
                         "(last column: per device)")
        per_device = self.device_tiers()
        for i, (label, count) in enumerate((
            ("tier 0  HBM slots", self.tier0),
            (f"tier 1  pinned host (budget {host})", self.tier1),
            ("tier 2  disk", self.tier2),
        )):
            line = f"  {label:<42}{count:>8}{count / total:>8.1%}"
            if n > 1:
                line += "    " + " / ".join(str(t[i]) for t in per_device)
            lines.append(line)
        if self.resident:
            lines.append("fully resident: every expert has an HBM slot, no staging buffers")
        else:
            lines.append(
                f"{self.tier0 / total:.1%} of experts in HBM; fully resident needs an HBM "
                f"budget of {fmt_bytes(self.resident_budget)}"
                + (" per device" if n > 1 else "")
            )
        return lines


def default_staging_slots(model: ModelBytes, batch_capacity: int, devices: int = 1) -> int:
    """Experts per staging buffer: what one layer can need in a decode step,
    min(experts per layer, batch_capacity * top_k), but no more than two halves of
    `STAGING_HALF_BYTES` each (at least 2, so passes can alternate). Over `devices` devices,
    what one device's share of a layer can need."""
    step = min(-(-model.experts_per_layer // devices), batch_capacity * model.top_k)
    halves = 2 * max(1, math.ceil(STAGING_HALF_BYTES / model.bytes_per_expert))
    return min(step, halves)


def workspace_bytes(
    hbm_budget: int, fraction: float = WORKSPACE_FRACTION, floor: int = WORKSPACE_FLOOR
) -> int:
    """Activation and compile headroom: `fraction` of the budget, at least `floor` bytes."""
    return max(int(hbm_budget * fraction), floor)


def resident_budget(
    need: int, fraction: float = WORKSPACE_FRACTION, floor: int = WORKSPACE_FLOOR
) -> int:
    """Smallest budget B with need + workspace_bytes(B) <= B (B - workspace is monotone in B)."""
    lo, hi = need, max(need + floor, math.ceil(need / (1 - fraction)) + 1)
    while need + workspace_bytes(hi, fraction, floor) > hi:  # float rounding guard
        hi *= 2
    while lo < hi:
        mid = (lo + hi) // 2
        if need + workspace_bytes(mid, fraction, floor) <= mid:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _check_args(
    batch_capacity: int, max_len: int, fraction: float, staging: int | None, min_pool: int | None
) -> None:
    if batch_capacity < 1 or max_len < 0:
        raise ValueError(f"need batch_capacity >= 1, max_len >= 0; got {batch_capacity}, {max_len}")
    if not 0 <= fraction < 1:
        raise ValueError(f"workspace fraction must be in [0, 1), got {fraction}")
    if staging is not None and staging < 1:
        raise ValueError(f"staging_slots must be >= 1, got {staging}")
    if min_pool is not None and min_pool < 0:
        raise ValueError(f"min_pool_slots must be >= 0, got {min_pool}")


def plan_ledger(
    model: ModelBytes,
    hbm_budget: int | str,
    host_budget: int | str | None = None,
    *,
    batch_capacity: int = DEFAULT_BATCH,
    max_len: int = DEFAULT_MAX_LEN,
    staging_slots: int | None = None,
    min_pool_slots: int | None = None,
    workspace_fraction: float = WORKSPACE_FRACTION,
    workspace_floor: int | str = WORKSPACE_FLOOR,
    devices: int = 1,
) -> Ledger:
    """Split `hbm_budget` among dense, KV cache, staging, workspace and the expert pool.

    `staging_slots` defaults to `default_staging_slots`, halved (down to 1) while that does not
    fit the budget; `min_pool_slots` defaults to the staging slots. `host_budget` None means
    unlimited pinned host memory. Over `devices` devices the HBM budget and every HBM line
    are each device's, the pool that of its own experts (`device_experts`), and the host
    budget is all their shares together (module docstring). Raises `BudgetError` (with the
    rendered ledger and the shortfall: how much larger the budget must be, its workspace share
    included) when the minimum pool does not fit.
    """
    _check_args(batch_capacity, max_len, workspace_fraction, staging_slots, min_pool_slots)
    kw = dict(batch_capacity=batch_capacity, max_len=max_len, min_pool_slots=min_pool_slots,
              workspace_fraction=workspace_fraction, workspace_floor=workspace_floor,
              owned=device_experts(model, devices))
    if staging_slots is not None:
        return _plan(model, hbm_budget, host_budget, staging_slots=staging_slots, **kw)
    slots = default_staging_slots(model, batch_capacity, devices)
    while True:
        try:
            return _plan(model, hbm_budget, host_budget, staging_slots=slots, **kw)
        except BudgetError:
            if slots == 1:
                raise
            slots //= 2


def _plan(
    model: ModelBytes,
    hbm_budget: int | str,
    host_budget: int | str | None,
    *,
    batch_capacity: int,
    max_len: int,
    staging_slots: int,
    min_pool_slots: int | None,
    workspace_fraction: float,
    workspace_floor: int | str,
    owned: tuple[int, ...],
) -> Ledger:
    hbm, floor = parse_bytes(hbm_budget), parse_bytes(workspace_floor)
    host = None if host_budget is None else parse_bytes(host_budget)
    bpe, total, most, devices = model.bytes_per_expert, model.num_experts, max(owned), len(owned)
    kv = batch_capacity * (max_len * model.kv_bytes_per_token + model.state_bytes_per_row)
    workspace = workspace_bytes(hbm, workspace_fraction, floor)
    fixed = model.dense + kv + workspace
    everything = resident_budget(model.dense + kv + most * bpe, workspace_fraction, floor)
    if fixed + most * bpe <= hbm:
        slots, pool = 0, most
    else:
        slots = staging_slots
        pool = min(max((hbm - fixed - 2 * slots * bpe) // bpe, 0), most)
    # each device's share of tier 1 is whole experts: the host budget's even split
    host_slots = total if host is None else min(devices * (host // devices // bpe), total)
    ledger = Ledger(
        hbm_budget=hbm,
        dense=model.dense,
        kv_cache=kv,
        recurrent=model.state_bytes_per_row > 0,
        staging=2 * slots * bpe,
        workspace=workspace,
        pool_slots=pool,
        bytes_per_expert=bpe,
        staging_slots=slots,
        num_experts=total,
        host_budget=host,
        host_slots=host_slots,
        batch_capacity=batch_capacity,
        max_len=max_len,
        resident_budget=everything,
        owned=owned,
    )
    need_slots = min(slots if min_pool_slots is None else min_pool_slots, most)
    if ledger.pool_slots < need_slots or ledger.free < 0:
        without_ws = ledger.dense + kv + ledger.staging + need_slots * bpe
        offloaded = resident_budget(without_ws, workspace_fraction, floor)
        _over_budget(ledger, need_slots, min(offloaded, everything))
    return ledger


def _over_budget(ledger: Ledger, need_slots: int, minimum: int) -> None:
    """Raise BudgetError; `minimum` is the smallest budget that plans (offloaded or resident)."""
    shortfall = minimum - ledger.hbm_budget
    raise BudgetError(
        f"HBM budget {fmt_bytes(ledger.hbm_budget)}"
        f"{' per device' if ledger.devices > 1 else ''} is too small: dense + KV cache + staging + "
        f"workspace + {need_slots} expert slots (or every expert, without staging) need "
        f"{fmt_bytes(minimum)}, short by "
        f"{fmt_bytes(shortfall)} ({shortfall:,} bytes). Raise the budget, or lower "
        f"max_len ({ledger.max_len}) / batch_capacity ({ledger.batch_capacity}) / "
        f"prefill_chunk (the workspace grows with it) / workspace "
        f"({fmt_bytes(ledger.workspace)}: --workspace SIZE fixes it, for programs that need "
        "less scratch than XLA reports).\n"
        f"{ledger.render()}",
        ledger,
        shortfall,
    )
