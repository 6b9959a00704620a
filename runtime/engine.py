"""The offload engine: experts in a fixed slot pool, misses staged per layer from host or disk.

Per layer: route, copy the misses, issue the copies predicted for the next layer, then
dispatch this layer's experts, so the next layer's copies run while it computes (copy-before-
compute, DESIGN.md). Every layer runs the same compiled functions whatever the budget, and
experts are operands, so an offloaded run is bit-identical to an unlimited one.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax import api
from strata_jax import model as mdl
from strata_jax.checkpoint import EXPERT_KINDS, CheckpointError, CheckpointReader, expert_arrays
from strata_jax.config import ModelConfig
from strata_jax.int4_kernel import Int4Tiles, fits, is_hopper, tiles_for, weight_tile
from strata_runtime.cache_policy import ExpertCache, HeatEstimate, check_policy, rebalance
from strata_runtime.expert_store import ExpertStore, StoreStats
from strata_runtime.heat import load_heat, ranked, save_heat
from strata_runtime.host_dequant import HostDequantizer
from strata_runtime.ledger import (
    Ledger,
    ModelBytes,
    default_staging_slots,
    parse_bytes,
    plan_ledger,
)
from strata_runtime.numa import gpu_pci_bus_id, plan_binding
from strata_runtime.predictor import PredictorStats, check_predictor, combine
from strata_runtime.slot_pool import SlotPool
from strata_runtime.timeline import Timeline
from strata_runtime.transfer import Transfer, TransferEngine, TransferStats, to_device


@dataclass(frozen=True)
class EngineConfig:
    """Engine knobs.

    `hbm_budget` / `host_budget` ("24GB", bytes, or None = unlimited) go through the ledger,
    which decides how many experts get HBM slots (tier 0) and host memory (tier 1).
    `resident_experts` / `host_experts` override those counts directly, for ablations.
    """

    hbm_budget: int | str | None = None
    host_budget: int | str | None = None
    batch_capacity: int = 16
    max_len: int = 256
    workspace_floor: int | str = "256MiB"
    predictor: str = "both"
    policy: str = "lfru"
    cache_fraction: float = 0.25  # share of the HBM expert slots run as a cache, not pinned
    rebalance_every: int = 0  # decode steps between re-rankings of the pinned set; 0 = never
    hysteresis: float = 0.1
    heat_decay: float = 0.9
    timeline: bool = False  # record copy / compute spans for `Engine.export_timeline`
    dequant: str = "device"  # int4 experts: "device" (in the kernel) or "host" (bf16 slots)
    # dequant="host": dequantized experts kept in pinned host memory (LRU, bytes) so a repeat
    # miss is a plain copy; host RAM beyond `host_budget`, which holds the packed experts
    host_dequant_cache: int | str = 0
    fetch_threads: int = 4  # host-side fetches (disk reads, verification, host dequant)
    resident_experts: int | None = None
    host_experts: int | None = None
    heat_file: str | None = None  # routing statistics (`Engine.save_heat`) ranking the tiers
    # experts per staging buffer; None = `ledger.default_staging_slots`: what one layer can
    # need in a decode step, capped at two 256 MiB halves. Fewer frees HBM for pinned experts
    # (a PCIe-bound step moves less) at the price of more expert passes per layer.
    staging_slots: int | None = None
    # each expert multiplies only the rows routed to it (chunks of 16) instead of the whole
    # batch; None = on the GPU kernel's path above 16 rows (`expert_kernels.use_row_chunks`)
    row_chunks: bool | None = None
    # tiles of the Mosaic int4 expert kernel (int4 experts, dequant="device", Hopper GPU);
    # None = `int4_kernel.tiles_for` (the tuned tiles of the expert shape, else the default)
    int4_tiles: Int4Tiles | None = None
    # int4 experts in HBM (dequant="device"): "rows" as stored, "tiles" tile-major (each step
    # of the int4 kernel reads one contiguous block: `pool.tile_major`; same bytes, same
    # outputs), "auto" = "tiles" where the Mosaic int4 kernel runs (Hopper GPU)
    weight_layout: str = "auto"


def check_int4_tiles(tiles: Int4Tiles | None, cfg: ModelConfig) -> None:
    """Refuse int4 kernel tiles that do not divide the model's expert dims."""
    d, f = cfg.hidden_size, cfg.expert_intermediate_size
    if tiles is not None and not fits(d, f, tiles):
        raise ValueError(f"EngineConfig.int4_tiles={tiles} does not tile the experts "
                         f"(hidden {d}, intermediate {f}): see int4_kernel.fits")


def placement(cfg: ModelConfig, pinned: int, host: int,
              heat: np.ndarray | None = None) -> tuple[list, list]:
    """The `pinned` hottest experts (uniform heat: spread evenly over layers) and the `host`
    experts kept in host memory: the others first (cache slots come and go), then the pinned
    ones, which rebalancing may demote."""
    order = ranked(cfg, heat)
    return order[:pinned], (order[pinned:] + order[:pinned])[:host]


DEQUANT = ("device", "host")


def _dequantizes_on_host(kind: str, reader: CheckpointReader) -> bool:
    """Whether int4 experts are expanded to bf16 on the host before the copy."""
    if kind not in DEQUANT:
        raise ValueError(f"dequant must be one of {DEQUANT}, got {kind!r}")
    return kind == "host" and reader.quantization["experts"] != "none"


LAYOUTS = ("auto", "rows", "tiles")


def slot_tile(reader: CheckpointReader, config: EngineConfig) -> tuple[int, int] | None:
    """The (rows, inputs) tile of tile-major int4 slots (`weight_layout`), or None: row-major."""
    if config.weight_layout not in LAYOUTS:
        raise ValueError(f"weight_layout must be one of {LAYOUTS}, got {config.weight_layout!r}")
    packed = (reader.quantization["experts"] != "none"
              and not _dequantizes_on_host(config.dequant, reader))
    if config.weight_layout == "rows" or (config.weight_layout == "auto" and not is_hopper()):
        return None
    cfg = reader.config
    tiles = config.int4_tiles or tiles_for(cfg.hidden_size, cfg.expert_intermediate_size)
    if packed and tiles is not None:
        return weight_tile(tiles)
    if config.weight_layout == "tiles":
        raise ValueError("weight_layout='tiles' needs int4 experts dequantized on the device "
                         "that the int4 kernel tiles")
    return None


def slot_specs(reader: CheckpointReader, dequant: str) -> dict:
    """What one expert slot holds: the stored arrays, or bf16 matrices when dequantized on the
    host (so is the HBM side of the ledger sized)."""
    if _dequantizes_on_host(dequant, reader):
        return expert_arrays(reader.config.replace(dtype="bfloat16"))
    return reader.expert_specs


def slot_bytes(reader: CheckpointReader, dequant: str) -> ModelBytes:
    """The model's sizes with experts as the slots hold them (`slot_specs`)."""
    return ModelBytes.from_specs(reader.config, slot_specs(reader, dequant), reader.dense_specs)


def plan_for(reader: CheckpointReader, config: EngineConfig) -> Ledger:
    """The ledger of `config` (which needs an `hbm_budget`) on `reader`'s checkpoint."""
    model = slot_bytes(reader, config.dequant)
    ledger = plan_ledger(
        model, config.hbm_budget, config.host_budget,
        batch_capacity=config.batch_capacity, max_len=config.max_len,
        staging_slots=config.staging_slots, workspace_floor=config.workspace_floor,
        min_pool_slots=1,
    )
    stored = ModelBytes.from_reader(reader).bytes_per_expert  # what host memory keeps
    if config.host_budget is None or stored == model.bytes_per_expert:
        return ledger
    host = min(parse_bytes(config.host_budget) // stored, ledger.num_experts)
    return dataclasses.replace(ledger, host_slots=host)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(4, 5))
def _attn_decode(cfg, lp, x, positions, k_cache, v_cache):
    return mdl.decode_attention(cfg, lp, x, positions, k_cache, v_cache)


@functools.partial(jax.jit, static_argnums=0)
def _attn_prefill(cfg, lp, x, positions):
    return mdl.causal_attention(cfg, lp, x, positions)


@functools.partial(jax.jit, donate_argnums=0)
def _place_prefix(cache, new, rows):
    """cache [B, max_len, ...] with positions [0, T) of the masked rows replaced by `new`."""
    updated = jax.lax.dynamic_update_slice_in_dim(cache, new, 0, axis=1)
    return jnp.where(rows[:, None, None, None], updated, cache)


@functools.partial(jax.jit, static_argnums=0)
def _route(cfg, lp, x):
    return mdl.route_layer(cfg, lp, x)[1].experts


@functools.partial(jax.jit, static_argnums=(0, 5, 6))
def _moe(cfg, lp, x, pool, slot_row, row_chunks, int4_tiles):
    """The layer's MoE output and its routed experts (one program for every budget)."""
    return mdl.moe_block(cfg, lp, x, pool, slot_row, row_chunks, int4_tiles)


@functools.partial(jax.jit, static_argnums=(0, 7, 8), donate_argnums=6)
def _moe_pass(cfg, lp, x, pool, slot_row, take, picks, row_chunks, int4_tiles):
    return mdl.moe_pass(cfg, lp, x, pool, slot_row, take, picks, row_chunks, int4_tiles)


@functools.partial(jax.jit, static_argnums=0)
def _moe_finish(cfg, lp, x, picks):
    return mdl.moe_finish(cfg, lp, x, picks)


@functools.partial(jax.jit, static_argnums=0)
def _head(cfg, params, x):
    return mdl.lm_head(cfg, params, x)


@functools.partial(jax.jit, static_argnums=0)
def _head_last(cfg, params, x):
    """Decode: the logits of x [B, 1, D]'s only position."""
    return mdl.lm_head(cfg, params, x[:, 0])


@jax.jit
def _embed(table, tokens):
    return table[tokens]


class Engine:
    """Greedy generation over an expert pool smaller than the model."""

    def __init__(self, reader: CheckpointReader, config: EngineConfig) -> None:
        check_predictor(config.predictor)
        check_policy(config.policy)
        self.cfg, self.config = reader.config, config
        cfg = self.cfg
        check_int4_tiles(config.int4_tiles, cfg)
        tile = slot_tile(reader, config)  # checked before any thread or buffer exists
        self.device = jax.devices()[0]
        self.timeline = Timeline(config.timeline)
        self.numa = plan_binding(gpu_pci_bus_id(self.device))
        self._dequant = None
        if _dequantizes_on_host(config.dequant, reader):
            self._dequant = HostDequantizer(cache_bytes=parse_bytes(config.host_dequant_cache),
                                            pin=self.device)
        self.transfers = TransferEngine(self._host_fetch, self.device, config.fetch_threads,
                                        self.numa, self.timeline)
        resident, host, staging = self._tier_sizes(reader)
        cache_slots = 0 if config.policy == "static" else int(config.cache_fraction * resident)
        if resident == cfg.num_layers * cfg.num_experts:
            cache_slots = staging = host = 0  # nothing is ever fetched
        heat = None if config.heat_file is None else load_heat(config.heat_file, cfg)
        tier0, tier1 = placement(cfg, resident - cache_slots, host, heat)
        # pinned host memory is allocated from the (NUMA-bound) fetch threads
        self.store = ExpertStore(reader, tier1, self.device, pinned=self._dequant is None,
                                 loader=self.transfers.executor)
        self.staging = staging
        self.pool = SlotPool(slot_specs(reader, config.dequant), cfg.num_layers, cfg.num_experts,
                             permanent=max(resident, 1), staging=max(staging, 1),
                             device=self.device,
                             transposed=EXPERT_KINDS if self._dequant else (), tile=tile)
        self._place(tier0)
        self.pinned = set(tier0)
        self.cache = ExpertCache(config.policy, cache_slots)
        self.heat = HeatEstimate(cfg.num_layers, cfg.num_experts, config.heat_decay)
        self.tier0_hits = self.tier0_needed = self.steps = self.swaps = 0
        self.step_times: list[float] = []
        self.tokens_out = 0
        self.params = api.read_dense_params(reader)
        self.staged = self.stalls = self.extra_passes = 0
        # copies started whose device buffers may still be live: until the device is known to
        # have finished installing (or dropping) them, i.e. until the next sync
        self._flying = self.max_in_flight = self._unsettled = 0
        self.predictor_stats = PredictorStats()
        self._history: dict[int, set[int]] = {}
        self._inflight: dict[int, dict[int, Transfer]] = {}
        self._deferred: list[tuple[int, jax.Array]] = []
        self._resident_rows: dict[int, jax.Array] = {}

    def _place(self, keys: list[tuple[int, int]]) -> None:
        """Install the initial tier-0 experts (read on the fetch threads, in parallel)."""
        reads = self.transfers.executor.map(lambda k: self._host_weights(*k, count=False), keys)
        for key, arrays in zip(keys, reads, strict=True):
            self.pool.admit(*key, to_device(arrays, self.device))

    def _host_weights(self, layer: int, expert: int, count: bool = True) -> dict[str, object]:
        """An expert's host arrays as the slots hold them (dequantized on the host if asked)."""
        arrays = self.store.fetch(layer, expert, count=count)
        if self._dequant is None:
            return arrays
        return {k: self._dequant.get((layer, expert, k), arrays[k], arrays[f"{k}_scale"])
                for k in EXPERT_KINDS}

    def _host_fetch(self, layer: int, expert: int) -> tuple[int, dict[str, object]]:
        """(source tier, host arrays) of an expert: what a fetch thread does before its copy."""
        return self.store.tier_of(layer, expert), self._host_weights(layer, expert)

    def _start(self, layer: int, expert: int) -> Transfer:
        """Begin moving an expert to the device: pinned tier-1 copies are issued right here.
        Every transfer ends in `_landed` (installed or dropped), then `_settle`."""
        self._flying += 1
        self.max_in_flight = max(self.max_in_flight, self._flying)
        if self.store.pinned and self.store.tier_of(layer, expert) == 1:
            return self.transfers.start(layer, expert, self.store.fetch(layer, expert))
        return self.transfers.start(layer, expert, None)

    def _landed(self, count: int = 1) -> None:
        """Copies installed or dropped: queued on the device, their buffers live until it ran."""
        self._unsettled += count

    def _settle(self) -> None:
        """The host just synced with the device: every landed copy's buffer is free."""
        self._flying -= self._unsettled
        self._unsettled = 0

    def _tier_sizes(self, reader: CheckpointReader) -> tuple[int, int, int]:
        """(tier-0, tier-1, staging) expert counts: from the ledger, unless overridden."""
        cfg, config = self.cfg, self.config
        total = cfg.num_layers * cfg.num_experts
        resident, host = total, total  # no host budget: host memory is unlimited
        staging = config.staging_slots or default_staging_slots(
            slot_bytes(reader, config.dequant), config.batch_capacity)
        if config.hbm_budget is not None:
            self.ledger = plan_for(reader, config)
            resident, host = self.ledger.tier0, self.ledger.host_slots
            staging = self.ledger.staging_slots or staging
        if config.resident_experts is not None:
            resident = config.resident_experts
        if config.host_experts is not None:
            host = config.host_experts
        return resident, host, staging

    def stats(self) -> dict[str, object]:
        """Counters so far: hit rate, latency, stalls, prediction, fetches and bytes per tier."""
        s, t = self.store.stats, self.transfers.stats
        return {
            "tier0_experts": len(self.pool.resident()),
            "tier1_experts": self.store.host_experts,
            "tier0_hit_rate": self.tier0_hits / max(1, self.tier0_needed),
            "tier0_needed_experts": self.tier0_needed,
            "rebalance_swaps": self.swaps,
            **self._latency(),
            "staged": self.staged,
            "stalls": self.stalls,
            "extra_passes": self.extra_passes,
            "max_in_flight": self.max_in_flight,
            "prediction": self.predictor_stats.summary(),
            "fetches": dict(s.hits),
            "bytes_moved": dict(s.bytes),
            "h2d_copies": dict(t.copies),
            "h2d_bytes": dict(t.bytes),
            "wasted_copies": t.wasted_copies,
            "wasted_bytes": t.wasted_bytes,
            "host_dequant_cache": None if self._dequant is None else {
                "hits": self._dequant.hits, "misses": self._dequant.misses},
            "numa": self.numa.reason,
        }

    def save_heat(self, path: str | os.PathLike) -> None:
        """Write the routing counts seen so far, for `EngineConfig(heat_file=...)` placement."""
        save_heat(path, self.heat.counts, source=str(self.store.reader.path))

    def reset_stats(self) -> None:
        """Zero every counter (e.g. after warm-up); placement, cache and heat are kept."""
        self.transfers.drain()
        self.tier0_hits = self.tier0_needed = self.swaps = 0
        self.staged = self.stalls = self.extra_passes = self.tokens_out = 0
        self.max_in_flight = self._flying
        self.step_times = []
        self.predictor_stats = PredictorStats()
        self.store.stats = StoreStats()
        self.transfers.stats = TransferStats()
        if self._dequant is not None:
            self._dequant.hits = self._dequant.misses = 0
        self.timeline.clear()

    def _latency(self) -> dict[str, float]:
        """Decode tok/s, step latency percentiles (ms) and, with a timeline, copy figures."""
        if not self.step_times:
            return {}
        t = np.array(self.step_times)
        out = {
            "decode_tok_s": self.tokens_out / t.sum(),
            "step_ms_p50": float(np.percentile(t, 50) * 1e3),
            "step_ms_p99": float(np.percentile(t, 99) * 1e3),
            "stall_ms": None,
            "overlap_fraction": None,
        }
        if self.timeline.enabled:
            self.transfers.drain()
            out.update(
                stall_ms=self.timeline.total("stall") * 1e3,
                copy_ms=self.timeline.busy("copy") * 1e3,
                overlap_fraction=self.timeline.overlap_fraction(),
            )
        return out

    def close(self) -> None:
        """Stop the fetch and watcher threads (in-flight speculative fetches are abandoned)."""
        self.transfers.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def export_timeline(self, path: str | os.PathLike) -> None:
        """Chrome / Perfetto trace of copies vs compute (needs EngineConfig(timeline=True))."""
        if not self.timeline.enabled:
            raise ValueError("the timeline is off; construct with EngineConfig(timeline=True)")
        self.transfers.drain()
        self.timeline.export(path)

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, config: EngineConfig) -> Engine:
        return cls(CheckpointReader(path), config)

    def _token_rows(self, experts: np.ndarray) -> np.ndarray:
        """The batch row of each routed token (prefill flattens rows x positions)."""
        return np.arange(experts.shape[0]) // (experts.shape[0] // len(self._live))

    def _fail_rows(self, rows: np.ndarray, error: Exception) -> None:
        for r in np.unique(rows).tolist():
            if self._live[r]:
                self._live[r] = False
                self._errors[r] = str(error)

    def _moe_layer(self, layer: int, lp, x, decode: bool):
        """Route layer `layer`, move its missing experts, prefetch layer+1's, run its experts.

        Misses are copied first, then the prefetch for the next layer is issued, and only then
        are this layer's expert programs dispatched, so the copies for layer+1 run while they
        compute. A chunk that cannot be read fails only the rows that routed to it.
        """
        cfg = self.cfg
        if not self.staging:
            return self._moe_resident(layer, lp, x, decode)
        ids = _route(cfg, lp, x)
        gate = None
        if self.config.predictor in ("next-gate", "both") and layer + 1 < cfg.num_layers:
            gate = _route(cfg, self.params["layers"][layer + 1], x)
        experts = np.asarray(ids)
        self._settle()
        token_rows = self._token_rows(experts)
        needed = set(np.unique(experts[self._live[token_rows]]).tolist())
        missing = sorted(e for e in needed if self.pool.slot_of(layer, e) is None)
        self._observe(layer, experts[self._live[token_rows]], needed, missing)
        chunks, transfers = self._first_copies(layer, missing)
        users = {e: token_rows[(experts == e).any(1)] for e in missing}
        gate = None if gate is None else np.asarray(gate)
        if decode and len(chunks) == 1:
            return self._moe_once(layer, lp, x, transfers, users, gate)
        return self._moe_passes(layer, lp, x, chunks, transfers, users, gate)

    def _first_copies(self, layer: int, missing: list[int]):
        """Split the misses into passes (prefetched experts first) and start the first pass's
        copies: returns (passes, transfers). Misses that fit the staging slots make one pass;
        more make passes of half the slots, so one pass's copies can be in flight while the
        previous one installs and computes (`_moe_passes`)."""
        inflight = self._inflight.pop(layer, {})
        self.predictor_stats.record(layer, set(inflight), set(missing))
        staging = max(self.staging, 1)
        size = staging if len(missing) <= staging else max(1, staging // 2)
        order = [e for e in missing if e in inflight] + [e for e in missing if e not in inflight]
        chunks = [order[i : i + size] for i in range(0, len(order), size)] or [[]]
        self.stalls += sum(e not in inflight for e in missing)
        self._drop([t for e, t in inflight.items() if e not in missing])
        transfers = {e: t for e, t in inflight.items() if e in missing}
        self._start_pass(layer, chunks[0], transfers)
        return chunks, transfers

    def _start_pass(self, layer: int, chunk: list[int], transfers: dict[int, Transfer],
                    wait: bool = False) -> None:
        """Start the copies of `chunk` not started yet; with `wait`, only if they fit the
        in-flight bound (else they start once the pass before them has run)."""
        new = [e for e in chunk if e not in transfers]
        if wait and self._flying + len(new) > max(self.staging, 1):
            return
        transfers.update((e, self._start(layer, e)) for e in new)

    def _drop(self, wasted: list[Transfer]) -> None:
        """Mispredicted copies: counted as wasted, and waited for so their buffers are free
        before new copies start (the copy engine runs them first anyway)."""
        for t in wasted:
            self.transfers.wasted(t)
            if t.future.exception() is None:
                jax.block_until_ready(t.result())
        self._flying -= len(wasted)

    def _moe_resident(self, layer, lp, x, decode: bool):
        """Every expert has a slot: no routing sync, nothing to move; the routing is read after
        the step (`_observe_deferred`), for the statistics only."""
        if layer not in self._resident_rows:  # the page table never changes when resident
            self._resident_rows[layer] = jnp.asarray(self.pool.page_table[layer])
        row = self._resident_rows[layer]
        if decode:  # the expert program also returns the routing: one dispatch, not two
            out, ids = _moe(self.cfg, lp, x, self.pool.arrays, row, self.config.row_chunks,
                            self.config.int4_tiles)
            self._deferred.append((layer, ids))
            return out
        self._deferred.append((layer, _route(self.cfg, lp, x)))
        return self._moe_passes(layer, lp, x, [[]], {}, {})

    def _observe_deferred(self) -> None:
        routes = jax.device_get([ids for _, ids in self._deferred])  # one transfer
        for (layer, _), experts in zip(self._deferred, routes, strict=True):
            live = experts[self._live[self._token_rows(experts)]]
            self._observe(layer, live, set(np.unique(live).tolist()), [])
        self._deferred = []

    def _observe(self, layer: int, live_experts: np.ndarray, needed: set[int],
                 missing: list[int]) -> None:
        """Heat, hit counts, cache recency and history for one layer's routing."""
        self.heat.observe(layer, live_experts)
        self.tier0_needed += len(needed)
        self.tier0_hits += len(needed) - len(missing)
        for e in needed.difference(missing):
            if (layer, e) in self.cache:
                self.cache.touch((layer, e))
        self._history[layer] = needed

    def _install(self, layer: int, chunk: list[int], transfers: dict[int, Transfer],
                 users: dict[int, np.ndarray], half: int = 0) -> np.ndarray:
        """Install `chunk`'s copies into the staging slots (from half `half` of the region on,
        so consecutive passes alternate); the layer's slot row [E]."""
        row = np.zeros(self.cfg.num_experts, np.int32)
        slots = self.pool.staging_slots()[half * (self.staging // 2):]
        for e, slot in zip(chunk, slots, strict=False):
            try:
                self.pool.install(slot, transfers[e].result())
                row[e] = slot
                self.staged += 1
            except CheckpointError as err:  # its rows are failed; the expert reads slot 0
                self._fail_rows(users[e], err)
            self._landed()
        for e in range(self.cfg.num_experts):
            slot = self.pool.slot_of(layer, e)
            if slot is not None:
                row[e] = slot
        return row

    def _moe_once(self, layer, lp, x, transfers, users, gate):
        """Decode: every missing expert fits the staging slots, one fused expert program."""
        chunk = sorted(transfers)
        row = self._install(layer, chunk, transfers, users)
        self._prefetch(layer + 1, gate)
        out = _moe(self.cfg, lp, x, self.pool.arrays, row, self.config.row_chunks,
                   self.config.int4_tiles)[0]
        self.transfers.computed(f"experts L{layer}", out, tuple(transfers.values()))
        self._cache_admit(layer, chunk, row)
        return out

    def _moe_passes(self, layer, lp, x, chunks, transfers, users, gate=None):
        """Prefill (or more misses than staging slots): the experts in passes, merged exactly;
        every budget runs this same code. Passes alternate between the two halves of the
        staging region: once pass i-1 has run (its copies are installed and their buffers
        free), pass i+1's copies start, so the link stays busy while pass i installs and
        computes; after the last pass the next layer's prefetch starts."""
        cfg = self.cfg
        self.extra_passes += len(chunks) - 1
        n = x.shape[0] * x.shape[1]
        picks = jnp.zeros((n, cfg.top_k, cfg.hidden_size), jnp.float32)
        for i, chunk in enumerate(chunks):
            if i:
                jax.block_until_ready(picks)  # pass i-1 ran: its copies were installed
                self._settle()
                self._start_pass(layer, chunk, transfers)
            if i + 1 < len(chunks):
                self._start_pass(layer, chunks[i + 1], transfers, wait=True)
            row = self._install(layer, chunk, transfers, users, half=i % 2)
            if i == len(chunks) - 1:
                self._prefetch(layer + 1, gate)
            take = np.zeros(cfg.num_experts, bool)
            take[chunk] = True
            if i == 0:
                take |= self.pool.page_table[layer] >= 0
            picks = _moe_pass(cfg, lp, x, self.pool.arrays, row, take, picks,
                              self.config.row_chunks, self.config.int4_tiles)
            self._cache_admit(layer, chunk, row)
        out = _moe_finish(cfg, lp, x, picks)  # (the passes donate `picks`: watch the result)
        self.transfers.computed(f"experts L{layer}", out, tuple(transfers.values()))
        return out

    def _cache_admit(self, layer: int, chunk: list[int], row: np.ndarray) -> None:
        """Keep staged experts in cache slots (device copies), evicting by the policy.

        Runs after the layer's expert program was dispatched, so evicting cannot change the
        operands it reads (device programs run in order)."""
        if self.cache.capacity == 0:
            return
        for e in chunk:
            if row[e] == 0 or self.pool.slot_of(layer, e) is not None:
                continue
            if len(self.cache) >= self.cache.capacity:
                victim = self.cache.victim()
                self.cache.remove(victim)
                self.pool.evict(*victim)
            self.pool.admit_from(layer, e, int(row[e]))
            self.cache.add((layer, e))

    def _rebalance_due(self) -> bool:
        """Whether this step ends with a re-ranking of the pinned set."""
        every = self.config.rebalance_every
        return bool(every) and (self.steps + 1) % every == 0

    def _end_step(self) -> None:
        """Advance the heat estimate; every `rebalance_every` steps re-rank the pinned set."""
        due = self._rebalance_due()
        self.heat.end_step()
        self.steps += 1
        if not due:
            return
        for i, (out, new) in enumerate(rebalance(self.heat.heat, self.pinned,
                                                 self.config.hysteresis)):
            if i and i % max(self.staging, 1) == 0:  # at most `staging` copies in flight
                jax.block_until_ready(self.pool.arrays)
                self._settle()
            self.pool.evict(*out)
            self.pinned.discard(out)
            if new in self.cache:  # already in HBM: promote the cached copy
                self.cache.remove(new)
            else:
                self.pool.admit(*new, self._start(*new).result())
                self._landed()
            self.pinned.add(new)
            self.swaps += 1

    def _prefetch(self, layer: int, gate: np.ndarray | None) -> None:
        """Start copying predicted non-resident experts of `layer`, as many as keep at most
        `staging` copies in flight (the ledger's second staging buffer): its routing later
        takes those it needs; the rest count as wasted bytes. Called once this layer's copies
        are installed and before its experts are dispatched (copy-before-compute)."""
        kind = self.config.predictor
        budget = self.staging - self._flying
        if layer == self.cfg.num_layers:  # after the last layer: the next step's first
            layer = 0
            if self._rebalance_due():  # its copies take the staging budget at the step's end
                return
        if kind == "none" or budget <= 0 or layer in self._inflight:
            return
        predicted: set[int] = set()
        if gate is not None:
            predicted = set(np.unique(gate[self._live[self._token_rows(gate)]]).tolist())
        wanted = combine(kind, predicted, self._history.get(layer, set()))
        wanted = sorted(e for e in wanted if self.pool.slot_of(layer, e) is None)
        self._inflight[layer] = {e: self._start(layer, e) for e in wanted[:budget]}

    def _prefill(self, tokens: np.ndarray, ks: list, vs: list, rows: np.ndarray):
        """Prefill every row of `tokens`; write the k, v of `rows` into the caches in place."""
        cfg = self.cfg
        b, t = tokens.shape
        positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
        x = _embed(self.params["embed"], tokens)
        mask = np.asarray(rows)
        for layer, lp in enumerate(self.params["layers"]):
            x, k, v = _attn_prefill(cfg, lp, x, positions)
            ks[layer] = _place_prefix(ks[layer], k, mask)
            vs[layer] = _place_prefix(vs[layer], v, mask)
            x = self._moe_layer(layer, lp, x, decode=False)
        logits = _head(cfg, self.params, x)
        self._observe_deferred()
        return logits

    def decode_step(self, tokens: np.ndarray, positions: np.ndarray, ks: list, vs: list
                    ) -> np.ndarray:
        """One timed decode step of every row (live rows in `self._live`): logits [B, vocab].
        `ks`, `vs` (per-layer caches) are updated in place."""
        t0 = time.perf_counter()
        logits = np.asarray(self._decode(np.asarray(tokens), np.asarray(positions), ks, vs))
        self._settle()
        self.step_times.append(time.perf_counter() - t0)
        self._observe_deferred()
        self.tokens_out += int(self._live.sum())
        self._end_step()
        return logits

    def _decode(self, tokens: np.ndarray, positions: np.ndarray, ks: list, vs: list):
        self._prefetch(0, None)  # layer 0: only the last step's experts known
        # one host->device copy each per step, not one per layer program
        tokens, positions = jax.device_put((tokens[:, None], positions), self.device)
        x = _embed(self.params["embed"], tokens)
        for layer, lp in enumerate(self.params["layers"]):
            x, ks[layer], vs[layer] = _attn_decode(self.cfg, lp, x, positions, ks[layer],
                                                   vs[layer])
            self.transfers.computed(f"attention L{layer}", x, ())
            x = self._moe_layer(layer, lp, x, decode=True)
        return _head_last(self.cfg, self.params, x)

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy; new tokens only. Raises RequestFailed if any request failed."""
        return self.generate_with_logits(prompts, max_new_tokens)[0]

    def generate_with_logits(self, prompts: list[list[int]], max_new_tokens: int):
        """Greedy tokens and the last step's logits [len(prompts), vocab]."""
        results, logits = self._run(prompts, max_new_tokens)
        failed = {i: r.error for i, r in enumerate(results) if r.error}
        if failed:
            raise RequestFailed(failed, results)
        return [r.tokens for r in results], logits

    def generate_results(self, prompts: list[list[int]], max_new_tokens: int):
        """One RequestResult per prompt: its tokens, or the error that failed it alone."""
        return self._run(prompts, max_new_tokens)[0]

    def _run(self, prompts: list[list[int]], max_new_tokens: int):
        cap = self.config.batch_capacity
        if not 0 < len(prompts) <= cap:
            raise ValueError(f"need 1..{cap} prompts, got {len(prompts)}")
        lengths = np.ones(cap, np.int32)
        lengths[: len(prompts)] = [len(p) for p in prompts]
        t = api.bucket(int(lengths.max()))
        if t + max_new_tokens > self.config.max_len:
            raise ValueError(f"prompt bucket {t} + {max_new_tokens} new tokens > max_len")
        tokens = np.zeros((cap, t), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
        self._live = np.arange(cap) < len(prompts)  # padding rows fetch nothing
        self._errors: dict[int, str] = {}
        cache = mdl.init_cache(self.cfg, cap, self.config.max_len)
        ks, vs = list(cache.k), list(cache.v)
        logits = self._prefill(tokens, ks, vs, np.ones(cap, bool))
        last = np.asarray(logits)[np.arange(cap), lengths - 1]
        out = [np.argmax(last, -1).astype(np.int32)]
        for i in range(max_new_tokens - 1):
            last = self.decode_step(out[-1], lengths + i, ks, vs)
            out.append(np.argmax(last, -1).astype(np.int32))
        tokens_out = np.stack(out, axis=1).tolist()
        results = [
            RequestResult([], self._errors[i]) if i in self._errors
            else RequestResult(tokens_out[i])
            for i in range(len(prompts))
        ]
        return results, last[: len(prompts)]


@dataclass(frozen=True)
class RequestResult:
    """A request's new tokens, or why it failed (the other requests are unaffected)."""

    tokens: list[int]
    error: str | None = None


class RequestFailed(RuntimeError):
    """Some requests of a batch failed; `results` holds every request's outcome."""

    def __init__(self, failed: dict[int, str], results: list[RequestResult]) -> None:
        lines = "; ".join(f"request {i}: {msg}" for i, msg in sorted(failed.items()))
        super().__init__(f"{len(failed)} of {len(results)} requests failed: {lines}")
        self.results = results
