"""Train a small float checkpoint in place on a Markov language, so its predictions are confident.

A random-weight model's next-token distribution is nearly flat, so any weight perturbation
(quantization) flips many argmaxes; after a few dozen Adam steps on a simple language the model
is confident where its data is, like a real LM. The language: every token is followed by one of
4 fixed successors (drawn from `seed`) with probabilities `SUCCESSOR_PROBS`, so the best
achievable loss is their entropy (~1.13 nats, vs log(vocab) for a flat model).

Every float weight is trained (embeddings, attention, norms, router, experts) except
`router_bias`, the fixed skew bias of synthetic models (see synth.py). Training runs in float32
whatever the checkpoint's dtype; the result is rounded back to that dtype and written with
`CheckpointWriter`, which fills a partial directory and renames it over the old checkpoint only
once complete.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from strata_jax.formats.checkpoint import FLOAT, CheckpointReader, CheckpointWriter
from strata_jax.formats.config import ModelConfig
from strata_jax.formats.tokenizer import copy_tokenizer_files
from strata_jax.model import decoder as mdl
from strata_jax.ops.pool import ExpertPool
from strata_jax.step import programs as step

SUCCESSOR_PROBS = np.array([0.55, 0.25, 0.12, 0.08])
MAX_TRAIN_PARAMS = 50_000_000
FROZEN = ("router_bias",)  # the skew knob: a fixed bias by design, not a learned weight
_WRITER_KEYS = ("format", "format_version", "dtype", "quantization", "model")  # commit() sets them
_B1, _B2, _EPS = 0.9, 0.999, 1e-8

Tree = dict[str, Any]


def language_entropy() -> float:
    """Entropy (nats) of a next token given the previous one: the loss floor."""
    return float(-(SUCCESSOR_PROBS * np.log(SUCCESSOR_PROBS)).sum())


def markov_successors(vocab: int, seed: int = 0) -> np.ndarray:
    """[vocab, 4] distinct successors of each token, drawn from `seed`."""
    rng = np.random.default_rng(seed)
    n = len(SUCCESSOR_PROBS)
    return np.stack([rng.choice(vocab, n, replace=False) for _ in range(vocab)])


def markov_batch(succ: np.ndarray, rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    """int32 sequences [n, t] of the chain, starting from uniformly random tokens."""
    n, t = shape
    x = np.empty((n, t), np.int32)
    x[:, 0] = rng.integers(0, succ.shape[0], n)
    for i in range(1, t):
        x[:, i] = succ[x[:, i - 1], rng.choice(succ.shape[1], size=n, p=SUCCESSOR_PROBS)]
    return x


def _read_weights(reader: CheckpointReader) -> tuple[Tree, Tree]:
    """(trainable, frozen) float32 trees: globals, unfused per-layer dense params, experts."""
    cfg = reader.config
    layers = [reader.read_layer_dense(i) for i in range(cfg.num_layers)]
    per_layer = [dict(reader.iter_layer_experts(i)) for i in range(cfg.num_layers)]
    experts = {k: np.stack([pl[k] for pl in per_layer]) for k in reader.expert_specs}
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    trainable = {
        "globals": {k: f32(v) for k, v in reader.read_globals().items()},
        "layers": [{k: f32(v) for k, v in lp.items() if k not in FROZEN} for lp in layers],
        "experts": {k: f32(v) for k, v in experts.items()},
    }
    frozen = [{k: f32(v) for k, v in lp.items() if k in FROZEN} for lp in layers]
    return trainable, {"layers": frozen}


def _model_args(cfg: ModelConfig, w: Tree, frozen: Tree) -> tuple[Tree, ExpertPool]:
    """The param tree (as `api.dense_params` lays it out) and resident pool that
    `step.forward_pass` takes, traced from the trees."""
    params = dict(w["globals"])
    fused = [mdl.fuse_qkv({**lp, **fz})
             for lp, fz in zip(w["layers"], frozen["layers"], strict=True)]
    params["layers"] = {k: jnp.stack([lp[k] for lp in fused]) for k in fused[0]}
    pool = ExpertPool(**{k: v.reshape(-1, *v.shape[2:]) for k, v in w["experts"].items()})
    return {"params": params}, pool


def _loss(cfg: ModelConfig, w: Tree, frozen: Tree, tokens: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy of sequences [B, T]."""
    params, pool = _model_args(cfg, w, frozen)
    tiers = step.resident_tiers(mdl.resident_slot_table(cfg))
    # every expert over every token: differentiable (the sorted path's loops are not)
    plan = step.StepPlan(row_chunks=False)
    logits, _ = step.forward_pass(cfg, plan, params, pool, tiers, tokens[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


@functools.partial(jax.jit, static_argnums=0)
def _train_step(cfg: ModelConfig, w, m, v, step, frozen, tokens, lr):
    """One Adam step (bias-corrected, no weight decay); returns the loss before it."""
    loss, g = jax.value_and_grad(_loss, argnums=1)(cfg, w, frozen, tokens)
    m = jax.tree.map(lambda m, g: _B1 * m + (1 - _B1) * g, m, g)
    v = jax.tree.map(lambda v, g: _B2 * v + (1 - _B2) * g * g, v, g)
    t = step + 1
    scale = lr * jnp.sqrt(1 - _B2**t) / (1 - _B1**t)
    w = jax.tree.map(lambda w, m, v: w - scale * m / (jnp.sqrt(v) + _EPS), w, m, v)
    return w, m, v, loss


def check_trainable(cfg: ModelConfig, steps: int) -> None:
    """Raise ValueError unless `steps` >= 1 and the model is small enough to train here."""
    if steps < 1:
        raise ValueError(f"training steps must be >= 1, got {steps}")
    params = cfg.param_counts()["total"]
    if params > MAX_TRAIN_PARAMS:
        raise ValueError(
            f"model has {params / 1e6:.1f} M params; training is for tiny test models "
            f"(at most {MAX_TRAIN_PARAMS / 1e6:.0f} M)"
        )


def _write_back(reader: CheckpointReader, w: Tree, frozen: Tree, trained: dict) -> None:
    """Rewrite the checkpoint at `reader.path` with weights `w`, in its own dtype."""
    cfg = reader.config
    extra = {k: v for k, v in reader.meta.items() if k not in _WRITER_KEYS}
    extra["trained"] = trained
    with CheckpointWriter(reader.path, cfg, overwrite=True, extra=extra) as writer:
        writer.write_globals({k: np.asarray(v) for k, v in w["globals"].items()})
        for i, (lp, fz) in enumerate(zip(w["layers"], frozen["layers"], strict=True)):
            writer.write_layer_dense(i, {k: np.asarray(v) for k, v in {**lp, **fz}.items()})
        for kind, arr in w["experts"].items():
            arr = np.asarray(arr)
            for li in range(cfg.num_layers):
                for e in range(cfg.num_experts):
                    writer.write_expert(li, e, kind, arr[li, e])
        copy_tokenizer_files(reader.path, writer)
        writer.commit()


def train_synthetic(
    path: str | os.PathLike,
    steps: int,
    *,
    seed: int = 0,
    lr: float = 3e-3,
    batch: tuple[int, int] = (32, 32),
    progress: bool | None = None,
) -> dict[str, float | int]:
    """Train the float checkpoint at `path` for `steps` Adam steps and rewrite it; see module doc.

    Returns (and stores under config.json "trained") the step count, the loss of the first
    and last steps (each on a fresh batch that the weights being measured never saw) and the
    language entropy. `progress=None` shows the bar only on a terminal.
    """
    reader = CheckpointReader(path)
    check_trainable(reader.config, steps)
    if reader.quantization != FLOAT:
        raise ValueError(f"{reader.path}: cannot train a quantized checkpoint")
    cfg = reader.config.replace(dtype="float32")
    w, frozen = _read_weights(reader)
    m = jax.tree.map(jnp.zeros_like, w)
    v = jax.tree.map(jnp.zeros_like, w)
    succ = markov_successors(cfg.vocab_size, seed)
    rng = np.random.default_rng([seed, 1])  # batches: a stream apart from the successors
    losses = []
    disable = None if progress is None else not progress
    with tqdm(range(steps), desc="train", disable=disable) as bar:
        for step in bar:
            tokens = jnp.asarray(markov_batch(succ, rng, batch))
            w, m, v, loss = _train_step(cfg, w, m, v, step, frozen, tokens, lr)
            losses.append(float(loss))
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    if not all(map(math.isfinite, losses)):
        raise RuntimeError(f"{reader.path}: training diverged (losses {losses}); try a lower lr")
    trained = {
        "steps": steps,
        "initial_loss": losses[0],
        "final_loss": losses[-1],
        "language_entropy": language_entropy(),
    }
    _write_back(reader, w, frozen, trained)
    return trained
