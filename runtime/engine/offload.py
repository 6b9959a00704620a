"""The offload engine: the one compiled step over fixed rows, and the host work between steps.

docs/design.md, "The engine". Rows are integers in [0, batch_capacity): `prefill(row, tokens)`
fills a row's KV and makes it live, `step()` decodes one token for every live row, `free(row)`
retires it. Each call dispatches one compiled program (`strata_jax.step.programs`), whatever the
budget: the misses are copied inside it. Between steps the host reads the step's record (the
previous step's, after the next one is dispatched, unless tier 2 is in play) and applies the
cache policy, the heat rebalancing and the disk tier by donated in-place updates
(`residency.py`). Every budget, policy and predictor gives the resident bits. Over several
devices (`EngineConfig.expert_devices`) each device holds the experts it owns in a residency
of its own and every move goes to the owner (docs/design.md, "The engine over a mesh");
under `jax.distributed` each process of the same program holds and moves only its own
devices' experts, and every decision it takes between steps follows from the replicated
record, so the processes never diverge.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from strata_jax.batching import packing
from strata_jax.batching.checks import check_admissions
from strata_jax.batching.contract import StepResult
from strata_jax.batching.packing import Admission
from strata_jax.batching.requests import RequestResult, generate_all, run_requests
from strata_jax.batching.scheduler import Scheduler
from strata_jax.batching.scoring import loglikelihood
from strata_jax.formats.checkpoint import CheckpointReader
from strata_jax.formats.config import ModelConfig
from strata_jax.model.misses import MissRates
from strata_jax.ops.pool import free
from strata_jax.step import expert_parallel
from strata_jax.step import programs as step
from strata_jax.step.loaded import programs_for
from strata_jax.step.sampling import GREEDY, SamplingParams
from strata_runtime.engine.config import EngineConfig, check_expert_devices, check_int4_tiles
from strata_runtime.engine.disk import (
    ExpertLoader,
    agreed_errors,
    plan_loads,
    read_dense,
    rows_routed,
    start_reads,
)
from strata_runtime.engine.plan import (
    host_dequantizes,
    plan_for,
    slot_bytes,
    slot_tile,
)
from strata_runtime.engine.processes import process_sum, summed_moves
from strata_runtime.engine.shares import Share, start_shares
from strata_runtime.engine.stats import DeviceCounts, EngineStats
from strata_runtime.engine.trace import TraceReplay, TraceWriter
from strata_runtime.residency.cache_policy import HeatEstimate
from strata_runtime.residency.heat import load_heat, save_heat
from strata_runtime.residency.host_misses import HostMisses
from strata_runtime.residency.link import link_rate
from strata_runtime.residency.numa import bind_current_thread, gpu_pci_bus_id, plan_binding
from strata_runtime.residency.tiers import Key, Residencies, local_devices
from strata_runtime.residency.timeline import Timeline

log = logging.getLogger("strata.engine")

def _without_rows(args: tuple, rows: dict[int, str], capacity: int) -> tuple:
    """A prefill program's arguments with `rows` made padding (past the batch, no tokens)
    and off its riders."""
    cut = np.isin(args[0], list(rows))
    riders = args[5] & ~np.isin(np.arange(capacity), list(rows))
    return (np.where(cut, capacity, args[0]).astype(np.int32), args[1], args[2],
            np.where(cut, 0, args[3]).astype(np.int32), args[4], riders, args[6])


@contextlib.contextmanager
def _phase(phases: dict[str, float], name: str):
    """Time the block into phases[name] (seconds)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        phases[name] = time.perf_counter() - t0


class Engine:
    """Rows of requests decoded by the one compiled step over a budget smaller than the model."""

    def __init__(self, reader: CheckpointReader, config: EngineConfig) -> None:
        cfg = reader.config
        check_int4_tiles(config.int4_tiles, cfg)
        check_expert_devices(config)
        self.cfg, self.config, self._reader = cfg, config, reader
        self.capacity, self.max_len = config.batch_capacity, config.max_len
        devices = _expert_devices(config.expert_devices, cfg)
        self._mesh = None if len(devices) == 1 else expert_parallel.mesh_of(devices)
        local = devices if self._mesh is None else local_devices(self._mesh)
        self._local = [devices.index(d) for d in local]  # axis indices this process drives
        self._processes = len({d.process_index for d in devices})
        self._device = local[0]
        self._everyone = self._device if self._mesh is None else NamedSharding(self._mesh, P())
        heat = None if config.heat_file is None else load_heat(config.heat_file, cfg)
        owner = expert_parallel.owners(cfg.num_layers, cfg.num_experts, len(devices), heat)
        self._tile = slot_tile(reader, config)
        self._load = ExpertLoader(reader, host_dequantizes(config, reader), self._tile)
        self._numa = plan_binding(gpu_pci_bus_id(self._device))
        self._threads = ThreadPoolExecutor(config.fetch_threads, thread_name_prefix="strata-io",
                                           initializer=bind_current_thread,
                                           initargs=(self._numa,))
        self.startup: dict[str, float] = {}  # seconds of each start-up phase
        with _phase(self.startup, "ledger"):  # compiles the step programs to size the workspace
            ledger = plan_for(reader, config) if config.hbm_budget is not None else None
        self.prefill_chunk = (ledger.prefill_chunk if ledger is not None else
                              config.prefill_chunk or step.default_prefill_chunk(self.max_len))
        self.prefill_rows = config.prefill_rows or self.capacity
        with _phase(self.startup, "pools"):  # tiers 0 and 1 read from disk
            start = start_shares(
                cfg=cfg, config=config, reader=reader, ledger=ledger, owner=owner,
                devices=devices, local=self._local, heat=heat, load=self._load,
                try_load=self._load.attempt,
                read=start_reads(self._numa, config.fetch_threads), numa=self._numa,
                rows=max(self.capacity, self.prefill_chunk))
            self.shares, self.layout = start.shares, start.layout  # this process's shares only
            self._disk_possible = start.disk_possible
        self.residency = Residencies([s.residency for s in self.shares], self._mesh,
                                     None if self._mesh is None else owner)
        self.heat = HeatEstimate(cfg.num_layers, cfg.num_experts, config.heat_decay)
        with _phase(self.startup, "dense"):
            self.params = read_dense(reader, None if self._mesh is None else self._everyone)
        with _phase(self.startup, "links"):
            links = self._links()
        self.host_misses = None if self.layout.resident or config.miss == "fetch" else HostMisses(
            self._device, self.shares[0].residency.host, None if config.miss_rates is None
            else MissRates.parse(config.miss_rates), config.host_threads)
        self.plan = step.StepPlan(staging=self.layout.staging, predictor=config.predictor,
                                  row_chunks=config.row_chunks, int4_tiles=config.int4_tiles,
                                  resume=self._disk_possible,
                                  miss="fetch" if self.host_misses is None else config.miss,
                                  replay=config.replay_trace is not None)
        self._replay = None if config.replay_trace is None else TraceReplay.of(
            config.replay_trace, cfg)
        self._closed = False  # close() has freed the engine's memory
        self._starts: dict[int, step.Resume] = {}  # per token count
        self._sampled_plan = dataclasses.replace(self.plan, sample=True)
        self._greedy = [True] * self.capacity  # per row: may decode with the plain argmax
        self._live = [False] * self.capacity  # the host's copy of state.live
        programs = programs_for(self._mesh, staged=self.layout.staging > 0)
        self._decode, self._prefill = programs.decode, programs.prefill
        self.state = self._replicated(step.init_state(cfg, self.capacity, self.max_len,
                                                      self._device))
        self._timeline = Timeline(config.timeline, process=jax.process_index())
        if self.host_misses is not None and self._timeline.enabled:
            self.host_misses.trace_round_trips()
        # the host's moves in it are this process's devices' (stats() sums the processes')
        self.counters = EngineStats(
            slot_bytes(reader, config).bytes_per_expert, link_gbps=links[0],
            devices=[DeviceCounts(str(d), link) for d, link in zip(self.layout.devices, links,
                                                                   strict=True)])
        self._pending: step.StepOutput | None = None  # the last step's, not yet observed
        self._pending_packed: jax.Array | None = None  # its record, `step.pack_record`
        self._pending_time = (0.0, False, 0)  # its dispatch time, timed?, live rows
        self._last_done = 0.0  # when the last observed step was seen finished
        self._request: list[int | None] = [None] * self.capacity  # each row's request id
        self._pending_rows: tuple[np.ndarray, list[int | None]] | None = None  # at dispatch
        # the routing is the same on every process: the first one writes it
        self._trace = None if config.record_trace is None or jax.process_index() else \
            TraceWriter.of(config.record_trace, cfg, self.counters.bytes_per_expert, reader.path)
        self._compiled: set[step.StepPlan] = set()  # decode plans called once (compile timed apart)

    # --- set-up --------------------------------------------------------------------------------

    def _share(self, key: Key) -> Share | None:
        """The share of the device that owns `key`; None if another process drives it."""
        owner = int(self.layout.owner[key])
        return next((s for s in self.shares if s.device == owner), None)

    def _links(self) -> list[float | None]:
        """Each device's link rate (None when resident: nothing crosses it), measured by the
        process that drives it and shared with the others (the stats agree)."""
        if self.layout.resident:
            return [None] * len(self.layout.devices)
        rates = np.zeros(len(self.layout.devices))
        for d in self._local:
            rates[d] = link_rate(self.layout.devices[d])
        return [float(r) for r in process_sum(rates, self._processes)]

    def _replicated(self, tree):
        """`tree` (the same host values on every process) on every device of the engine."""
        if self._mesh is None:
            return jax.device_put(tree, self._device)
        return expert_parallel.place(tree, self._everyone)

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, config: EngineConfig) -> Engine:
        return cls(CheckpointReader(path), config)

    def close(self) -> None:
        """Finish the last step's accounting, stop the engine's threads and free its device and
        pinned-host memory now (a process that builds another engine gets it back at once).
        The engine cannot step afterwards; its stats stay readable. Closing twice is fine."""
        if self._closed:
            return
        self._observe_pending()
        if self._trace is not None:
            self._trace.close()
        if self.host_misses is not None:
            self.host_misses.close()
        for share in self.shares:
            share.ahead.close()
        self._threads.shutdown(wait=True)
        self._closed = True
        self.residency.release()
        free(self.params, self.state, self._starts)
        self._starts.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed: build a new one to generate again")

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- the contract: prefill / step / free over integer rows ---------------------------------

    def prefill(self, admissions: Sequence[Admission], ride: packing.Ride | None = None
                ) -> list[packing.Prefilled]:
        """Write each admission's tokens into its row's KV from its start and make the rows
        live, in the packed programs of `packing.run` (chunks of `prefill_chunk` tokens, up to
        `prefill_rows` prompts a program), the live rows that `ride` names taking a decode
        step in each; each row draws its tokens by its sampling (a seed of None draws a new
        one: fix it per request); `request` names it in the routing trace. Returns each
        admission's `packing.Prefilled`: its next token (and scores), or why it failed (an
        expert it needs could not be read: the row is then free)."""
        self._check_open()
        check_admissions(self.cfg, admissions, self.capacity, self.max_len)
        self._observe_pending()
        t0 = time.perf_counter()
        for a in admissions:
            self._greedy[a.row] = a.sampling.greedy
            self._request[a.row] = a.request

        def call(args: packing.ProgramArgs) -> packing.ProgramOut:
            rows, tokens, starts, counts, values, riders, targets = args
            *values, riders = self._agreed((*values, riders & np.array(self._live)))
            args = (rows, tokens, starts, counts, tuple(values), riders, targets)
            out, failed = self._run("prefill{}x{}".format(*tokens.shape), self._prefill,
                                    self.plan, args, sync=True)
            self.counters.ridden_tokens += int(riders.sum())
            if self._trace is not None:
                self._trace.add_program(out.record.experts, rows, counts, tokens.shape[1],
                                        riders, self._request)
            return (np.asarray(out.tokens), np.asarray(out.riders), failed,
                    packing.host_scores(out.scores))

        results = packing.run(admissions, self.prefill_chunk, self.prefill_rows,
                              self.capacity, call, ride)
        for a, result in zip(admissions, results, strict=True):
            self._live[a.row] = result.error is None
        self.counters.prefill_s += time.perf_counter() - t0
        self.counters.prefill_tokens += sum(len(a.tokens) for a in admissions)
        return results

    def step(self) -> StepResult:
        """Dispatch the decode of one token for every live row; `read` gives the tokens."""
        self._check_open()
        t0, waited = time.perf_counter(), self.counters.wait_s
        sampled = any(not g for g, on in zip(self._greedy, self._live, strict=True) if on)
        plan = self._sampled_plan if sampled else self.plan
        rows = (np.array(self._live), list(self._request))  # as dispatched, for the trace
        t1 = time.perf_counter()
        out, failed = self._run("decode", self._decode, plan, (), sync=self._disk_possible)
        dispatch = time.perf_counter() - t1  # the program call (blocking where it syncs)
        packed = None  # a synced record is numpy already
        if isinstance(out.record.counts, jax.Array):  # one array on its way to the host,
            packed = step.pack_record(out.record)  # read a step later
            packed.copy_to_host_async()
        out.tokens.copy_to_host_async()
        self._observe_pending()  # the previous step's record, while this one runs
        self._pending, self._pending_rows, self._pending_packed = out, rows, packed
        self._pending_time = (t0, plan in self._compiled, sum(self._live))
        self._compiled.add(plan)
        self._end_step()
        if self._pending_time[1]:  # a compiling call's host time is its compilation
            self.counters.dispatch_s += dispatch
            if not (plan.staging or self._disk_possible):  # returned before its program ends
                self.counters.launch_s += dispatch
            self.counters.host_s += (time.perf_counter() - t0 - dispatch
                                     - (self.counters.wait_s - waited))
        return StepResult(out.tokens, failed, out.logits)

    def read(self, result: StepResult) -> np.ndarray:
        """The new tokens of a dispatched step, once it has run (the last step dispatched is
        observed then: its record, its time)."""
        if self._pending is not None and result.tokens is self._pending.tokens:
            self._observe_pending()
        return np.asarray(result.tokens)

    def _agreed(self, values: tuple) -> tuple:
        """A row's sampler values, the first process's on all (each process's scheduler draws
        its own seed where the request fixes none; the program takes them as replicated)."""
        if self._processes == 1:
            return values
        return tuple(np.asarray(v) for v in multihost_utils.broadcast_one_to_all(values))

    def free(self, row: int) -> None:
        """Row `row` is no longer live (its KV stays until overwritten)."""
        self.state = step.set_live(self.state, row, False)
        self._live[row] = False

    # --- one program, with the disk tier -------------------------------------------------------

    def _run(self, name: str, program, plan: step.StepPlan, args: tuple, sync: bool):
        """Dispatch `program` on the state; with `sync`, read its record at once and, if a
        layer routed to experts found only on disk, load that layer's and run the step again
        from that layer on the same input (docs/design.md, "Disk stalls"), failing the rows
        of experts that cannot be read. Returns (StepOutput, failed rows)."""
        failed: dict[int, str] = {}
        phase = "prefill" if name.startswith("prefill") else "decode"
        resume = self._from_start(args) if plan.resume else None
        forced = None
        if self._replay is not None:  # one trace step per step, re-runs included
            kind, rows = (("prefill", args[1].size + self.capacity) if args
                          else ("decode", self.capacity))
            forced = self._replicated(self._replay.picks(kind, rows))
        done = None  # the record of the layers before the resume layer
        while True:
            with self._timeline.span(name, "compute"):
                self.state, out, pool = program(self.cfg, plan, self.params,
                                                self.residency.pool, self._tiers(),
                                                self.state, *args, resume=resume,
                                                forced=forced)
            if pool is not None:
                self.residency.pool = pool
            if not sync:
                return out, failed
            record = step.unpack_record(np.asarray(step.pack_record(out.record)), out.record)
            if done is not None:
                record = _spliced(done, record, int(resume.layer))
            disk = np.argwhere(record.disk)
            if not len(disk):
                out = out.replace(record=record)
                if phase == "prefill":  # a decode step's: in _observe_pending
                    self.counters.observe(record, phase)
                    self._admit(record, phase)
                return out, failed
            layer = int(disk[:, 0].min())  # the later layers ran on a wrong input
            keys = [(layer, int(e)) for e in disk[disk[:, 0] == layer, 1]]
            ahead = ([(int(lr), int(e)) for lr, e in disk if lr > layer]
                     if self.config.disk_lookahead else [])
            self.counters.phase(phase).resumed_layers += self.cfg.num_layers - layer
            failed.update(self._from_disk(keys, record, args, phase, ahead))
            if args and failed:  # failed prefill rows and riders (freed) leave the re-run
                args = _without_rows(args, failed, self.capacity)
                if not (args[0] < self.capacity).any() and not args[5].any():
                    return out, failed
            if not plan.resume:  # a prefill's pinned expert out of its slot: run it again
                continue  # whole (it sets its rows' state alike; the others it leaves)
            tokens, positions, sampler = out.start  # the step's input, run again
            self.state = self.state.replace(tokens=tokens, positions=positions, sampler=sampler)
            # committed where `_from_start`'s layer is: an uncommitted scalar is another
            # argument sharding, so the first stall would compile the program again
            done, resume = record, step.Resume(
                layer=jax.device_put(np.int32(layer), self._everyone), saved=out.saved)

    def _tiers(self) -> step.Tiers:
        """The tiers a step reads, with the host kernel's tier-1 views when it has one."""
        tiers = self.residency.tiers()
        if self.host_misses is None:
            return tiers
        return tiers.replace(host_work=self.host_misses.work(self.shares[0].residency.host))

    def _from_start(self, args: tuple) -> step.Resume:
        """The resume argument of a run from the first layer, kept per token count (a decode
        step when `args` is empty, else a prefill program of `args[1]`'s tokens and its
        riders)."""
        n = args[1].size + self.capacity if args else self.capacity
        if n not in self._starts:
            self._starts[n] = self._replicated(step.from_start(self.cfg, n))
        return self._starts[n]

    def _from_disk(self, keys: list[Key], record, args, phase: str,
                   ahead: list[Key] = ()) -> dict[int, str]:
        """Load a stalled layer's `keys` (and the later layers' disk experts `ahead` where
        tier 1 has room: `disk.plan_loads`) into their owners' tier-1 shares, each by the
        process that drives the owner; rows routed to an expert whose chunk fails
        verification, on whichever process, fail and leave the batch (docs/design.md, "Disk
        stalls"). The loads and the stall count in `phase`."""
        t0 = time.perf_counter()
        mine, extra, victims = plan_loads(self.shares, self._share, keys, ahead,
                                          np.asarray(record.counts), self.heat.heat)
        errors: dict[Key, str] = {}
        loads = mine + extra
        for key, arrays in zip(loads, self._threads.map(self._load.attempt, loads), strict=True):
            if isinstance(arrays, str):
                if key in mine:
                    errors[key] = arrays
                continue
            share = self._share(key)
            share.residency.admit_host(key, arrays, victims[key])
            self.counters.moved(phase, "disk_loads", share.device)
        failed: dict[int, str] = {}
        for key, error in agreed_errors(keys, errors, self._processes).items():
            rows = rows_routed(record, key, args, self.capacity, self._live)
            for r in rows:
                failed[r] = error
                self.free(r)
            self.counters.failed_requests += len(rows)
        self.counters.phase(phase).disk_stall_s += time.perf_counter() - t0
        return failed

    # --- between steps -------------------------------------------------------------------------

    def _observe_pending(self) -> None:
        if self._pending is None:
            return
        record = self._pending.record  # numpy when synced; else one copy, when the step ends
        if self._pending_packed is not None:
            t0 = time.perf_counter()
            packed = np.asarray(self._pending_packed)  # waits for the step to end
            self.counters.wait_s += time.perf_counter() - t0
            record = step.unpack_record(packed, record)
        self._pending = self._pending_packed = None
        done, (t0, timed, rows) = time.perf_counter(), self._pending_time
        if timed:  # from when the device could start it: its dispatch or the last step's end
            self.counters.step_done(done - max(t0, self._last_done), rows)
        else:  # the first call of a plan compiles it
            self.counters.compile_s += done - t0
        self._last_done = done
        if self._trace is not None:
            self._trace.add(record.experts, *self._pending_rows)
        self.counters.observe(record, "decode")
        self._admit(record, "decode")

    def _admit(self, record, phase: str) -> None:
        """Heat, and the cache policy: experts copied on demand take cache slots (admissions
        count in `phase`, the record's)."""
        counts = np.asarray(record.counts)
        self.heat.observe_all(counts)
        if self.layout.resident:  # every expert has its slot: nothing to admit
            return
        routed = [(int(layer), int(e)) for layer, e in np.argwhere(counts > 0)]
        heat = self.heat.current()
        for share in self.shares:  # each device admits its own experts
            taken = share.admit([k for k in routed if self.layout.owner[k] == share.device], heat)
            for _ in range(taken):
                self.counters.moved(phase, "admissions", share.device)

    def _end_step(self) -> None:
        self.heat.end_step()
        # with a disk tier the step was read (`_run`'s sync): nothing reads tier 1 now
        if self._disk_possible and self.config.read_ahead:
            for share in self.shares:
                heat = np.where(self.layout.owner == share.device, self.heat.heat, -np.inf)
                self.counters.read_ahead += share.ahead.between_steps(share.residency, heat)
        every = self.config.rebalance_every
        if not every or self.counters.decode_steps % every or not self.counters.decode_steps:
            return
        for share in self.shares:  # each device by the heat of its own experts
            heat = np.where(self.layout.owner == share.device, self.heat.heat, -np.inf)
            self.counters.swaps += share.rebalance(heat, self.config.hysteresis)

    # --- results -------------------------------------------------------------------------------

    def stats(self) -> dict[str, object]:
        """The engine's figures; over several processes every process must call it (the
        host's moves, each process's own, are summed over them: all get the same counts)."""
        self._observe_pending()
        parts = self.residency.parts
        tiers = [sum(int((r.page >= 0).sum()) for r in parts),
                 sum(int((r.host_page >= 0).sum()) for r in parts if r.host is not None)]
        counters, tiers = summed_moves(self.counters, tiers, self._processes)
        return {"tier0_experts": tiers[0], "tier1_experts": tiers[1],
                "staging_slots": self.layout.staging, "expert_devices": len(self.layout.devices),
                "processes": self._processes,
                **counters.summary(),
                **({} if self.host_misses is None
                   else self.host_misses.summary(self.counters.bytes_per_expert)),
                **({} if self._replay is None else {"replay_wraps": self._replay.wraps}),
                "numa": self._numa.reason}

    def reset_stats(self) -> None:
        """Zero the counters (e.g. after warm-up); placement, cache and heat are kept."""
        self._observe_pending()
        self.counters = self.counters.fresh()
        if self.host_misses is not None:
            self.host_misses.reset()
        self._timeline.clear()

    def save_heat(self, path: str | os.PathLike) -> None:
        save_heat(path, self.heat.counts, source=str(self._reader.path))

    def export_timeline(self, path: str | os.PathLike) -> None:
        if not self._timeline.enabled:
            raise ValueError("the timeline is off; construct with EngineConfig(timeline=True)")
        if self.host_misses is not None:
            self.host_misses.add_spans(self._timeline)
        self._timeline.export(path)

    def generate_results(self, prompts: list[list[int]], max_new_tokens: int,
                         sampling: SamplingParams | list[SamplingParams] = GREEDY,
                         tokenizer=None) -> list[RequestResult]:
        """`requests.run_requests` on this engine: one RequestResult per prompt."""
        return run_requests(self, prompts, max_new_tokens, sampling, tokenizer)

    def generate(self, prompts: list[list[int]], max_new_tokens: int,
                 sampling: SamplingParams | list[SamplingParams] = GREEDY,
                 tokenizer=None) -> list[list[int]]:
        """The new tokens of each prompt (`strata_jax.generate`'s, bit for bit); raises
        RequestFailed if any request failed."""
        return generate_all(self, prompts, max_new_tokens, sampling, tokenizer)

    def score(self, pairs) -> list:
        """`strata_jax.score` of (context ids, continuation ids) pairs on this engine: the
        same bits as the resident API's with the same shape."""
        return loglikelihood(Scheduler(self), pairs)


def _expert_devices(count: int, cfg: ModelConfig) -> list[jax.Device]:
    """The first `count` devices (`EngineConfig.expert_devices`)."""
    present = jax.devices()
    if count > len(present):
        raise ValueError(f"expert_devices={count} (--expert-devices): this process sees "
                         f"{len(present)} {jax.default_backend()} device(s)")
    if count > cfg.num_experts:
        raise ValueError(f"expert_devices={count} (--expert-devices) is more than the "
                         f"{cfg.num_experts} experts of a layer: a device would own none")
    spanned = {d.process_index for d in present[:count]}
    if len(spanned) < jax.process_count():
        raise ValueError(f"expert_devices={count} (--expert-devices) spans the devices of "
                         f"{len(spanned)} of the {jax.process_count()} jax.distributed "
                         "processes: each process runs the same engine on devices of its "
                         f"own, so the experts must span them all (e.g. {len(present)})")
    return present[:count]




def _spliced(done, record, layer: int):
    """The record of a step resumed at `layer`: the layers before it from `done` (the run
    that stalled there), the others from `record`."""
    return jax.tree.map(lambda a, b: np.concatenate([a[:layer], b[layer:]]), done, record)
