"""The peer beside our rows: HF transformers + accelerate on the same shape and HBM budget
(issue 20's "a peer in the same run").

A transformers model of one of our synthetic shapes (`strata_jax.tools.synth.SHAPES`: the
Mixtral-8x7B shape as a Mixtral, the seed-125b one as a Qwen2-MoE) is built on the meta device
and its weights are written directly as random bf16 tensors on the host (`fill_random`: no
torch init and no independent draw per value, either of which takes minutes at this size);
accelerate then places it by `infer_auto_device_map` under `max_memory={0: BUDGET, "cpu":
...}`, so the layers that do not fit are streamed from host memory on every forward, as
accelerate offloads. Decode tok/s at each batch: greedy `generate` of NEW tokens after a
warm-up, minus a one-token run (the prefill), so the figure is
decode only, comparable with the engine's decode tok/s.

GPU only in practice (on a CPU the whole model sits in host memory: a smoke test).
Run: `python -m benchmarks.peer_accelerate --shape mixtral-8x7b --layers 8 --budget 8GiB
--batch 1,16 --out DIR`; appends DIR/peer_accelerate.jsonl.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from benchmarks.common import machine
from strata_jax.tools.synth import synth_config

LAYER_CLASS = {"mixtral": "MixtralDecoderLayer", "qwen2_moe": "Qwen2MoeDecoderLayer"}


def hf_config(shape: str, layers: int | None):
    """(our ModelConfig, the transformers config of the same shape): Mixtral, or Qwen2-MoE
    (the seed-125b shape: a gated shared expert beside the routed ones)."""
    import transformers

    cfg = synth_config(shape, layers=layers)
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                  num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                  num_key_value_heads=cfg.num_kv_heads, num_experts_per_tok=cfg.top_k,
                  rms_norm_eps=cfg.rms_eps, rope_theta=cfg.rope_theta,
                  max_position_embeddings=4096, tie_word_embeddings=cfg.tie_word_embeddings,
                  dtype="bfloat16")
    if cfg.family == "mixtral":
        return cfg, transformers.MixtralConfig(
            intermediate_size=cfg.expert_intermediate_size, head_dim=cfg.head_dim,
            num_local_experts=cfg.num_experts, **common)
    if cfg.family == "qwen2_moe":
        return cfg, transformers.Qwen2MoeConfig(
            moe_intermediate_size=cfg.expert_intermediate_size,
            shared_expert_intermediate_size=cfg.shared_intermediate_size,
            intermediate_size=cfg.shared_intermediate_size, num_experts=cfg.num_experts,
            norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=1, **common)
    raise ValueError(f"shape {shape!r} is a {cfg.family} model; the peer builds "
                     f"{' or '.join(LAYER_CLASS)}")


BLOCK = 1 << 24
"""Random values drawn once and tiled over every weight (`fill_random`)."""


def fill_random(model, seed: int) -> None:
    """Norms at 1, every other weight N(0, 1 / fan-in) values, so activations stay O(1)
    through the layers: one block of `BLOCK` normal draws, tiled over each weight from a
    different offset and scaled as it is written. Drawing tens of billions of values
    (`normal_`) takes minutes; the speed of the peer does not depend on the values being
    independent, only on their shapes and on their staying finite."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    block = torch.randn(2 * BLOCK, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            if "norm" in name:
                p.fill_(1.0)
                continue
            flat, scale = p.view(-1), p.shape[-1] ** -0.5
            start = (i * 7919) % BLOCK
            for at in range(0, flat.numel(), BLOCK):
                n = min(BLOCK, flat.numel() - at)
                torch.mul(block[start : start + n], scale, out=flat[at : at + n])


def build(cfg, hf_cfg, budget: str, seed: int):
    """The model with random weights written in place, dispatched under the budget."""
    import accelerate
    import torch
    import transformers

    with accelerate.init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    fill_random(model, seed)
    model.eval()
    if not torch.cuda.is_available():
        return model, {"": "cpu"}
    device_map = accelerate.infer_auto_device_map(
        model, max_memory={0: budget, "cpu": "200GiB"},
        no_split_module_classes=[LAYER_CLASS[cfg.family]])
    return accelerate.dispatch_model(model, device_map=device_map), device_map


def decode_tok_s(model, vocab: int, batch: int, prompt_len: int, new: int, seed: int) -> dict:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rng = np.random.default_rng(seed)
    ids = torch.from_numpy(rng.integers(0, vocab, (batch, prompt_len))).to(device)

    def run(tokens: int) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                           pad_token_id=0)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    run(2)  # warm-up
    prefill = run(1)
    total = run(new)
    decode = max(total - prefill, 1e-9)
    return {"batch": batch, "new": new, "prefill_s": prefill, "total_s": total,
            "decode_tok_s": batch * (new - 1) / decode}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="mixtral-8x7b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--budget", default="8GiB", help="accelerate's max_memory for GPU 0")
    ap.add_argument("--batch", type=lambda s: [int(b) for b in s.split(",")], default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    cfg, hf_cfg = hf_config(args.shape, args.layers)
    t0 = time.perf_counter()
    model, device_map = build(cfg, hf_cfg, args.budget, args.seed)
    placed = {str(v) for v in device_map.values()}
    print(f"built {args.shape} x {cfg.num_layers} layers in {time.perf_counter() - t0:.1f} s; "
          f"placed on {sorted(placed)}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for batch in args.batch:
        row = {"peer": "transformers + accelerate", "shape": args.shape,
               "layers": cfg.num_layers, "budget": args.budget, "placed": sorted(placed),
               **decode_tok_s(model, cfg.vocab_size, batch, args.prompt_len, args.new,
                              args.seed), "machine": machine()}
        print(f"  B={batch}: {row['decode_tok_s']:.3g} tok/s decode "
              f"(prefill {row['prefill_s']:.2f} s)", flush=True)
        with open(out / "peer_accelerate.jsonl", "a") as fh:
            fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
