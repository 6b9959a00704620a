"""Experts computed on the host cores, where tier 1 holds their weights.

docs/design.md, "Host compute of misses". The step hands a layer's host share to this module
through two callbacks (`misses.host_round_trip`): `submit` starts the work on a worker thread
and returns at once, so the device goes on copying and computing the other misses; `collect`
waits for it and returns each pick's output. The kernel reads the tier-1 `pinned_host`
buffers in place (no copy of the weights): a `HostTier` holds views of them, registered under
an integer id that the step carries as an argument, so one compiled program serves every
engine and every version of the tier.

The matrices are multiplied by torch (oneDNN) on all cores but one: the core left over keeps
the device fed while the host computes. Host compute rounds differently from the device's
kernels (docs/design.md: a tested tolerance, not bits).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from strata_jax.pool import ExpertPool

KINDS = ("w1", "w3", "w2")
FLOAT_DTYPES = frozenset({"bfloat16", "float32", "float16"})


def _torch():
    try:
        import torch
    except ImportError as err:  # pragma: no cover - torch is a test dependency
        raise ImportError("computing experts on the host (EngineConfig.miss 'host' or "
                          "'auto') needs torch: pip install 'strata-jax[host]'") from err
    return torch


def check_pool(pool: ExpertPool) -> None:
    """Refuse a tier-1 pool the host kernel cannot read (packed int4, for now)."""
    if pool.quantized:
        raise ValueError("host compute of packed int4 experts is not implemented: use "
                         "miss='fetch', or dequant='host' (tier 1 then holds bf16 experts)")
    name = str(np.dtype(pool.w1.dtype))
    if name not in FLOAT_DTYPES:
        raise ValueError(f"host compute takes float experts, got {name}")


def _view(array, torch):
    """A torch tensor over a host-resident jax array's own buffer (no copy)."""
    dtype = np.dtype(array.dtype)
    raw = (ctypes.c_uint8 * (array.size * dtype.itemsize)).from_address(
        array.unsafe_buffer_pointer())
    flat = np.frombuffer(raw, np.uint16 if dtype.name == "bfloat16" else dtype)
    tensor = torch.from_numpy(flat)
    if dtype.name == "bfloat16":
        tensor = tensor.view(torch.bfloat16)
    return tensor.view(*array.shape)


@dataclass
class HostTier:
    """Views of one version of the tier-1 pool, and what the host computed with them."""

    pool: ExpertPool
    """The jax arrays the views read: kept alive while the views are in use."""
    views: dict[str, object]
    """Each weight kind as a torch tensor [slots, in, out] over the pool's buffer."""
    busy_s: float = 0.0
    """Seconds the worker spent in the kernel."""
    experts: int = 0
    """Experts computed."""
    lock: threading.Lock = field(default_factory=threading.Lock)


_TIERS: dict[int, HostTier] = {}
_IDS = itertools.count(1)
_PENDING: dict[int, Future] = {}
_TICKETS = itertools.count(1)
_WORKER: ThreadPoolExecutor | None = None
_GUARD = threading.Lock()


def set_threads(threads: int | None) -> int:
    """Cores the host kernel uses (None: all but one); returns the count set. torch's
    thread count is process-wide."""
    torch = _torch()
    n = threads or max(1, (os.cpu_count() or 2) - 1)
    torch.set_num_threads(n)
    return n


def register(pool: ExpertPool) -> int:
    """Views of `pool` (a host-resident tier-1 pool) under a new id."""
    check_pool(pool)
    torch = _torch()
    tier_id = next(_IDS)
    _TIERS[tier_id] = HostTier(pool, {k: _view(getattr(pool, k), torch) for k in KINDS})
    return tier_id


def release(tier_id: int) -> None:
    _TIERS.pop(tier_id, None)


def tier(tier_id: int) -> HostTier:
    try:
        return _TIERS[tier_id]
    except KeyError:
        raise KeyError(f"host tier {tier_id} is not registered (released, or never "
                       "registered by this process)") from None


def swiglu(views: dict[str, object], slot: int, x):
    """(silu(x @ w1) * (x @ w3)) @ w2 of host slot `slot` for rows x [r, D] (torch, the
    activations' dtype) -> float32 [r, D]: the gate and up products in float32, rounded to
    x's dtype before the down projection, weights in x's dtype, as the device kernels do."""
    torch = _torch()
    w1, w3, w2 = (views[k][slot].to(x.dtype) for k in KINDS)  # a copy only if they differ
    act = (torch.nn.functional.silu((x @ w1).float()) * (x @ w3).float()).to(x.dtype)
    return (act @ w2).float()


def compute(tier_id: int, h: np.ndarray, experts: np.ndarray, live: np.ndarray,
            hosted: np.ndarray, host_row: np.ndarray) -> np.ndarray:
    """Each pick's output [N, k, D] float32 for the picks of live tokens routed to the
    experts marked in `hosted` [E] (others zero): h [N, D] the layer's MoE input, experts
    [N, k] the picks, host_row [E] each expert's tier-1 slot."""
    torch = _torch()
    t = tier(tier_id)
    n, k = experts.shape
    out = np.zeros((n, k, h.shape[-1]), np.float32)
    dtype = np.dtype(h.dtype)
    h = np.array(h)  # writable, as torch wants
    x_all = torch.from_numpy(h.view(np.uint16) if dtype.name == "bfloat16" else h)
    if dtype.name == "bfloat16":
        x_all = x_all.view(torch.bfloat16)
    t0 = time.perf_counter()
    done = 0
    for e in np.flatnonzero(hosted):
        picks = (experts == e) & live[:, None]
        tokens, which = np.nonzero(picks)
        if not len(tokens):
            continue
        rows = torch.from_numpy(tokens.astype(np.int64))
        y = swiglu(t.views, int(host_row[e]), x_all[rows])
        out[tokens, which] = y.numpy()
        done += 1
    with t.lock:
        t.busy_s += time.perf_counter() - t0
        t.experts += done
    return out


def _worker() -> ThreadPoolExecutor:
    global _WORKER
    with _GUARD:
        if _WORKER is None:
            _WORKER = ThreadPoolExecutor(1, thread_name_prefix="strata-host")
        return _WORKER


def submit(tier_id, h, experts, live, hosted, host_row) -> np.ndarray:
    """Start `compute` on the worker thread; returns its ticket (int32 [])."""
    ticket = next(_TICKETS)
    _PENDING[ticket] = _worker().submit(compute, int(tier_id), np.asarray(h),
                                        np.asarray(experts), np.asarray(live),
                                        np.asarray(hosted), np.asarray(host_row))
    return np.asarray(ticket, np.int32)


def collect(ticket, _after) -> np.ndarray:
    """The outputs of the work of `ticket` (waits for it). `_after` is an operand only so
    that the step calls this after its own copies and kernels (`misses.host_round_trip`)."""
    return _PENDING.pop(int(ticket)).result()


def measure(tier_id: int, rows: tuple[int, int] = (1, 16), repeats: int = 3
            ) -> tuple[float, float]:
    """(GB/s of expert bytes at `rows[0]` rows, the relative cost of each further row), from
    the median time of the kernel on tier slot 0 at both row counts (`misses.MissRates`)."""
    torch = _torch()
    t = tier(tier_id)
    d = t.views["w1"].shape[1]
    nbytes = sum(v[0].numel() * v.element_size() for v in t.views.values())
    times = []
    for r in rows:
        x = torch.ones((r, d), dtype=t.views["w1"].dtype)
        swiglu(t.views, 0, x)
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            swiglu(t.views, 0, x)
            runs.append(time.perf_counter() - t0)
        times.append(float(np.median(runs)))
    growth = max(0.0, (times[1] / times[0] - 1) / (rows[1] - rows[0]))
    return nbytes / times[0] / 1e9, growth
