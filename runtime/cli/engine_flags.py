"""Command-line flags for every `EngineConfig` field, generated from the dataclass.

Each field's flag, type and help come from its annotation and its attribute docstring in
`runtime/engine/offload.py`, so a new knob cannot be left without a flag: `add_engine_flags` refuses
a field whose type it does not know. The argparse defaults are SUPPRESS, so `engine_config`
sees exactly the flags that were given and can refuse the ones that need `--hbm` without it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import os
from collections.abc import Callable

from strata_jax.model.misses import MODES as MISS_MODES
from strata_jax.ops.int4_kernel import Int4Tiles
from strata_jax.step.programs import PREDICTORS
from strata_runtime.engine.config import DEQUANT, LAYOUTS, EngineConfig
from strata_runtime.residency.cache_policy import ADMITS, POLICIES
from strata_runtime.residency.ledger import parse_bytes

FLAG_NAMES = {"hbm_budget": "--hbm", "host_budget": "--host-mem", "heat_file": "--heat"}
"""Fields whose flag is not `--field-name`."""
CHOICES = {"predictor": PREDICTORS, "policy": POLICIES, "cache_admit": ADMITS,
           "dequant": DEQUANT, "weight_layout": LAYOUTS, "miss": MISS_MODES}
WITHOUT_HBM = ("batch_capacity", "max_len", "prefill_chunk", "prefill_rows", "expert_devices")
"""Fields that also shape the resident path (`strata_jax.generate`); the rest need --hbm."""
METAVARS = {"hbm_budget": "SIZE", "host_budget": "SIZE", "workspace": "SIZE",
            "heat_file": "FILE", "record_trace": "FILE", "int4_tiles": "K=V,...",
            "miss_rates": "K=V,...", "replay_trace": "FILE"}


def flag_name(field: str) -> str:
    return FLAG_NAMES.get(field, "--" + field.replace("_", "-"))


def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass (the string literal under each field)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _size(value: str) -> str:
    """A byte size as the ledger reads it ('8GB', '20GiB', bytes), checked at parse time."""
    try:
        parse_bytes(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def _tiles(value: str) -> Int4Tiles:
    """'rows=64,stages=2,groups=2' -> Int4Tiles (the scalar fields; the rest keep defaults)."""
    kinds = {f.name: f.type for f in dataclasses.fields(Int4Tiles) if f.name != "down"}
    kwargs: dict[str, int | bool] = {}
    for item in filter(None, value.split(",")):
        key, sep, raw = item.partition("=")
        if not sep or key not in kinds:
            raise argparse.ArgumentTypeError(
                f"{item!r}: expected KEY=VALUE with KEY one of {', '.join(kinds)}")
        try:
            kwargs[key] = (raw.lower() in ("1", "true", "yes") if kinds[key] == "bool"
                           else int(raw))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r}: {key} takes an integer") from None
    return Int4Tiles(**kwargs)


# annotation (as written in engine.py) -> add_argument keywords
_BY_TYPE: dict[str, Callable[[dataclasses.Field], dict]] = {
    "int | str | None": lambda f: {"type": _size},
    "int | str": lambda f: {"type": _size},
    "int": lambda f: {"type": int},
    "int | None": lambda f: {"type": int},
    "float": lambda f: {"type": float},
    "str": lambda f: {"type": str, "choices": CHOICES.get(f.name)},
    "str | None": lambda f: {"type": str},
    "bool": lambda f: {"action": argparse.BooleanOptionalAction},
    "bool | None": lambda f: {"action": argparse.BooleanOptionalAction},
    "Int4Tiles | None": lambda f: {"type": _tiles},
}


def _help(doc: str, default: object) -> str:
    shown = "none" if default is None else default
    return f"{doc} (default: {shown})".replace("%", "%%")


class _HostMoved(argparse.Action):
    """The old spelling of the host-memory budget: a clear error, not a silent other meaning."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"--host {values}: the host-memory budget is --host-mem SIZE (--host is "
                     "the address `strata serve` listens on)")


def add_engine_flags(parser: argparse.ArgumentParser, host_moved: bool = True) -> None:
    """One flag per `EngineConfig` field, in an "engine" group of `parser`; with `host_moved`
    (every command but `strata serve`, whose --host is its address) --host is refused with
    the budget's flag named."""
    group = parser.add_argument_group(
        "engine", "offload engine knobs (runtime/engine/offload.py, EngineConfig); all but "
                  f"{', '.join(map(flag_name, WITHOUT_HBM))} need --hbm")
    docs = field_docs(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.type not in _BY_TYPE:
            raise TypeError(f"EngineConfig.{f.name}: no command-line flag for type {f.type!r}; "
                            f"add it to runtime/cli/engine_flags.py (_BY_TYPE)")
        kwargs = {k: v for k, v in _BY_TYPE[f.type](f).items() if v is not None}
        if "type" in kwargs and "choices" not in kwargs:
            kwargs["metavar"] = METAVARS.get(f.name, {int: "N", float: "X"}.get(kwargs["type"]))
        group.add_argument(flag_name(f.name), dest=f.name, default=argparse.SUPPRESS,
                           help=_help(docs.get(f.name, ""), f.default), **kwargs)
    if host_moved:
        group.add_argument("--host", action=_HostMoved, help=argparse.SUPPRESS)


def engine_config(args: argparse.Namespace) -> EngineConfig | None:
    """The EngineConfig of the parsed engine flags, or None when --hbm was not given (then a
    flag that needs it is a ValueError naming the flag; the `WITHOUT_HBM` ones are read by
    `resident_config`)."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
             if hasattr(args, f.name)}
    if "hbm_budget" not in given:
        stray = [flag_name(k) for k in given if k not in WITHOUT_HBM]
        if stray:
            raise ValueError(f"{', '.join(stray)}: only the offload engine takes "
                             f"{'these flags' if len(stray) > 1 else 'this flag'}; add --hbm "
                             "SIZE, or drop it")
        return None
    heat = given.get("heat_file")
    if heat is not None and not os.path.isfile(heat):
        raise FileNotFoundError(f"--heat {heat}: no such file (write one with --record-heat)")
    return EngineConfig(**given)


def resident_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of the `WITHOUT_HBM` flags given (the rest its defaults): the shape
    and the devices of a resident run."""
    return EngineConfig(**{k: getattr(args, k) for k in WITHOUT_HBM if hasattr(args, k)})

