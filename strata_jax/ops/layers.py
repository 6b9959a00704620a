"""Transformer building blocks: RMSNorm, rotary embeddings (partial, interleaved, YaRN),
grouped-query attention."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

NEG_INF = -1e30


def ordered_sum(a: jax.Array, axis: int, keepdims: bool = False) -> jax.Array:
    """Sum over a short `axis` as a chain of adds in index order.

    A reduce's order is the emitter's choice, which on GPUs follows how the reduce was fused,
    so two programs (resident and offloaded: docs/design.md, "Measured") could round the same
    sum differently; adds of floats are never reassociated, so this order is fixed.
    """
    parts = jnp.moveaxis(a, axis, 0)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return jnp.expand_dims(total, axis) if keepdims else total


def einsum_f32(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """einsum accumulated and returned in float32.

    XLA:CPU cannot run a bf16 x bf16 -> f32 dot, so there the operands are upcast instead.
    """
    if jax.default_backend() == "cpu":
        return jnp.einsum(spec, a.astype(jnp.float32), b.astype(jnp.float32))
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, scaled in the input dtype (as transformers does)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def rope_tables(positions: jax.Array, dim: int, theta: float,
                scaling: tuple[tuple[str, float], ...] | None = None
                ) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables [..., dim] for integer positions, half-rotation layout. `scaling`:
    YaRN's fields as Hugging Face names them (`ModelConfig.rope_scaling`), its attention
    factor folded into the tables as transformers does."""
    if scaling is None:
        inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
        factor = 1.0
    else:
        inv_freq, factor = yarn_frequencies(dim, theta, dict(scaling))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    if factor == 1.0:
        return jnp.cos(emb), jnp.sin(emb)
    return jnp.cos(emb) * factor, jnp.sin(emb) * factor


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_frequencies(dim: int, theta: float, p: dict[str, Any]) -> tuple[np.ndarray, float]:
    """YaRN's inverse frequencies [dim / 2] float32 and attention factor (transformers'
    `_compute_yarn_parameters`, in float32 as it computes them)."""
    factor = float(p["factor"])
    attention = p.get("attention_factor")
    if attention is None:
        mscale, all_dim = p.get("mscale"), p.get("mscale_all_dim")
        attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
                     if mscale and all_dim else yarn_mscale(factor))
    original = float(p["original_max_position_embeddings"])

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    pos = np.float32(theta) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
    extrapolation = 1 - np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low),
                                0, 1).astype(np.float32)
    inv = (1 / (factor * pos)) * (1 - extrapolation) + (1 / pos) * extrapolation
    return inv.astype(np.float32), float(attention)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array,
               interleave: bool = False) -> jax.Array:
    """Rotate the first cos.shape[-1] dims of x [B, T, H, hd] (the rest pass: partial
    rotary) by tables [B, T, dim]. `interleave`: the rotated dims pair up as (x0, x1), (x2,
    x3), ... and come out as halves (DeepSeek's layout; transformers'
    `apply_rotary_pos_emb_interleave`): q and k are permuted alike, so q . k is unchanged."""
    dim = cos.shape[-1]
    rot = x[..., :dim]
    if interleave:
        rot = jnp.concatenate([rot[..., 0::2], rot[..., 1::2]], axis=-1)
    half = dim // 2
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    out = rot * cos + rotated * sin
    return out if dim == x.shape[-1] else jnp.concatenate([out, x[..., dim:]], axis=-1)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
           sinks: jax.Array | None = None) -> jax.Array:
    """Grouped-query attention.

    q [B, T, Hq, hd]; k, v [B, S, Hkv, hd]; mask [B, T, S] (True = may attend); `sinks` [Hq]:
    a learned logit per head that joins the softmax's denominator and mixes no value
    (GPT-OSS's attention sinks; None: none). Returns [B, T, Hq * hd].
    """
    b, t, hq, hd = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, hd)
    scores = einsum_f32("btkgh,bskh->bkgts", qg, k)
    scores = scores * (hd**-0.5)
    scores = jnp.where(mask[:, None, None, :, :], scores, NEG_INF)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    else:
        probs = _softmax_with_sinks(scores, sinks.reshape(hkv, hq // hkv)).astype(v.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v)
    return out.reshape(b, t, hq * hd)


def _softmax_with_sinks(scores: jax.Array, sinks: jax.Array) -> jax.Array:
    """softmax over the last axis of scores [B, Hkv, G, T, S] with one more logit per head,
    sinks [Hkv, G], in the denominator; float32."""
    sink = sinks.astype(jnp.float32)[None, :, :, None, None]
    top = jnp.maximum(jnp.max(scores, axis=-1, keepdims=True), sink)
    e = jnp.exp(scores - top)
    return e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - top))
