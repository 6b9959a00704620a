"""Per-request sampling, done inside the compiled step.

docs/design.md, "Sampling". A request's `SamplingParams` become one row of `SamplerRows` when
it is prefilled; the step turns each live row's logits into its next token by that row's
settings. The random draw of the token at sequence position p is keyed by (the row's seed, p)
alone, so a seeded request gives the same tokens whatever else shares the batch, whichever row
it takes and however its prompt was chunked. Greedy rows (temperature 0) take the argmax of
their (penalized) logits: with no penalty, the bits of greedy decoding.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import chex
import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request picks its tokens (host side; validated on construction)."""

    temperature: float = 0.0
    """0: greedy (argmax). Otherwise logits are divided by it before sampling."""
    top_k: int = 0
    """Sample among the k likeliest tokens only (0: no limit)."""
    top_p: float = 1.0
    """Sample among the smallest set of likeliest tokens whose probability reaches top_p."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the likeliest one."""
    repetition_penalty: float = 1.0
    """Tokens already in the sequence (prompt or generated) have a positive logit divided by
    it and a negative one multiplied by it (as transformers does); 1: off. Applies to greedy
    rows too."""
    seed: int | None = None
    """The draw of the token at position p depends on (seed, p) only: a seeded request is
    reproducible whatever shares its batch. None: a fresh random seed per request."""
    stop_ids: frozenset[int] = field(default_factory=frozenset)
    """Token ids that end the request (the stop token is returned)."""
    stop: tuple[str, ...] = ()
    """Strings that end the request, matched on the detokenized text, which is cut before the
    stop string (`strata_jax.generate` after generation; the server while streaming)."""

    def __post_init__(self) -> None:
        checks = [
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (self.seed is None or 0 <= self.seed < 2**63, "seed must be in [0, 2**63)"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"{message}, got {self!r}")
        object.__setattr__(self, "stop_ids", frozenset(int(t) for t in self.stop_ids))
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def greedy(self) -> bool:
        """No draw and no penalty: the plain argmax the greedy programs compute."""
        return self.temperature == 0 and self.repetition_penalty == 1

    def resolved_seed(self) -> int:
        return secrets.randbits(63) if self.seed is None else self.seed


GREEDY = SamplingParams()


@chex.dataclass(frozen=True)
class SamplerRows:
    """Every row's SamplingParams on the device ([B] each; `seed` [B, 2] uint32, the threefry
    key of the row's seed) and `seen` [B, V] bool: the tokens of the row's sequence so far,
    which the repetition penalty reads."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    penalty: jax.Array
    seed: jax.Array
    seen: jax.Array


def greedy_rows(batch: int, vocab: int) -> SamplerRows:
    # distinct buffers each: the state is donated, and one buffer may not be donated twice
    return SamplerRows(temperature=jnp.zeros((batch,), jnp.float32),
                       top_k=jnp.zeros((batch,), jnp.int32),
                       top_p=jnp.ones((batch,), jnp.float32),
                       min_p=jnp.zeros((batch,), jnp.float32),
                       penalty=jnp.ones((batch,), jnp.float32),
                       seed=jnp.zeros((batch, 2), jnp.uint32),
                       seen=jnp.zeros((batch, vocab), jnp.bool_))


def row_values(params: SamplingParams) -> tuple:
    """The host scalars of one row, in the order `set_row` takes them (the seed must be
    resolved: the scheduler fixes it when the request is submitted)."""
    seed = params.resolved_seed()
    return (np.float32(params.temperature), np.int32(params.top_k), np.float32(params.top_p),
            np.float32(params.min_p), np.float32(params.repetition_penalty),
            np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32))


def set_row(rows: SamplerRows, row, values: tuple, fresh) -> SamplerRows:
    """Row `row` takes `values` (`row_values`); with `fresh` its sequence starts anew."""
    temperature, top_k, top_p, min_p, penalty, seed = values
    seen = rows.seen.at[row].set(jnp.where(fresh, False, rows.seen[row]))
    return rows.replace(temperature=rows.temperature.at[row].set(temperature),
                        top_k=rows.top_k.at[row].set(top_k), top_p=rows.top_p.at[row].set(top_p),
                        min_p=rows.min_p.at[row].set(min_p),
                        penalty=rows.penalty.at[row].set(penalty),
                        seed=rows.seed.at[row].set(seed), seen=seen)


def mark_seen(rows: SamplerRows, row_ids: jax.Array, tokens: jax.Array,
              valid: jax.Array) -> SamplerRows:
    """Add `tokens` (rows `row_ids`, where `valid`) to the rows' sequences."""
    rows_ix = jnp.where(valid, row_ids, rows.seen.shape[0])
    return rows.replace(seen=rows.seen.at[rows_ix, tokens].set(True, mode="drop"))


def penalize(logits: jax.Array, rows: SamplerRows) -> jax.Array:
    """The repetition penalty on float32 logits [B, V]; a penalty of 1 returns the same bits."""
    p = rows.penalty[:, None]
    hit = jnp.where(logits > 0, logits / p, logits * p)
    return jnp.where(rows.seen, hit, logits)


def filtered_logits(logits: jax.Array, rows: SamplerRows) -> tuple[jax.Array, jax.Array]:
    """The distribution a sampled row draws from: (logits sorted descending [B, V] with the
    filtered-out tokens at -inf, their token ids). Temperature, then top-k, then top-p on
    what top-k kept, then min-p."""
    t = jnp.where(rows.temperature > 0, rows.temperature, 1.0)[:, None]
    order = jnp.argsort(-logits, axis=-1, stable=True)
    ranked = jnp.take_along_axis(logits, order, axis=-1) / t
    rank = jnp.arange(logits.shape[-1])[None, :]
    keep = (rows.top_k[:, None] == 0) | (rank < rows.top_k[:, None])
    ranked = jnp.where(keep, ranked, -jnp.inf)
    probs = jax.nn.softmax(ranked, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the likelier tokens
    keep &= (before < rows.top_p[:, None]) | (rank == 0)
    keep &= probs >= rows.min_p[:, None] * probs[:, :1]
    return jnp.where(keep, ranked, -jnp.inf), order


CANDIDATES = 256
"""Likeliest tokens a filtered row ranks by `lax.top_k` (no sort of the vocabulary); a row whose
kept set may reach past them is drawn from the full sort instead."""


def _plain(rows: SamplerRows) -> jax.Array:
    """[B] bool: rows with no top-k, top-p or min-p filter, drawn straight from their
    tempered logits in vocabulary order (nothing to rank)."""
    return (rows.top_k == 0) & (rows.top_p >= 1.0) & (rows.min_p <= 0.0)


def candidate_logits(logits: jax.Array, rows: SamplerRows, count: int = CANDIDATES
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`filtered_logits` over the `count` likeliest tokens only: (their tempered logits with the
    filtered-out ones at -inf [B, count], their ids, and [B] bool whether the row's kept set
    lies within them, so that this equals the full sort's filter). Probabilities are
    normalized over the whole vocabulary that top-k keeps, as the full filter's are."""
    t = jnp.where(rows.temperature > 0, rows.temperature, 1.0)[:, None]
    values, order = jax.lax.top_k(logits, count)
    ranked = values / t
    rank = jnp.arange(count)[None, :]
    top_k = rows.top_k[:, None]
    keep = (top_k == 0) | (rank < top_k)
    everything = jax.nn.logsumexp(logits / t, axis=-1, keepdims=True)
    within = jax.nn.logsumexp(jnp.where(keep, ranked, -jnp.inf), axis=-1, keepdims=True)
    lse = jnp.where(top_k == 0, everything, within)
    probs = jnp.where(keep, jnp.exp(ranked - lse), 0.0)
    before = jnp.cumsum(probs, axis=-1) - probs
    keep &= (before < rows.top_p[:, None]) | (rank == 0)
    floor = rows.min_p[:, None] * probs[:, :1]
    keep &= probs >= floor
    covered = ((rows.top_k > 0) & (rows.top_k <= count)) | (
        jnp.sum(probs, axis=-1) >= rows.top_p) | (probs[:, -1] < floor[:, 0])
    return jnp.where(keep, ranked, -jnp.inf), order, covered


def _draw(rows: SamplerRows, positions: jax.Array, logits: jax.Array) -> jax.Array:
    """Each row's draw [B] from `logits` [B, N] by its key (seed, position): an index < N."""
    def one(seed, position, row_logits):
        key = jax.random.fold_in(jax.random.wrap_key_data(seed, impl="threefry2x32"), position)
        return jax.random.categorical(key, row_logits)

    return jax.vmap(one)(rows.seed, positions.astype(jnp.uint32), logits)


def _draw_ranked(rows: SamplerRows, positions: jax.Array, ranked: jax.Array,
                 order: jax.Array) -> jax.Array:
    """Each row's token [B] int32 drawn from `ranked` [B, N], whose token ids are `order`."""
    pick = _draw(rows, positions, ranked)
    return jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)


def sample(logits: jax.Array, rows: SamplerRows, positions: jax.Array) -> jax.Array:
    """Each row's next token [B] int32 from float32 logits [B, V]; `positions` [B]: where each
    token will sit in its sequence (the draw's key is (seed, position)). A row's way of
    drawing depends on its own settings and logits only (docs/design.md, "Sampling"): plain
    rows draw from their tempered logits, filtered ones from the `CANDIDATES` likeliest
    tokens, or from the full sort when their kept set may reach past those."""
    logits = penalize(logits, rows)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    t = jnp.where(rows.temperature > 0, rows.temperature, 1.0)[:, None]
    plain = _draw(rows, positions, logits / t).astype(jnp.int32)
    count = min(CANDIDATES, logits.shape[-1])
    ranked, order, covered = candidate_logits(logits, rows, count)
    drawn = jnp.where(_plain(rows), plain, _draw_ranked(rows, positions, ranked, order))
    if count < logits.shape[-1]:  # rows the candidates do not cover take the full sort
        full = ~_plain(rows) & ~covered & (rows.temperature > 0)

        def sorted_draw():
            return _draw_ranked(rows, positions, *filtered_logits(logits, rows))

        drawn = jnp.where(full, jax.lax.cond(jnp.any(full), sorted_draw, lambda: drawn), drawn)
    return jnp.where(rows.temperature > 0, drawn, greedy)
