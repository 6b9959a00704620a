"""Routing traces: which experts every live row picked, per step and layer (docs/design.md,
"Traces and the simulator").

A trace is one compressed `.npz` file (`np.savez_compressed`, no pickles) of these arrays:

- `meta`: a 0-d unicode array holding JSON: `format` ("strata-trace"), `version` (1),
  `num_layers`, `num_experts`, `top_k`, `seed` (int or null) and `extra` (a free-form dict;
  `strata simulate` reads `model_config`, a ModelConfig.to_dict(), and `bytes_per_expert`).
- `experts` int16 [R, L, k]: the expert ids each live row picked at each layer; rows of all
  steps concatenated in step order, only live rows stored.
- `rows` int32 [R]: the batch row of each stored row.
- `requests` int64 [R]: the request id of each stored row (-1: none given).
- `offsets` int64 [S + 1]: step s holds stored rows `offsets[s]:offsets[s + 1]`.
- `widths` int32 [S]: rows of step s, live or not (the N the step was recorded with).
- `prefill` bool [S]: the step was a prefill chunk (its rows are one request's tokens).

`TraceWriter` collects steps in memory and writes the file once, atomically (written aside,
then renamed over the path); `load_trace` checks the format and the shapes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from strata_jax.formats.config import ModelConfig

FORMAT = "strata-trace"
VERSION = 1
_ARRAYS = ("experts", "rows", "requests", "offsets", "widths", "prefill")


class TraceError(ValueError):
    """A file that is not a readable routing trace of this version."""


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class RoutingTrace:
    """A loaded (or synthesized) routing trace; arrays as stored (see the module docstring)."""

    num_layers: int
    """Layers of the model (L)."""
    num_experts: int
    """Routed experts per layer (E)."""
    top_k: int
    """Experts each token picks per layer (k)."""
    seed: int | None
    """The seed of the run (or of the synthesizer), if one was given."""
    extra: dict
    """Free-form metadata (JSON-serializable), e.g. the checkpoint or the engine's knobs."""
    experts: np.ndarray
    """int16 [R, L, k]: each live row's picks, every step's rows in step order."""
    rows: np.ndarray
    """int32 [R]: the batch row of each stored row."""
    requests: np.ndarray
    """int64 [R]: the request id of each stored row; -1 where none was given."""
    offsets: np.ndarray
    """int64 [S + 1]: step s is stored rows offsets[s]:offsets[s + 1]."""
    widths: np.ndarray
    """int32 [S]: rows of each step, live or not."""
    prefill: np.ndarray
    """bool [S]: whether each step was a prefill chunk (otherwise a decode step)."""

    @property
    def num_steps(self) -> int:
        return len(self.widths)

    def live_rows(self) -> np.ndarray:
        """int64 [S]: live (stored) rows of each step."""
        return np.diff(self.offsets)

    def step_experts(self, step: int) -> np.ndarray:
        """[L, n, k] picks of the n live rows of `step`, as `TraceWriter.add` took them."""
        lo, hi = self.offsets[step], self.offsets[step + 1]
        return np.transpose(self.experts[lo:hi], (1, 0, 2))

    def step_keys(self, step: int) -> np.ndarray:
        """int64 sorted: the distinct (layer, expert) routed at `step`, as layer * E + expert
        (layer-major, experts ascending: the order of np.argwhere on the step's counts)."""
        lo, hi = self.offsets[step], self.offsets[step + 1]
        picks = self.experts[lo:hi].astype(np.int64)  # [n, L, k]
        layer = np.arange(self.num_layers, dtype=np.int64)[None, :, None]
        return np.unique((layer * self.num_experts + picks).ravel())

    def counts(self) -> np.ndarray:
        """float64 [L, E]: routing assignments per expert over the whole trace (the heat a
        `--record-heat` of the same run would hold)."""
        out = np.zeros((self.num_layers, self.num_experts), np.float64)
        layer = np.broadcast_to(np.arange(self.num_layers)[None, :, None], self.experts.shape)
        np.add.at(out, (layer, self.experts), 1)
        return out


class TraceWriter:
    """Collects steps and writes one trace file on `close()` (or the end of a `with` block).

    The file appears whole or not at all: it is written to a temporary name beside `path`
    and renamed over it; a `with` block left by an exception writes nothing."""

    def __init__(self, path: str | os.PathLike, *, num_layers: int, num_experts: int,
                 top_k: int, seed: int | None = None, extra: dict | None = None) -> None:
        if not 0 < num_experts <= np.iinfo(np.int16).max:
            raise ValueError(f"num_experts must be in [1, 32767], got {num_experts}")
        self.path = Path(path)
        self.shape = (num_layers, num_experts, top_k)
        self.seed = seed
        self.extra = dict(extra or {})
        json.dumps(self.extra)  # fail now, not at close
        self._steps: list[tuple[np.ndarray, np.ndarray, np.ndarray, int, bool]] = []
        self._closed = False

    @classmethod
    def of(cls, path: str | os.PathLike, cfg: ModelConfig, bytes_per_expert: int,
           checkpoint: str | os.PathLike) -> TraceWriter:
        """An engine's trace of `cfg`'s routing, the model and its checkpoint named in it."""
        return cls(path, num_layers=cfg.num_layers, num_experts=cfg.num_experts,
                   top_k=cfg.top_k, extra={"model_config": dataclasses.asdict(cfg),
                                           "bytes_per_expert": bytes_per_expert,
                                           "checkpoint": str(checkpoint)})

    def add_program(self, experts: np.ndarray, rows: np.ndarray, counts: np.ndarray,
                    tokens: int, riders: np.ndarray, requests: Sequence[int | None]) -> None:
        """A prefill program's step: its rows' `tokens` tokens each (row `rows[i]`, real below
        `counts[i]`; a row at or past the batch (`len(requests)`) is padding), then one token
        per batch row, live where it rides (`riders`); `requests`: each batch row's request."""
        real = (np.arange(tokens)[None] < counts[:, None]).reshape(-1)
        owners = [requests[r] if r < len(requests) else None for r in np.repeat(rows, tokens)]
        self.add(experts, np.concatenate([real, riders]), owners + list(requests), prefill=True)

    def add(self, experts: np.ndarray, live: np.ndarray, requests: Sequence[int | None], *,
            prefill: bool = False) -> None:
        """One step: `experts` int [L, N, k] every row's picks (a StepRecord's `experts`),
        `live` bool [N] the rows in use, `requests` [N] each row's request id (None: none or
        not live). Only live rows are kept."""
        if self._closed:
            raise ValueError(f"trace {self.path} is already closed")
        experts, live = np.asarray(experts), np.asarray(live, bool)
        num_layers, num_experts, top_k = self.shape
        n = live.shape[0] if live.ndim == 1 else -1
        if experts.shape != (num_layers, n, top_k) or len(requests) != n:
            raise ValueError(f"step of experts {experts.shape}, live {live.shape} and "
                             f"{len(requests)} requests: expected [{num_layers}, N, {top_k}], "
                             "[N] and N")
        kept = experts[:, live, :]
        if kept.size and (kept.min() < 0 or kept.max() >= num_experts):
            raise ValueError(f"expert ids must be in [0, {num_experts}), got "
                             f"[{kept.min()}, {kept.max()}]")
        ids = np.array([-1 if r is None else int(r) for r in requests], np.int64)[live]
        rows = np.flatnonzero(live).astype(np.int32)
        self._steps.append((np.transpose(kept, (1, 0, 2)).astype(np.int16), rows, ids, n,
                            prefill))

    def close(self) -> Path:
        """Write the file (once; later calls do nothing) and return its path."""
        if not self._closed:
            self._closed = True
            save_trace(self.path, self._trace())
        return self.path

    def abort(self) -> None:
        """Drop what was collected: nothing is written."""
        self._closed = True
        self._steps.clear()

    def _trace(self) -> RoutingTrace:
        num_layers, num_experts, top_k = self.shape
        parts = list(zip(*self._steps, strict=True)) or [[] for _ in range(5)]
        experts, rows, ids, widths, prefill = parts
        sizes = [len(r) for r in rows]
        return RoutingTrace(
            num_layers=num_layers, num_experts=num_experts, top_k=top_k, seed=self.seed,
            extra=self.extra,
            experts=np.concatenate(experts) if sizes else np.zeros((0, num_layers, top_k),
                                                                   np.int16),
            rows=np.concatenate(rows) if sizes else np.zeros(0, np.int32),
            requests=np.concatenate(ids) if sizes else np.zeros(0, np.int64),
            offsets=np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64),
            widths=np.array(widths, np.int32), prefill=np.array(prefill, bool))

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class TraceReplay:
    """A trace's picks handed to the steps of an engine that replays it
    (`EngineConfig.replay_trace`): each decode step takes the trace's next decode step, each
    prefill chunk its next prefill step, cycling when the trace runs out (`wraps` counts it);
    a stored row lands on the batch row (decode) or chunk token (prefill) it was recorded at.
    Rows the trace step did not store (and rows beyond the engine's) keep the router's
    picks (-1)."""

    def __init__(self, trace: RoutingTrace, *, num_layers: int, num_experts: int, top_k: int,
                 source: str = "the trace") -> None:
        got = (trace.num_layers, trace.num_experts, trace.top_k)
        if got != (num_layers, num_experts, top_k):
            raise TraceError(f"{source}: recorded for {got[0]} layers x {got[1]} experts, "
                             f"top-{got[2]}; the model has {num_layers} x {num_experts}, "
                             f"top-{top_k}")
        self.trace = trace
        self._steps = {kind: np.flatnonzero(trace.prefill == (kind == "prefill"))
                       for kind in ("decode", "prefill")}
        self._next = {"decode": 0, "prefill": 0}
        self.wraps = 0


    @classmethod
    def of(cls, path: str | os.PathLike, cfg: ModelConfig) -> TraceReplay:
        """The trace file at `path` replayed on `cfg`'s shape."""
        return cls(load_trace(path), num_layers=cfg.num_layers, num_experts=cfg.num_experts,
                   top_k=cfg.top_k, source=str(path))
    def picks(self, kind: str, rows: int) -> np.ndarray:
        """int32 [L, rows, k]: the next `kind` ("decode" / "prefill") step's picks."""
        t = self.trace
        out = np.full((t.num_layers, rows, t.top_k), -1, np.int32)
        steps = self._steps[kind]
        if not len(steps):
            return out
        i = self._next[kind]
        if i == len(steps):
            i, self.wraps = 0, self.wraps + 1
        self._next[kind] = i + 1
        step = int(steps[i])
        lo, hi = t.offsets[step], t.offsets[step + 1]
        where = t.rows[lo:hi]
        keep = where < rows
        out[:, where[keep], :] = np.transpose(t.experts[lo:hi][keep], (1, 0, 2))
        return out


def save_trace(path: str | os.PathLike, trace: RoutingTrace) -> None:
    """Write `trace` to `path` atomically (a temporary file beside it, then a rename)."""
    path = Path(path)
    meta = {"format": FORMAT, "version": VERSION, "num_layers": trace.num_layers,
            "num_experts": trace.num_experts, "top_k": trace.top_k, "seed": trace.seed,
            "extra": trace.extra}
    arrays = {name: getattr(trace, name) for name in _ARRAYS}
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:  # a file object: savez would append ".npz" to a name
            np.savez_compressed(f, meta=np.array(json.dumps(meta)), **arrays)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_trace(path: str | os.PathLike) -> RoutingTrace:
    """Read a trace written by `TraceWriter` / `save_trace`; TraceError names the file if it is
    not one, is of another version, or its arrays do not fit together."""
    path = Path(path)
    if path.is_file() and not zipfile.is_zipfile(path):
        raise TraceError(f"{path} is not a routing trace ({FORMAT} v{VERSION}): not an .npz "
                         "archive")
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"][()]))
            arrays = {name: z[name] for name in _ARRAYS}
    except FileNotFoundError:
        raise
    except (OSError, ValueError, KeyError) as e:  # not a zip, no such member, bad JSON
        raise TraceError(f"{path} is not a routing trace ({FORMAT} v{VERSION}): {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise TraceError(f"{path} is not a routing trace (no '{FORMAT}' format in its meta)")
    if meta.get("version") != VERSION:
        raise TraceError(f"{path} is a {FORMAT} of version {meta.get('version')}; this "
                         f"version reads version {VERSION} only")
    trace = RoutingTrace(num_layers=meta["num_layers"], num_experts=meta["num_experts"],
                         top_k=meta["top_k"], seed=meta["seed"], extra=meta["extra"], **arrays)
    _check(path, trace)
    return trace


def _check(path: Path, t: RoutingTrace) -> None:
    steps, stored = len(t.widths), len(t.rows)
    problems = [
        t.experts.shape != (stored, t.num_layers, t.top_k) and f"experts {t.experts.shape}",
        t.requests.shape != (stored,) and f"requests {t.requests.shape}",
        t.offsets.shape != (steps + 1,) and f"offsets {t.offsets.shape}",
        t.prefill.shape != (steps,) and f"prefill {t.prefill.shape}",
    ]
    problems = [p for p in problems if p]
    if not problems and (t.offsets[0] != 0 or t.offsets[-1] != stored
                         or (np.diff(t.offsets) < 0).any()):
        problems.append("offsets do not partition the rows")
    if not problems and stored and (t.experts.min() < 0 or t.experts.max() >= t.num_experts):
        problems.append(f"expert ids outside [0, {t.num_experts})")
    if problems:
        raise TraceError(f"{path}: arrays do not fit together ({', '.join(problems)}; "
                         f"{steps} steps, {stored} rows)")


# ------------------------------------------------------------------------------ synthetic


def zipf_popularity(num_experts: int, skew: float, rng: np.random.Generator) -> np.ndarray:
    """float64 [E] routing probabilities ∝ 1 / rank**skew, ranks randomly assigned."""
    weights = 1.0 / np.arange(1, num_experts + 1, dtype=np.float64) ** skew
    return (weights / weights.sum())[rng.permutation(num_experts)]


def synthetic_trace(num_layers: int, num_experts: int, top_k: int, steps: int, rows: int,
                    skew: float, seed: int, drift_at: int | None = None) -> RoutingTrace:
    """A decode trace with Zipf-like popularity: per layer, expert of rank r is picked with
    weight 1 / r**skew (0: uniform), each row drawing `top_k` distinct experts by those
    weights (Gumbel top-k); row r serves request r throughout. From step `drift_at` on,
    each layer's popularity is permuted afresh (the hot experts change). Deterministic in
    `seed`."""
    if not 1 <= top_k <= num_experts or steps < 0 or rows < 1 or skew < 0:
        raise ValueError(f"need 1 <= top_k <= num_experts, steps >= 0, rows >= 1, skew >= 0; "
                         f"got top_k={top_k}, num_experts={num_experts}, steps={steps}, "
                         f"rows={rows}, skew={skew}")
    rng = np.random.default_rng(seed)
    before = np.log([zipf_popularity(num_experts, skew, rng) for _ in range(num_layers)])
    after = np.log([zipf_popularity(num_experts, skew, rng) for _ in range(num_layers)])
    drift = steps if drift_at is None else drift_at
    picks = np.empty((steps, rows, num_layers, top_k), np.int16)
    for s in range(steps):  # one step at a time: [rows, L, E] of noise, not [S, rows, L, E]
        noisy = (before if s < drift else after) + rng.gumbel(size=(rows, num_layers,
                                                                    num_experts))
        picks[s] = np.argpartition(-noisy, top_k - 1, axis=-1)[..., :top_k]
    return RoutingTrace(
        num_layers=num_layers, num_experts=num_experts, top_k=top_k, seed=seed,
        extra={"synthetic": {"skew": skew, "rows": rows, "drift_at": drift_at}},
        experts=picks.reshape(steps * rows, num_layers, top_k),
        rows=np.tile(np.arange(rows, dtype=np.int32), steps),
        requests=np.tile(np.arange(rows, dtype=np.int64), steps),
        offsets=np.arange(steps + 1, dtype=np.int64) * rows,
        widths=np.full(steps, rows, np.int32), prefill=np.zeros(steps, bool))


# ------------------------------------------------------------------------------ statistics


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class TraceStats:
    """What `trace_stats` measures."""

    steps: int
    """Steps in the trace (prefill chunks included)."""
    mean_live_rows: float
    """Live rows per step, averaged over the steps."""
    distinct: np.ndarray
    """int64 [L]: experts of each layer routed at least once."""
    entropy_bits: np.ndarray
    """float64 [L]: entropy of each layer's routing-assignment distribution (log2 E: uniform)."""
    top8_share: np.ndarray
    """float64 [L]: share of each layer's assignments taken by its 8 most-routed experts."""
    accesses: int
    """Distinct (layer, expert) routed per step, summed over the steps: the simulator's
    access count."""
    reuse_edges: np.ndarray
    """int64 [B + 1]: reuse-distance bin edges 0, 1, 2, 4, 8, ... (bin i: [edges[i],
    edges[i + 1]))."""
    reuse_hist: np.ndarray
    """int64 [B]: re-accesses by reuse distance: the distinct other keys accessed since the
    key's previous access (its LRU stack distance; an LRU cache of C slots alone would hit
    exactly the re-accesses at distance < C)."""
    cold: int
    """First accesses (no reuse distance)."""

    def render(self) -> str:
        """Markdown: a per-layer table, then the reuse-distance histogram."""
        lines = [f"{self.steps} steps, {self.mean_live_rows:.1f} live rows per step, "
                 f"{self.accesses} accesses ({self.cold} first uses)", "",
                 "| layer | distinct experts | entropy (bits) | top-8 share |", "|---|---|---|---|"]
        for i, (d, h, s) in enumerate(zip(self.distinct, self.entropy_bits, self.top8_share,
                                          strict=True)):
            lines.append(f"| {i} | {d} | {h:.3f} | {s:.3f} |")
        lines += ["", "| reuse distance | re-accesses |", "|---|---|"]
        for lo, hi, n in zip(self.reuse_edges[:-1], self.reuse_edges[1:], self.reuse_hist,
                             strict=True):
            lines.append(f"| {lo}" + (f"-{hi - 1}" if hi - 1 > lo else "") + f" | {n} |")
        return "\n".join(lines)


def trace_stats(trace: RoutingTrace) -> TraceStats:
    """Per-layer popularity and the reuse-distance histogram of the access sequence."""
    counts = trace.counts()
    total = np.maximum(counts.sum(axis=1, keepdims=True), 1)
    p = counts / total
    entropy = -(p * np.log2(np.where(p > 0, p, 1))).sum(axis=1)
    top8 = np.sort(counts, axis=1)[:, ::-1][:, :8].sum(axis=1) / total[:, 0]
    keys = np.concatenate([trace.step_keys(s) for s in range(trace.num_steps)] or [[]])
    distances = reuse_distances(keys.astype(np.int64))
    reused = distances[distances >= 0]
    top = int(reused.max()) if len(reused) else 0
    edges = np.array([0] + [1 << i for i in range(max(1, top.bit_length()) + 1)], np.int64)
    hist, _ = np.histogram(reused, bins=edges)
    return TraceStats(steps=trace.num_steps, mean_live_rows=float(trace.live_rows().mean())
                      if trace.num_steps else 0.0, distinct=(counts > 0).sum(axis=1),
                      entropy_bits=entropy, top8_share=top8, accesses=len(keys),
                      reuse_edges=edges, reuse_hist=hist.astype(np.int64),
                      cold=int((distances < 0).sum()))


def reuse_distances(keys: np.ndarray) -> np.ndarray:
    """int64 [n]: for each access, the distinct other keys accessed since the previous access
    of the same key (-1 for a first access). O(n log n): a Fenwick tree marks each key's
    latest access."""
    n = len(keys)
    tree = [0] * (n + 1)
    last: dict[int, int] = {}
    out = np.full(n, -1, np.int64)

    def add(i: int, v: int) -> None:
        i += 1
        while i <= n:
            tree[i] += v
            i += i & -i

    def prefix(i: int) -> int:  # marks at positions < i
        s = 0
        while i > 0:
            s += tree[i]
            i -= i & -i
        return s

    seen = 0  # keys marked so far (each key keeps one mark: its latest access)
    for i, key in enumerate(keys.tolist()):
        prev = last.get(key)
        if prev is not None:
            out[i] = seen - prefix(prev + 1)
            add(prev, -1)
        else:
            seen += 1
        add(i, 1)
        last[key] = i
    return out
