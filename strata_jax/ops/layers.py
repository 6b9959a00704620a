"""Transformer building blocks: RMSNorm, rotary embeddings, grouped-query attention."""

from __future__ import annotations

import jax
import jax.numpy as jnp

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


def rope_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables [..., head_dim] for integer positions, half-rotation layout."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [B, T, H, hd] by tables [B, T, hd]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention.

    q [B, T, Hq, hd]; k, v [B, S, Hkv, hd]; mask [B, T, S] (True = may attend).
    Returns [B, T, Hq * hd].
    """
    b, t, hq, hd = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, hd)
    scores = einsum_f32("btkgh,bskh->bkgts", qg, k)
    scores = scores * (hd**-0.5)
    scores = jnp.where(mask[:, None, None, :, :], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v)
    return out.reshape(b, t, hq * hd)
