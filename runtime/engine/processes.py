"""Several processes, one per host, for the command line: `jax.distributed` from three flags.

docs/design.md, "The engine over a mesh" (several hosts). Every process runs the same
`strata` command with the same flags but its own `--process-id`; the engine is SPMD over the
processes (each holds and moves only its own devices' experts), so every process computes the
same tokens and statistics. Process 0 alone prints them and writes the shared files (`--json`,
`--record-heat`); files that differ per process (`--export-timeline`: this process's copies
and compute) get the process index in their name (`own_path`).
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from strata_runtime.engine.stats import PHASES, EngineStats

FLAGS = ("coordinator", "num_processes", "process_id")


def add_process_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "processes", "one process per host under jax.distributed: run the same command on "
                     "every host, each with its own --process-id (docs/design.md, 'The "
                     "engine over a mesh')")
    group.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                       help="address of process 0's coordination service (every process "
                            "gives the same one)")
    group.add_argument("--num-processes", type=int, default=None, metavar="N",
                       help="how many processes take part")
    group.add_argument("--process-id", type=int, default=None, metavar="I",
                       help="this process's index in [0, N)")


def check_process_flags(args: argparse.Namespace) -> tuple[str, int, int] | None:
    """(coordinator, processes, this process's id) of the flags, None if none was given; a
    ValueError naming the flag at fault if they are incomplete or out of range."""
    given = {f: getattr(args, f, None) for f in FLAGS}
    if all(v is None for v in given.values()):
        return None
    missing = [f"--{f.replace('_', '-')}" for f, v in given.items() if v is None]
    if missing:
        raise ValueError(f"{', '.join(missing)}: --coordinator, --num-processes and "
                         "--process-id go together")
    host, sep, port = given["coordinator"].rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--coordinator {given['coordinator']!r}: expected HOST:PORT")
    n, pid = given["num_processes"], given["process_id"]
    if n < 1:
        raise ValueError(f"--num-processes {n}: at least 1")
    if not 0 <= pid < n:
        raise ValueError(f"--process-id {pid}: outside [0, {n}) (--num-processes {n})")
    return given["coordinator"], n, pid


def start_processes(args: argparse.Namespace) -> None:
    """`jax.distributed.initialize` from the flags (before anything starts a JAX backend);
    nothing without them."""
    flags = check_process_flags(args)
    if flags is None:
        return
    coordinator, n, pid = flags
    # the CPU backend's collectives between processes (the GPU's are NCCL's either way)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=n,
                               process_id=pid)


def is_first() -> bool:
    """Whether this is process 0 (the one that prints and writes the shared files)."""
    return jax.process_index() == 0


def own_path(path: str) -> str:
    """`path` for this process's own file: `name.p<I>.ext` when there are several."""
    if jax.process_count() == 1:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}.p{jax.process_index()}{p.suffix}"))


MOVES = ("admissions", "disk_loads")  # the host's moves, counted by the owner's process


def process_sum(local: np.ndarray, processes: int) -> np.ndarray:
    """`local` summed over the processes (each contributes its own devices' entries)."""
    if processes == 1:
        return local
    return np.asarray(multihost_utils.process_allgather(local)).sum(axis=0)


def summed_moves(counters: EngineStats, tiers: list[int], processes: int
                  ) -> tuple[EngineStats, list[int]]:
    """`counters` and the tier counts `tiers` with the host's moves (cache admissions, disk
    loads, rebalancing swaps, reads ahead: each process counts those of its own devices) and
    the tiers' experts summed over the processes; the record's counts are already every
    device's."""
    if processes == 1:
        return counters, tiers
    out = copy.deepcopy(counters)
    cells = [(out.phase(p), m) for p in PHASES for m in MOVES]
    cells += [(out, "swaps"), (out, "read_ahead")]
    cells += [(d, m) for d in out.devices for m in MOVES]
    local = [getattr(o, m) for o, m in cells] + tiers
    total = [int(v) for v in process_sum(np.array(local, np.int32), processes)]
    for (o, m), v in zip(cells, total, strict=False):
        setattr(o, m, v)
    return out, total[len(cells):]
