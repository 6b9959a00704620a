"""Routing-statistics files: per-(layer, expert) routing counts recorded from a run, used to
rank experts into tiers at construction (hot ones pinned in HBM, then host memory)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from strata_jax.formats.config import ModelConfig

FORMAT = "strata-heat-v1"


def save_heat(path: str | os.PathLike, counts: np.ndarray, source: str = "") -> None:
    """Write routing counts [layers, experts] as JSON (atomically: a temp file, then rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    doc = {"format": FORMAT, "source": source, "counts": np.asarray(counts).tolist()}
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)


def load_heat(path: str | os.PathLike, cfg: ModelConfig) -> np.ndarray:
    """Routing counts [layers, experts] from `path`, checked against the model's shape."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read routing statistics {path}: {e}") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{path} is not a routing-statistics file (format {FORMAT})")
    counts = np.asarray(doc["counts"], np.float64)
    want = (cfg.num_layers, cfg.num_experts)
    if counts.shape != want:
        raise ValueError(f"{path}: counts of shape {counts.shape}, the model has {want} "
                         "(layers, experts)")
    if not np.isfinite(counts).all() or (counts < 0).any():
        raise ValueError(f"{path}: counts must be finite and non-negative")
    return counts


def ranked(cfg: ModelConfig, heat: np.ndarray | None) -> list[tuple[int, int]]:
    """(layer, expert) pairs hottest first; without heat, spread evenly over the layers."""
    order = [(layer, e) for e in range(cfg.num_experts) for layer in range(cfg.num_layers)]
    if heat is None:
        return order
    return sorted(order, key=lambda k: -heat[k])  # stable: ties keep the even spread
