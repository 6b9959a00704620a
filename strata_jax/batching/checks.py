"""The checks every path makes of a request's ids before it takes a row (the scheduler, the
resident API, the server, the command line)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from strata_jax.batching.packing import Admission
from strata_jax.formats.config import ModelConfig


def check_tokens(cfg: ModelConfig, tokens: Any, what: str = "tokens") -> None:
    """Refuse ids that are not integers or lie outside the vocabulary, naming `what` (a
    request, a flag) and the value."""
    tokens = np.asarray(tokens)
    if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"{what}: token ids must be integers, got {tokens.dtype} values "
                         f"such as {tokens.reshape(-1)[0].item()!r}")
    bad = tokens[(tokens < 0) | (tokens >= cfg.vocab_size)]
    if bad.size:
        raise ValueError(f"{what}: token id {int(bad[0])} is outside the vocabulary "
                         f"[0, {cfg.vocab_size})")


def check_request(cfg: ModelConfig, index: int, prompt: Any, max_new_tokens: int,
                  max_len: int) -> None:
    """The checks every path makes of request `index` before it takes a row."""
    what = f"request {index}"
    if len(prompt) == 0:
        raise ValueError(f"{what}: the prompt is empty")
    if max_new_tokens < 1:
        raise ValueError(f"{what}: max_new_tokens must be >= 1, got {max_new_tokens}")
    if len(prompt) + max_new_tokens > max_len:
        raise ValueError(f"{what}: {len(prompt)} prompt + {max_new_tokens} new tokens exceed "
                         f"max_len={max_len}")
    check_tokens(cfg, prompt, what)


def check_admissions(cfg: ModelConfig, admissions: Sequence[Admission], capacity: int,
                     max_len: int) -> None:
    """An engine's check of one `prefill` call: one admission per row, every row in the
    batch, every admission's tokens fitting max_len from its start and in the vocabulary."""
    rows = [a.row for a in admissions]
    if len(set(rows)) != len(rows):
        raise ValueError(f"rows {rows}: one admission per row")
    for a in admissions:
        if not 0 <= a.row < capacity:
            raise ValueError(f"row {a.row} is outside [0, {capacity})")
        if not len(a.tokens) or a.start + len(a.tokens) > max_len:
            raise ValueError(f"row {a.row}: {len(a.tokens)} tokens from position {a.start} "
                             f"do not fit max_len={max_len}")
        check_tokens(cfg, list(a.tokens), f"row {a.row}")
