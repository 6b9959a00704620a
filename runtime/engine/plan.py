"""The engine's plan of a config on a checkpoint: the ledger of its HBM and host budgets
(`plan_for`, with the workspace its programs measure), the sizes experts take in their slots,
and the tier-1 floor a run that can stall on disk needs."""

from __future__ import annotations

import dataclasses

from strata_jax.formats.checkpoint import CheckpointReader, expert_arrays
from strata_jax.ops.int4_kernel import int4_tiles_for, is_hopper, weight_tile
from strata_jax.step import programs as step
from strata_runtime.engine.config import EngineConfig, check_expert_devices
from strata_runtime.residency.ledger import (
    BudgetError,
    Ledger,
    ModelBytes,
    parse_bytes,
    plan_ledger,
)
from strata_runtime.residency.workspace import compiled_workspace, held_expert_shapes


def host_dequantizes(config: EngineConfig, reader: CheckpointReader) -> bool:
    return config.dequant == "host" and reader.quantization["experts"] != "none"


def slot_tile(reader: CheckpointReader, config: EngineConfig) -> tuple[int, int] | None:
    """The (rows, inputs) tile of tile-major int4 slots, or None: row-major."""
    packed = reader.quantization["experts"] != "none" and not host_dequantizes(config, reader)
    if config.weight_layout == "rows" or (config.weight_layout == "auto" and not is_hopper()):
        return None
    cfg = reader.config
    tiles = config.int4_tiles or int4_tiles_for(cfg.hidden_size, cfg.expert_intermediate_size)
    if packed and tiles is not None:
        return weight_tile(tiles)
    if config.weight_layout == "tiles":
        raise ValueError("weight_layout='tiles' needs int4 experts dequantized on the device "
                         "that the int4 kernel tiles")
    return None


def slot_bytes(reader: CheckpointReader, config: EngineConfig) -> ModelBytes:
    """The model's sizes with experts as the slots hold them (bf16 when host-dequantized)."""
    specs = reader.expert_specs
    if host_dequantizes(config, reader):
        specs = expert_arrays(reader.config.replace(dtype="bfloat16"))
    return ModelBytes.from_specs(reader.config, specs, reader.dense_specs, reader.quantization)


def plan_for(reader: CheckpointReader, config: EngineConfig) -> Ledger:
    """The ledger of `config` (which needs an `hbm_budget`) on `reader`'s checkpoint. Without
    a fixed `workspace`, the step programs of the proposed layout are compiled (abstractly) and
    their scratch becomes the workspace line; a layout that this changes is measured again.
    Without a fixed `prefill_chunk` the ledger takes `step.default_prefill_chunk`, halved
    (down to `step.MIN_PREFILL_CHUNK`) while its workspace leaves the budget too small.
    Over several devices each device's workspace is measured on the one-device programs of its
    layout (the same per-device shapes; the mesh need not be present to plan for it).
    `resident_experts` and `host_experts` replace the split the budget gives (the ledger then
    shows what the engine holds, over budget if they ask for more)."""
    check_expert_devices(config)
    chunk = config.prefill_chunk or step.default_prefill_chunk(config.max_len)
    while True:
        try:
            ledger = _measured_ledger(reader, config, chunk)
            return dataclasses.replace(
                ledger, prefill_chunk=chunk,
                pool_slots=config.resident_experts if config.resident_experts is not None
                else ledger.pool_slots,
                host_slots=config.host_experts if config.host_experts is not None
                else ledger.host_slots)
        except BudgetError:
            if config.prefill_chunk or chunk <= step.MIN_PREFILL_CHUNK:
                raise
            chunk //= 2


def _measured_ledger(reader: CheckpointReader, config: EngineConfig, chunk: int) -> Ledger:
    """`plan_for`'s ledger for prefill chunks of `chunk` tokens."""
    if config.workspace is not None:
        return _ledger(reader, config, parse_bytes(config.workspace))
    shapes = held_expert_shapes(reader, host_dequantizes(config, reader),
                                slot_tile(reader, config))
    measured: dict[int, int] = {}  # staging slots of a layout (0: resident) -> its scratch
    ledger = _ledger(reader, config, 0, check=False)
    while ledger.staging_slots not in measured:
        plan = step.StepPlan(staging=ledger.staging_slots, predictor=config.predictor,
                             row_chunks=config.row_chunks, int4_tiles=config.int4_tiles)
        measured[ledger.staging_slots] = compiled_workspace(
            reader, plan, batch=config.batch_capacity, max_len=config.max_len, shapes=shapes,
            chunk=chunk)
        ledger = _ledger(reader, config, measured[ledger.staging_slots], check=False)
    return _ledger(reader, config, measured[ledger.staging_slots])


def tier1_floor(top_k: int, *, owned: int, owned_per_layer: int, pinned: int, cache: int,
                rows: int, rebalance: bool) -> int:
    """The fewest tier-1 experts a device of an engine that can stall on disk holds: what
    one layer's disk misses of its `owned` experts can need (`top_k` picks of `rows` tokens,
    at most a layer's experts) besides the tier-1 experts that also hold a device slot (the
    `cache` slots, and the `pinned` ones once rebalancing swaps them in), since a stalled
    step resumes at that layer once they are all in tier 1 (docs/design.md, "Disk stalls")."""
    per_layer = min(owned_per_layer, top_k * rows)
    held = cache + (pinned if rebalance else 0)
    return min(owned - pinned, per_layer + held)


def _ledger(reader: CheckpointReader, config: EngineConfig, workspace: int,
            check: bool = True) -> Ledger:
    """The split with a fixed workspace; `check=False` returns the layout even over budget."""
    try:
        return plan_ledger(
            slot_bytes(reader, config), config.hbm_budget, config.host_budget,
            batch_capacity=config.batch_capacity, max_len=config.max_len,
            staging_slots=config.staging_slots, workspace_fraction=0.0,
            workspace_floor=workspace, min_pool_slots=1, devices=config.expert_devices)
    except BudgetError as err:
        if check:
            raise
        return err.ledger
