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
    """Strings that end the request, matched on the detokenized text as it is generated
    (`text.TextStream`), which is cut before the stop string."""

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


def stack_values(values: list[tuple]) -> tuple:
    """`row_values` of several rows, each field stacked over the rows (what `set_row` takes
    for an array of rows)."""
    return tuple(np.stack(field) for field in zip(*values, strict=True))


def set_row(rows: SamplerRows, row, values: tuple, fresh) -> SamplerRows:
    """Row `row` takes `values` (`row_values`); with `fresh` its sequence starts anew. Or rows
    `row` [R] take `values` stacked over them (`stack_values`), `fresh` [R]; a row at or past
    the batch is left alone."""
    temperature, top_k, top_p, min_p, penalty, seed = values
    fresh = jnp.asarray(fresh)[..., None]
    seen = rows.seen.at[row].set(jnp.where(fresh, False, rows.seen[row]), mode="drop")

    def put(a: jax.Array, value) -> jax.Array:
        return a.at[row].set(value, mode="drop")

    return rows.replace(temperature=put(rows.temperature, temperature),
                        top_k=put(rows.top_k, top_k), top_p=put(rows.top_p, top_p),
                        min_p=put(rows.min_p, min_p), penalty=put(rows.penalty, penalty),
                        seed=put(rows.seed, seed), seen=seen)


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


SEARCH_WAYS = {"gpu": 64}
"""Thresholds one pass of a prefix search tries at once (`_largest`), by backend (others: 16):
a pass is one fused reduction over [B, V, ways], so more ways mean fewer, heavier passes (a
32-bit search: six passes at 64 ways, eight at 16). A GPU pays for each pass's launch; the CPU
for the work (B=16 x 32,000 tokens: 192 ms a step at 64 ways, 84 at 16 on two cores)."""


def _ways() -> int:
    return SEARCH_WAYS.get(jax.default_backend(), 16)


def _value_keys(logits: jax.Array) -> jax.Array:
    """uint32 [B, V] in the order of the float32 logits (equal floats, -0.0 and 0.0 too, get
    equal keys)."""
    bits = jax.lax.bitcast_convert_type(jnp.where(logits == 0, 0.0, logits), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _largest(keys: jax.Array, weights: jax.Array, target: jax.Array, bits: int) -> jax.Array:
    """[B] uint32: per row the largest u < 2**bits with sum(weights[keys >= u]) >= target
    (0 where none is), found by a many-way search over the bits (`SEARCH_WAYS`), highest
    first: the weighted count above a threshold only falls as the threshold rises."""
    lo = jnp.zeros(keys.shape[:1], jnp.uint32)
    shift, per_pass = bits, _ways().bit_length() - 1
    while shift > 0:
        step = min(per_pass, shift)
        shift -= step
        tries = lo[:, None] | (jnp.arange(1 << step, dtype=jnp.uint32)[None, :] << shift)
        above = jnp.sum(jnp.where(keys[:, :, None] >= tries[:, None, :], weights[:, :, None],
                                  0), axis=1)
        j = jnp.maximum(jnp.sum(above >= target[:, None], axis=1) - 1, 0)
        lo = lo | (j.astype(jnp.uint32) << shift)
    return lo


def _prefix(keys: jax.Array, weights: jax.Array, target: jax.Array) -> jax.Array:
    """[B, V] bool: the tokens of the vocabulary ranked by value (descending, ties by index)
    whose better-ranked tokens weigh less than `target` [B] in all: the top-k set for unit
    weights and target k, the top-p set for probabilities and target p. Two searches: the
    value of the last kept token, then, among the tokens of that value, its index."""
    v = keys.shape[1]
    edge = _largest(keys, weights, target, 32)
    better = keys > edge[:, None]
    tied = keys == edge[:, None]
    rest = target - jnp.sum(jnp.where(better, weights, 0), axis=1)
    index_keys = jnp.uint32(v - 1) - jnp.arange(v, dtype=jnp.uint32)[None, :]  # index 0 best
    last = _largest(index_keys, jnp.where(tied, weights, 0), rest, max(1, (v - 1).bit_length()))
    return better | (tied & (index_keys >= last[:, None]))


def kept_logits(logits: jax.Array, rows: SamplerRows) -> jax.Array:
    """The distribution a sampled row draws from: its tempered float32 logits [B, V] with the
    tokens its filters drop at -inf. Temperature, then top-k, then top-p over what top-k kept
    (a token stays while the tokens ranked above it hold less than top_p), then min-p; ranked
    by value, ties by index. No sort and no data-dependent branch: each filter's cut is found
    by `_prefix`'s searches (docs/design.md, "Sampling")."""
    v = logits.shape[-1]
    t = jnp.where(rows.temperature > 0, rows.temperature, 1.0)[:, None]
    tempered = logits / t
    keys = _value_keys(logits)
    top_k = jnp.where((rows.top_k <= 0) | (rows.top_k > v), v, rows.top_k).astype(jnp.float32)
    kept = _prefix(keys, jnp.ones_like(logits), top_k)
    masked = jnp.where(kept, tempered, -jnp.inf)
    probs = jnp.exp(masked - jax.nn.logsumexp(masked, axis=-1, keepdims=True))
    # top_p 1 keeps every token: float32 sums may reach 1 before the last ones
    kept &= _prefix(keys, probs, jnp.where(rows.top_p >= 1.0, jnp.inf, rows.top_p))
    kept &= probs >= rows.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
    return jnp.where(kept, tempered, -jnp.inf)


def _draw(rows: SamplerRows, positions: jax.Array, logits: jax.Array) -> jax.Array:
    """Each row's draw [B] int32 from `logits` [B, V] by its key (seed, position)."""
    def one(seed, position, row_logits):
        key = jax.random.fold_in(jax.random.wrap_key_data(seed, impl="threefry2x32"), position)
        return jax.random.categorical(key, row_logits)

    return jax.vmap(one)(rows.seed, positions.astype(jnp.uint32), logits).astype(jnp.int32)


def sample(logits: jax.Array, rows: SamplerRows, positions: jax.Array) -> jax.Array:
    """Each row's next token [B] int32 from float32 logits [B, V]; `positions` [B]: where each
    token will sit in its sequence (the draw's key is (seed, position)). Rows with a
    temperature draw from `kept_logits` in vocabulary order, the others take the argmax of
    their penalized logits; a row's token depends on its own settings and logits only."""
    logits = penalize(logits, rows)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    drawn = _draw(rows, positions, kept_logits(logits, rows))
    return jnp.where(rows.temperature > 0, drawn, greedy)
