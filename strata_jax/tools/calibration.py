"""Calibration token sequences for GPTQ, and sampling from a float model.

Calibration sequences come from a file (.npy int array [N, T], or .json list of token lists of
any lengths) or are sampled from the float model itself (temperature 1, random first tokens),
which loads the *whole float model* resident for the sampling. Either way a `mix_random`
fraction of the sequences are uniform-random tokens, so that rarely routed experts still get
calibration data. Sequences of different lengths are right-padded to the longest one: attention
is causal, so a sequence's real tokens never see its padding, and only real tokens' rows enter
the Hessians and the per-expert token counts.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.api import Model, load
from strata_jax.formats.config import ModelConfig
from strata_jax.model.moe import ExpertPool
from strata_jax.step import programs as step

SAMPLE_BATCH = 64  # sequences sampled at once
CALIB_STREAM, HELDOUT_STREAM = 0, 1  # sampling streams: held-out tokens never repeat calibration
PAD_TOKEN = 0  # right-padding of shorter calibration sequences (never enters any statistic)


@dataclass(frozen=True)
class Calibration:
    """Calibration sequences: int32 [N, T] right-padded with PAD_TOKEN past each of `lengths`."""

    tokens: np.ndarray
    lengths: np.ndarray  # int [N], real tokens per sequence
    description: str

    @property
    def valid(self) -> np.ndarray:
        """bool [N, T]: which positions are real tokens."""
        return np.arange(self.tokens.shape[1]) < self.lengths[:, None]

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


def pad_sequences(seqs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(int32 [N, max length] right-padded with PAD_TOKEN, lengths [N]) of token sequences."""
    lengths = np.array([len(q) for q in seqs], np.int64)
    tokens = np.full((len(seqs), int(lengths.max())), PAD_TOKEN, np.int32)
    for row, q in zip(tokens, seqs, strict=True):
        row[: len(q)] = q
    return tokens, lengths


def parse_calib(spec: str | int) -> str | int:
    """A calibration argument: a sequence count (int or digit string) or a file path."""
    if isinstance(spec, int) or (isinstance(spec, str) and spec.strip().isdigit()):
        n = int(spec)
        if n < 1:
            raise ValueError(f"calibration needs at least 1 sequence, got {n}")
        return n
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"calibration file {str(path)!r} not found")
    if path.suffix not in (".npy", ".json"):
        raise ValueError(f"calibration file {path}: expected .npy or .json, got {path.suffix!r}")
    return str(path)


def read_token_sequences(path: str | os.PathLike, vocab_size: int) -> list[np.ndarray]:
    """Token sequences (int32, any lengths) from .npy (int [N, T]) or .json (list of lists)."""
    path = Path(path)
    try:
        seqs = _npy_tokens(path) if path.suffix == ".npy" else _json_tokens(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"token file {path}: unreadable ({e})") from e
    if not seqs:
        raise ValueError(f"token file {path}: no sequences")
    for i, q in enumerate(seqs):
        if q.size == 0:
            raise ValueError(f"token file {path}: sequence {i} is empty")
        if q.min() < 0 or q.max() >= vocab_size:
            raise ValueError(
                f"token file {path}: token ids must be in [0, {vocab_size}), "
                f"got {q.min()}..{q.max()} in sequence {i}"
            )
    return [q.astype(np.int32) for q in seqs]


def read_token_file(path: str | os.PathLike, vocab_size: int) -> np.ndarray:
    """Equal-length token sequences int32 [N, T] from a .npy or .json file (see above)."""
    seqs = read_token_sequences(path, vocab_size)
    lengths = sorted({len(q) for q in seqs})
    if len(lengths) > 1:
        raise ValueError(
            f"token file {path}: sequences must be equal-length here, got lengths "
            f"{lengths[0]}..{lengths[-1]}"
        )
    return np.stack(seqs)


def _npy_tokens(path: Path) -> list[np.ndarray]:
    raw = np.load(path)
    if raw.ndim != 2 or not np.issubdtype(raw.dtype, np.integer):
        raise ValueError(
            f"expected an integer array [sequences, length], got dtype {raw.dtype} "
            f"shape {raw.shape}"
        )
    return list(raw)


def _json_tokens(path: Path) -> list[np.ndarray]:
    data = json.loads(path.read_text())
    if not isinstance(data, list) or not all(isinstance(seq, list) for seq in data):
        raise ValueError("expected a list of token lists")
    for i, seq in enumerate(data):
        bad = next((t for t in seq if not isinstance(t, int) or isinstance(t, bool)), None)
        if bad is not None:
            raise ValueError(f"sequence {i}: {bad!r} is not a token id (an integer)")
    return [np.asarray(seq, np.int64) for seq in data]


def random_sequences(n: int, length: int, vocab_size: int, seed: int) -> np.ndarray:
    """Uniform-random token sequences int32 [n, length]."""
    return np.random.default_rng([seed, 7]).integers(0, vocab_size, (n, length), np.int32)


@functools.partial(jax.jit, static_argnames=("cfg", "length"))
def _sample_batch(
    cfg: ModelConfig, params: dict[str, Any], pool: ExpertPool, slot_table: jax.Array,
    first: jax.Array, seeds: jax.Array, length: int,
) -> jax.Array:  # fmt: skip
    """Temperature-1 continuations of first tokens [B] to [B, length] by the step's sampler;
    row b draws with seed `seeds[b]` (uint32 [B, 2])."""
    b = first.shape[0]
    out = jnp.zeros((b, length), jnp.int32).at[:, 0].set(first)
    tiers = step.resident_tiers(slot_table)
    state = step.init_state(cfg, b, length)
    sampler = state.sampler.replace(temperature=jnp.ones(b, jnp.float32), seed=seeds)
    state = state.replace(tokens=first, live=jnp.ones(b, jnp.bool_), sampler=sampler)
    plan = step.StepPlan(sample=True)

    def body(i, carry):
        out, state = carry
        state, _, _ = step.decode_step(cfg, plan, params, pool, tiers, state)
        return out.at[:, i + 1].set(state.tokens), state

    out, _ = jax.lax.fori_loop(0, length - 1, body, (out, state))
    return out


def check_seed(seed: int) -> None:
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}")


def sample_sequences(model: Model, n: int, length: int, seed: int, stream: int) -> np.ndarray:
    """n sequences [n, length] sampled from `model` at temperature 1 from random first tokens.

    `stream` separates calibration (CALIB_STREAM) from held-out tokens (HELDOUT_STREAM), so
    the two never coincide even with the same seed. Batches are padded to SAMPLE_BATCH rows
    (one compilation for any n).
    """
    if length < 1:
        raise ValueError(f"sequence length must be >= 1, got {length}")
    check_seed(seed)
    cfg = model.config
    if n == 0:
        return np.zeros((0, length), np.int32)
    first = np.random.default_rng([seed, stream]).integers(0, cfg.vocab_size, n, np.int32)
    args = (cfg, model.params, model.experts, model.slot_table)
    out = []
    for i in range(0, n, SAMPLE_BATCH):
        batch = np.zeros(SAMPLE_BATCH, np.int32)
        batch[: min(SAMPLE_BATCH, n - i)] = first[i : i + SAMPLE_BATCH]
        seeds = np.random.SeedSequence([seed, stream, i]).generate_state(2 * SAMPLE_BATCH)
        seeds = seeds.reshape(SAMPLE_BATCH, 2)
        out.append(np.asarray(_sample_batch(*args, batch, seeds, length))[: n - i])
    return np.concatenate(out).astype(np.int32)


def calibration_tokens(
    src: str | os.PathLike,
    spec: str | int,
    cfg: ModelConfig,
    calib_len: int = 64,
    mix_random: float = 0.25,
    seed: int = 0,
) -> Calibration:
    """Calibration sequences from a file, or sampled from the float model at `src` (loaded whole).

    A `mix_random` fraction of the returned sequences are uniform-random tokens.
    """
    if not 0 <= mix_random < 1:
        raise ValueError(f"mix_random must be in [0, 1), got {mix_random}")
    spec = parse_calib(spec)
    if isinstance(spec, str):
        return _file_calibration(spec, cfg.vocab_size, mix_random, seed)
    n_rand = round(spec * mix_random)
    sampled = sample_sequences(load(src), spec - n_rand, calib_len, seed, CALIB_STREAM)
    rand = random_sequences(n_rand, calib_len, cfg.vocab_size, seed)
    desc = (
        f"{spec - n_rand} sequences sampled from the float model (temperature 1, seed {seed}) "
        f"+ {n_rand} random sequences, length {calib_len}"
    )
    tokens = np.concatenate([sampled, rand])
    return Calibration(tokens, np.full(len(tokens), calib_len), desc)


def _file_calibration(path: str, vocab_size: int, mix_random: float, seed: int) -> Calibration:
    """A token file's sequences, and random ones taking the file's lengths in turn."""
    data, lengths = pad_sequences(read_token_sequences(path, vocab_size))
    n_rand = round(len(data) * mix_random / (1 - mix_random))
    rand = random_sequences(n_rand, data.shape[1], vocab_size, seed)
    rand_lengths = lengths[np.arange(n_rand) % len(lengths)]
    rand[np.arange(data.shape[1]) >= rand_lengths[:, None]] = PAD_TOKEN
    lo, hi = lengths.min(), lengths.max()
    shape = f"{len(data)} x {hi}" if lo == hi else f"{len(data)} x {lo}..{hi} ({lengths.sum()})"
    desc = f"file {path}: {shape} tokens + {n_rand} random sequences"
    return Calibration(np.concatenate([data, rand]), np.concatenate([lengths, rand_lengths]), desc)
