"""`make demo`: synthesize a small skewed MoE, generate from text (greedy and sampled), print
tok/s and expert stats, then the same through the offload engine at a third of the experts."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import jax
import numpy as np

import strata_jax
from strata_jax.formats.tokenizer import encode_prompts, load_tokenizer
from strata_jax.step.sampling import SamplingParams
from strata_jax.tools.synth import synthesize, top_share

TEXTS = ["Four score and seven", "MoE offload", "hello, world", "JAX", "tok/s?"]
NEW_TOKENS = 32
SHAPE = {"batch_capacity": len(TEXTS), "max_len": 128}  # the engine's below: the same bits


def expert_stats(model: strata_jax.Model, seqs: list[list[int]]) -> list[tuple[float, float]]:
    """Per layer: top-20 % share of assignments, and the hit rate of a cache of those experts."""
    width = max(map(len, seqs))
    tokens = np.array([s + [0] * (width - len(s)) for s in seqs], np.int32)
    valid = (np.arange(width)[None, :] < np.array([len(s) for s in seqs])[:, None]).ravel()
    stats = []
    for layer_routes in strata_jax.api.routing(model, tokens):
        chosen = layer_routes[valid].ravel()
        counts = np.bincount(chosen, minlength=model.config.num_experts)
        hot = np.argsort(-counts)[: max(1, round(0.2 * len(counts)))]
        stats.append((top_share(counts), float(np.isin(chosen, hot).mean())))
    return stats


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tiny-skewed"
        print(synthesize("tiny", path, layers=6, skew=0.8, seed=0, dtype="float32",
                         progress=False))
        model = strata_jax.load(path)
        cfg = model.config
        print(f"model: {cfg.family}, {cfg.num_layers} layers, {cfg.num_experts} experts "
              f"top-{cfg.top_k}, {cfg.param_counts()['total'] / 1e6:.1f} M params")
        tok = load_tokenizer(path)  # synthetic models carry a byte-level tokenizer
        prompts = encode_prompts(tok, TEXTS)
        strata_jax.generate(model, prompts, NEW_TOKENS, **SHAPE)  # compiles the step
        t0 = time.perf_counter()
        outs = strata_jax.generate(model, prompts, NEW_TOKENS, **SHAPE)
        dt = time.perf_counter() - t0
        print("greedy (random weights: the continuations are reproducible noise, mostly "
              "token ids beyond the 256 bytes):")
        for text, out in zip(TEXTS, outs, strict=True):
            print(f"  {text!r} -> {out[:10]} ... ({len(out)} tokens)")
        sampled = strata_jax.generate(model, prompts[:1], NEW_TOKENS, **SHAPE,
                                      sampling=SamplingParams(temperature=0.8, top_p=0.9, seed=1))
        print(f"sampled (temperature 0.8, top-p 0.9, seed 1): {TEXTS[0]!r} -> "
              f"{sampled[0][:10]} ...")
        n = sum(map(len, outs))
        print(f"{n} tokens in {dt * 1e3:.1f} ms: {n / dt:.0f} tok/s "
              f"(batch {len(prompts)}, resident, {jax.default_backend()})")
        print("expert statistics (what the offload runtime's hot-expert cache will see):")
        stats = expert_stats(model, [p + o for p, o in zip(prompts, outs, strict=True)])
        for layer, (share, hit) in enumerate(stats):
            print(f"  layer {layer}: top-20% experts take {share:.0%} of assignments; "
                  f"a cache of those experts hits {hit:.0%}")
        offloaded(path, prompts, outs)


def offloaded(path: Path, prompts: list[list[int]], resident_outs: list[list[int]]) -> None:
    """The same prompts through the offload engine with a third of the experts in HBM."""
    from strata_jax.formats.checkpoint import CheckpointReader
    from strata_runtime.engine.config import EngineConfig
    from strata_runtime.engine.offload import Engine
    from strata_runtime.engine.stats import render
    from strata_runtime.residency.ledger import ModelBytes

    mb = ModelBytes.from_reader(CheckpointReader(path))
    kv = len(prompts) * 128 * mb.kv_bytes_per_token
    staging = 2 * mb.experts_per_layer * mb.bytes_per_expert
    budget = mb.global_bytes + mb.dense + kv + staging + mb.expert_bytes // 3
    config = EngineConfig(hbm_budget=budget, host_budget=mb.expert_bytes // 3,
                          **SHAPE)
    engine = Engine.from_checkpoint(path, config)
    print(f"offload engine, HBM budget {budget / 1e6:.2f} MB for a "
          f"{mb.total / 1e6:.2f} MB model:")
    print("\n".join("  " + line for line in engine.layout.ledger.render().splitlines()))
    engine.generate(prompts, NEW_TOKENS)  # compiles the step
    engine.reset_stats()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, NEW_TOKENS)
    dt = time.perf_counter() - t0
    n = sum(map(len, outs))
    assert outs == resident_outs, "offloaded tokens differ from the resident run"
    print(f"{n} tokens in {dt * 1e3:.1f} ms: {n / dt:.0f} tok/s, identical to the resident run")
    print("engine statistics (warm):")
    print(render(engine.stats()))


if __name__ == "__main__":
    main()
