"""`strata sweep SWEEP.toml`: a ladder or grid of engine configurations, each benched in this
process on a fresh engine (docs/design.md, "Benchmarks and sweeps").

The TOML file (read by tomllib):

    [synth]                     # optional: write this synthetic checkpoint if `path` has none
    path = "/tmp/ckpt"          # (strata_jax.tools.synth.synthesize: shape, layers, skew, seed,
    dtype,
    shape = "tiny"              #  train_steps)
    [quantize]                  # optional: quantize `src` into `path` if `path` has none
    src = "/tmp/ckpt"           # (strata_jax.tools.quantize.quantize_checkpoint: experts, dense,
    path = "/tmp/ckpt-int4"     #  calib, calib_len, seed)
    experts = "int4-rtn"
    [base]                      # every rung starts from these
    checkpoint = "/tmp/ckpt"    # the checkpoint a rung benches (a rung may name another)
    prompts = 8                 # bench settings: BenchSettings fields
    hbm_budget = "8GB"          # engine knobs: EngineConfig field names, TOML values
    [[rung]]                    # a ladder: rungs in order ...
    name = "naive"              # required, unique
    from = "some earlier rung"  # optional: start from that rung's resolved keys, not [base]
    gpu_only = true             # optional: skipped (a row saying so) without a GPU
    batch_capacity = 1          # overrides: knobs, bench settings, checkpoint
    [grid]                      # ... or a grid: the cartesian product of these lists
    batch_capacity = [1, 8]     # (in the file's order), named "batch_capacity=1,policy=lru"
    policy = ["static", "lru"]

A knob value "default" is the EngineConfig default (e.g. a budget back to None); an
`int4_tiles` value is a table of `Int4Tiles` fields. Every rung is resolved and its
EngineConfig built before anything runs, so an unknown key or a bad value is an error naming
the rung and the key. Relative paths are relative to the working directory.

Output in OUT: `sweep.jsonl`, one row per rung appended as it finishes (a crash keeps the
rows before it; `--resume` keeps them and runs the rest), then `sweep.md` (the table, also
printed) and `sweep.png` (`strata_runtime.lab.sweep_report`).
"""

from __future__ import annotations

import dataclasses
import difflib
import gc
import itertools
import json
import os
import time
import tomllib
import traceback
from pathlib import Path
from typing import Any

from strata_jax.ops.int4_kernel import Int4Tiles
from strata_runtime.engine.config import EngineConfig
from strata_runtime.lab.bench import BenchSettings, config_doc, interval_text, run_bench
from strata_runtime.lab.ceilings import measure_ceilings
from strata_runtime.lab.fingerprint import hardware_fingerprint
from strata_runtime.lab.sweep_report import prediction_text
from strata_runtime.residency.ledger import parse_bytes

KNOBS = {f.name: f for f in dataclasses.fields(EngineConfig)}
SETTINGS = {f.name: f for f in dataclasses.fields(BenchSettings)}
RUNG_KEYS = ("name", "from", "gpu_only")
TOP_LEVEL = ("synth", "quantize", "base", "rung", "grid")
SYNTH_KEYS = ("path", "shape", "layers", "skew", "seed", "dtype", "train_steps")
QUANTIZE_KEYS = ("src", "path", "experts", "dense", "calib", "calib_len", "seed")
SIZE_KNOBS = ("hbm_budget", "host_budget", "workspace")


class SweepError(ValueError):
    """A sweep file that cannot run; the message names the file, the rung and the key."""


@dataclasses.dataclass(frozen=True)
class Rung:
    """One resolved rung (or grid point): what `run_bench` gets."""

    name: str
    checkpoint: str
    config: EngineConfig
    settings: BenchSettings
    keys: dict[str, Any]
    """The resolved keys as written (knobs and settings), for the record."""
    gpu_only: bool = False


@dataclasses.dataclass(frozen=True)
class Sweep:
    path: Path
    rungs: list[Rung]
    synth: dict[str, Any] | None = None
    quantize: dict[str, Any] | None = None


def _unknown(where: str, key: str, allowed: list[str]) -> SweepError:
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return SweepError(
        f"{where}: unknown key {key!r}{hint}. Engine knobs are EngineConfig's fields "
        f"({', '.join(KNOBS)}); bench settings: checkpoint, {', '.join(SETTINGS)}; rung "
        f"keys: {', '.join(RUNG_KEYS)}")


def _knob_value(where: str, key: str, value: Any) -> Any:
    """A TOML value as EngineConfig takes it, checked against the field's annotation."""
    field = KNOBS[key]
    if isinstance(value, str) and value == "default":
        return field.default
    kind = field.type
    if key == "int4_tiles":
        if not isinstance(value, dict):
            raise SweepError(f"{where}: int4_tiles takes a table of Int4Tiles fields, got "
                             f"{value!r}")
        try:
            return Int4Tiles(**value)
        except TypeError as e:
            raise SweepError(f"{where}: int4_tiles: {e}") from None
    ok = {
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "float": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "bool": lambda v: isinstance(v, bool),
        "str": lambda v: isinstance(v, str),
    }
    allowed = [t.strip() for t in str(kind).split("|") if t.strip() != "None"]
    if not any(ok.get(t, lambda v: False)(value) for t in allowed):
        raise SweepError(f"{where}: {key} = {value!r}: expected {kind}")
    if key in SIZE_KNOBS and isinstance(value, str):
        try:
            parse_bytes(value)
        except ValueError as e:
            raise SweepError(f"{where}: {key}: {e}") from None
    if kind == "float" and isinstance(value, int):
        return float(value)
    return value


def _check_keys(where: str, table: dict[str, Any], rung: bool) -> None:
    allowed = [*KNOBS, "checkpoint", *SETTINGS, *(RUNG_KEYS if rung else ())]
    for key in table:
        if key not in allowed:
            raise _unknown(where, key, allowed)


def _resolve(where: str, name: str, keys: dict[str, Any], gpu_only: bool) -> Rung:
    if "checkpoint" not in keys:
        raise SweepError(f"{where}: no checkpoint: set `checkpoint` in [base] or the rung "
                         "(or pass --checkpoint)")
    knobs = {k: _knob_value(f"{where}", k, v) for k, v in keys.items() if k in KNOBS}
    settings = {k: v for k, v in keys.items() if k in SETTINGS}
    try:
        config = EngineConfig(**knobs)
        bench = BenchSettings(**settings)
    except (TypeError, ValueError) as e:
        raise SweepError(f"{where}: {e}") from None
    need = bench.prompt_len + bench.new
    if need > config.max_len:
        raise SweepError(f"{where}: prompt_len + new = {need} do not fit max_len "
                         f"{config.max_len}")
    return Rung(name=name, checkpoint=str(keys["checkpoint"]), config=config, settings=bench,
                keys=dict(keys), gpu_only=gpu_only)


def _grid_points(where: str, grid: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    _check_keys(where, grid, rung=False)
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise SweepError(f"{where}: {key} must be a non-empty list of values, got "
                             f"{values!r}")
    names = list(grid)
    points = []
    for combo in itertools.product(*(grid[k] for k in names)):
        point = dict(zip(names, combo, strict=True))
        points.append((",".join(f"{k}={v}" for k, v in point.items()), point))
    return points


def load_sweep(path: str | Path, checkpoint: str | None = None) -> Sweep:
    """Read and resolve a sweep file (module docstring). `checkpoint` replaces [base]'s
    (rungs that name their own keep theirs), and a [synth] that writes [base]'s checkpoint
    writes this one instead (a [quantize] of it reads this one). Raises SweepError (a
    ValueError) naming the rung and the key for anything wrong."""
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise SweepError(f"{path}: not valid TOML: {e}") from None
    for key in doc:
        if key not in TOP_LEVEL:
            raise SweepError(f"{path}: unknown table {key!r} (expected {', '.join(TOP_LEVEL)})")
    base = dict(doc.get("base", {}))
    _check_keys(f"{path}: [base]", base, rung=False)
    synth, quantize = doc.get("synth"), doc.get("quantize")
    if checkpoint is not None:  # [synth] / [quantize] of [base]'s checkpoint follow it
        old = base.get("checkpoint")
        if synth is not None and old is not None and synth.get("path") == old:
            synth = {**synth, "path": checkpoint}
        if quantize is not None and old is not None and quantize.get("src") == old:
            quantize = {**quantize, "src": checkpoint}
        base["checkpoint"] = checkpoint
    rungs_doc, grid = doc.get("rung"), doc.get("grid")
    if (rungs_doc is None) == (grid is None):
        raise SweepError(f"{path}: give either [[rung]] entries or a [grid] table (not "
                         f"{'both' if rungs_doc is not None else 'neither'})")
    rungs: list[Rung] = []
    if grid is not None:
        for name, point in _grid_points(f"{path}: [grid]", grid):
            rungs.append(_resolve(f"{path}: grid point {name!r}", name, {**base, **point},
                                  False))
    else:
        resolved: dict[str, dict[str, Any]] = {}
        for i, entry in enumerate(rungs_doc):
            name = entry.get("name")
            if not isinstance(name, str) or not name:
                raise SweepError(f"{path}: rung {i + 1} has no name (name = \"...\")")
            where = f"{path}: rung {name!r}"
            if name in resolved:
                raise SweepError(f"{where}: a rung of that name comes earlier")
            _check_keys(where, entry, rung=True)
            start = base
            if "from" in entry:
                if entry["from"] not in resolved:
                    raise SweepError(f"{where}: from = {entry['from']!r}: no earlier rung of "
                                     "that name")
                start = resolved[entry["from"]]
            gpu_only = entry.get("gpu_only", False)
            if not isinstance(gpu_only, bool):
                raise SweepError(f"{where}: gpu_only must be true or false")
            keys = {**start, **{k: v for k, v in entry.items() if k not in RUNG_KEYS}}
            resolved[name] = keys
            rungs.append(_resolve(where, name, keys, gpu_only))
    for table, allowed, label in ((synth, SYNTH_KEYS, "synth"),
                                  (quantize, QUANTIZE_KEYS, "quantize")):
        if table is None:
            continue
        for key in table:
            if key not in allowed:
                raise SweepError(f"{path}: [{label}]: unknown key {key!r} (expected "
                                 f"{', '.join(allowed)})")
        if "path" not in table:
            raise SweepError(f"{path}: [{label}] needs a `path`")
    if quantize is not None and "src" not in quantize:
        raise SweepError(f"{path}: [quantize] needs a `src`")
    return Sweep(path=path, rungs=rungs, synth=synth, quantize=quantize)


def describe(sweep: Sweep) -> str:
    """The resolved rungs, as `--dry-run` prints them: checkpoint, bench settings and the
    whole EngineConfig (the keys the file set, then the defaults)."""
    lines = [f"{sweep.path}: {len(sweep.rungs)} rungs"]
    for r in sweep.rungs:
        doc = config_doc(r.config)
        knobs = {k: doc[k] for k in r.keys if k in doc}
        knobs.update({k: v for k, v in doc.items() if k not in knobs})
        where = "" if Path(r.checkpoint, "config.json").is_file() else " (not there yet)"
        lines.append(f"- {r.name}{' [gpu only]' if r.gpu_only else ''}: {r.checkpoint}{where}")
        lines.append(f"    bench: {json.dumps(dataclasses.asdict(r.settings))}")
        lines.append(f"    engine: {json.dumps(knobs)}")
    for label, table in (("synth", sweep.synth), ("quantize", sweep.quantize)):
        if table is not None:
            lines.append(f"[{label}] {json.dumps(table)}")
    return "\n".join(lines)


# --- running --------------------------------------------------------------------------------


def _has_checkpoint(path: str | Path) -> bool:
    return Path(path, "config.json").is_file()


def runnable(rungs: list[Rung]) -> list[Rung]:
    """The rungs this machine runs (gpu_only ones need a GPU backend)."""
    import jax

    gpu = jax.default_backend() == "gpu"
    return [r for r in rungs if gpu or not r.gpu_only]


def prepare(sweep: Sweep, rungs: list[Rung], log=print) -> None:
    """Write the [synth] / [quantize] checkpoints that `rungs` read and that are missing."""
    used = {str(Path(r.checkpoint)) for r in rungs}
    q, s = sweep.quantize, sweep.synth
    if q is not None and str(Path(q["src"])) not in used and str(Path(q["path"])) in used:
        used.add(str(Path(q["src"])))
    wrote = False
    if s is not None and str(Path(s["path"])) in used and not _has_checkpoint(s["path"]):
        from strata_jax.tools.synth import synthesize

        wrote = True
        t0 = time.perf_counter()
        kw = {k: v for k, v in s.items() if k not in ("path", "shape")}
        synthesize(s["shape"], s["path"], progress=False, **kw)
        log(f"wrote the synthetic checkpoint {s['path']} in {time.perf_counter() - t0:.1f} s")
    if q is not None and str(Path(q["path"])) in used and not _has_checkpoint(q["path"]):
        from strata_jax.tools.quantize import quantize_checkpoint

        wrote = True
        t0 = time.perf_counter()
        kw = {k: v for k, v in q.items() if k not in ("path", "src")}
        quantize_checkpoint(q["src"], q["path"], progress=False, **kw)
        log(f"wrote the quantized checkpoint {q['path']} in {time.perf_counter() - t0:.1f} s")
    if wrote:
        _flush(log)


def _flush(log) -> None:
    """Wait for the kernel to write the new checkpoints' dirty pages to disk: otherwise its
    write-back of many GB runs beside the next timed rungs and slows their host side."""
    t0 = time.perf_counter()
    os.sync()
    log(f"flushed the written checkpoints to disk in {time.perf_counter() - t0:.1f} s")


def _read_rows(jsonl: Path) -> list[dict[str, Any]]:
    if not jsonl.is_file():
        return []
    return [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]


def _compact(row: dict[str, Any]) -> dict[str, Any]:
    """A repeat row without what the summary already holds."""
    return {k: v for k, v in row.items() if k not in ("fingerprint", "kind", "checkpoint",
                                                      "label", "seed")}


def run_sweep(sweep: Sweep, out: str | Path, *, resume: bool = False, overwrite: bool = False,
              only: list[str] | None = None, log=print) -> list[dict[str, Any]]:
    """Bench every rung in order (module docstring), or the rungs named in `only` (in the
    file's order; the others keep whatever rows they have); returns the rows of sweep.jsonl in
    rung order. A rung that raises gets a row with its error, and the sweep goes on."""
    import jax

    names = [r.name for r in sweep.rungs]
    unknown = sorted(set(only or ()) - set(names))
    if unknown:
        raise SweepError(f"{sweep.path}: no rung named {unknown}; the rungs: {names}")

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "sweep.jsonl"
    earlier = _read_rows(jsonl)
    if earlier and not (resume or overwrite):
        raise FileExistsError(f"{jsonl} holds {len(earlier)} rows: --resume keeps them and "
                              "runs the other rungs, --overwrite starts afresh")
    if overwrite:
        jsonl.write_text("")
        earlier = []
    keys = {r.name: json.loads(json.dumps(r.keys, default=str)) for r in sweep.rungs}
    done = {r["rung"]: r for r in earlier if "error" not in r}
    for name in [n for n, r in done.items() if n in keys and r.get("keys") != keys[n]]:
        log(f"{name}: its keys changed since the row in {jsonl}: it runs again")
        del done[name]
    gpu = jax.default_backend() == "gpu"
    todo = [r for r in sweep.rungs if only is None or r.name in only]
    if all(r.name in done for r in todo):
        log(f"every rung has a row in {jsonl}: nothing to run")
        return [done[r.name] for r in sweep.rungs if r.name in done]
    fingerprint = None
    disk_rates: dict[str, Any] = {}  # a checkpoint's disk read rate, measured once per sweep
    for i, rung in enumerate(sweep.rungs):
        if rung not in todo:
            continue
        if rung.name in done:
            log(f"[{i + 1}/{len(sweep.rungs)}] {rung.name}: kept from {jsonl}")
            continue
        t0 = time.perf_counter()
        head = {"rung": rung.name, "index": i, "keys": rung.keys, "sweep": str(sweep.path)}
        if rung.gpu_only and not gpu:
            row = {**head, "skipped": "needs a GPU",
                   "fingerprint": fingerprint or hardware_fingerprint()}
        else:
            try:  # each checkpoint is written when the first rung that reads it comes up
                prepare(sweep, [rung], log)
                ceilings = _ceilings(disk_rates, log)
                fingerprint = fingerprint or hardware_fingerprint(ceilings["pinned_h2d_gbps"])
                result = run_bench(rung.checkpoint, rung.config, rung.settings,
                                   ceilings=ceilings, fingerprint=fingerprint, label=rung.name)
                row = {**head, **result.summary,
                       "repeat_rows": [_compact(r) for r in result.rows[:-1]]}
            except Exception as e:  # noqa: BLE001  (the next rungs still run)
                row = {**head, "error": f"{type(e).__name__}: {e}",
                       "traceback": traceback.format_exc(),
                       "fingerprint": fingerprint or hardware_fingerprint()}
        with open(jsonl, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        log(f"[{i + 1}/{len(sweep.rungs)}] {rung.name}: {_progress(row)} "
            f"({time.perf_counter() - t0:.1f} s)")
        gc.collect()  # a rung whose engine failed to build leaves its buffers to the collector
    by_name = {r["rung"]: r for r in _read_rows(jsonl)}  # the latest row of each rung
    return [by_name[r.name] for r in sweep.rungs if r.name in by_name]


def _ceilings(disk_rates: dict[str, Any], log) -> dict[str, Any]:
    """The ceilings of the rung about to run, measured right before it: one measurement at the
    start of a long sweep (or of a resumed one) can catch the device in a slower state than
    the rungs that follow, and a rung's bound and prediction divide by it. The checkpoints'
    disk rates (which drop the page cache to measure) are measured once per sweep."""
    c = {**measure_ceilings(), "disk_read_gbps": disk_rates}
    log(f"ceilings: pinned h2d {c['pinned_h2d_gbps']:.3g} GB/s, host read "
        f"{c['host_read_gbps']:.3g} GB/s, device read {c['hbm_read_gbps']:.4g} GB/s, matmul "
        f"{c['matmul_tflops']:.3g} TFLOP/s")
    return c


def _progress(row: dict[str, Any]) -> str:
    """A rung's line in the log as it finishes: it holds the figures a run cut short is read
    for (its rows may not be copied out), the prediction against measured among them."""
    if "error" in row:
        return f"error: {row['error']}"
    if "skipped" in row:
        return f"skipped: {row['skipped']}"
    b, p = row["bound"], row["predicted"]
    phases = ", ".join(f"{k} {v:.0f}" for k, v in row.get("build_phases_s", {}).items())
    measured = None if p is None else row.get(p["compare_with"])
    pred = ("" if measured is None else
            f"; decode {measured:.4g} tok/s, predicted {prediction_text(row)}")
    rates = [f"{name} {row[key]:.4g} GB/s" for name, key in
             (("experts", "expert_read_gbps"), ("dense", "dense_read_gbps")) if row.get(key)]
    rates_text = f"; kernel rates: {', '.join(rates)}" if rates else ""
    errors = row.get("kernel_rate_errors")
    errors_text = f" (not measured: {', '.join(errors)})" if errors else ""
    return (f"{interval_text(row['tok_s'])} tok/s, bound {b['bound_tok_s']:.4g} "
            f"({b['ratio']:.2f} of it, {b['binds']}){pred}{rates_text}{errors_text}; engine "
            f"built in {row['build_s']:.0f} s ({phases}), warm-up {row['warmup_s']:.0f} s")
