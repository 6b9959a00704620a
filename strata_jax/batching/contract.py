"""The engine contract: what the scheduler (and so the server and the Python API) drives, and
what every engine implements — the resident one (`batching.resident`), the offload engine
(`strata_runtime.engine.offload`) and the fake beside them (`batching.fake`). Rows are
integers in [0, capacity); a row is live from its prefill until `free`.

Like JetStream's engine API: `prefill` writes prompts into rows (packed, with the running
rows' decode steps riding along: `packing`), `step` dispatches one decode step of every live
row without waiting for it, `read` waits for a dispatched step's tokens, `free` ends a row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from strata_jax.batching.packing import Admission, Prefilled, Ride
from strata_jax.formats.config import ModelConfig


@dataclass(frozen=True)
class StepResult:
    """A dispatched decode step: the new token per row (meaningful for live rows; on the
    device until the engine's `read`) and the rows that failed during it (row -> reason;
    they are no longer live)."""

    tokens: Any
    failed: dict[int, str]
    logits: Any  # [rows, vocab] float32 on the device: read only if needed


@runtime_checkable
class EngineContract(Protocol):
    """What an engine gives the scheduler."""

    cfg: ModelConfig
    capacity: int
    """Rows of the batch."""
    max_len: int
    """Positions of each row (prompt and generated tokens)."""

    def prefill(self, admissions: Sequence[Admission], ride: Ride | None = None
                ) -> list[Prefilled]:
        """Write each admission's tokens into its row from its start and make the row live;
        `ride` (`packing.Ride`): the running rows whose decode steps ride along. A
        `Prefilled` per admission: its next token, or why it failed."""
        ...

    def step(self) -> StepResult:
        """Dispatch one decode step of every live row; returns at once."""
        ...

    def read(self, result: StepResult) -> np.ndarray:
        """A dispatched step's tokens [capacity], once it has run."""
        ...

    def free(self, row: int) -> None:
        """The row is no longer live (its KV stays until overwritten)."""
        ...
