"""Synthetic MoE checkpoints: real architectures' shapes, random weights, tunable routing skew.

Weights are deterministic per seed and independent of thread scheduling: every tensor is cut
into fixed pieces of `PIECE` elements; piece p takes a key (a, b) from
`SeedSequence([seed, domain, *where], spawn_key=(p,))` (an expert chunk's key is
`[seed, EXPERT, layer, expert, kind_index]`), and its element i is a pure function of the
counter a * i + b (mod 2^32): a 32-bit integer hash (lowbias32), the sum of the hash's four
bytes (Irwin-Hall: bell-shaped, zero-mean once centred, variance exactly 21845, tails cut at
3.45 std), scaled to std 1/sqrt(fan_in) (embeddings: std 1, norms: 1) and rounded to bfloat16
to nearest even. The chain runs as one fused XLA:CPU loop per block (numpy, with the same
bits, for short runs): no table lookup, no intermediate arrays.

`skew` is the target share of top-k routing assignments that go to the top 20 % of experts in
each layer (see `top_share`); it is reached by a per-expert router bias
`-alpha * log(1 + rank)`, with ranks from a per-layer random permutation and `alpha` found by
bisection on a Monte-Carlo model of the router logits. See docs/synthetic_models.md.

`train_steps` then trains a small model in place on a Markov language (synth_train.py), so its
predictions are confident like a real LM's (what quantization accuracy tests need).
"""

from __future__ import annotations

import functools
import math
import os
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax
from jax.sharding import SingleDeviceSharding
from tqdm import tqdm

from strata_jax.api import Model, from_arrays, load, routing
from strata_jax.formats.checkpoint import (
    EXPERT_KINDS,
    CheckpointWriter,
    check_destination,
    dense_layer_shapes,
    expert_bias_shapes,
    expert_shape,
    global_shapes,
    mixer_arrays,
    mixer_counts,
    mlp_layer_shapes,
    numpy_dtype,
)
from strata_jax.formats.config import ModelConfig
from strata_jax.formats.tokenizer import byte_level_files
from strata_jax.tools.synth_train import check_trainable, train_synthetic

_GPT_OSS = dict(
    attention_bias=True, o_bias=True, attention_sinks=True, sliding_window=128,
    scoring="topk_softmax", router_bias=True,
    expert_bias=True, swiglu_limit=7.0, swiglu_alpha=1.702, rope_theta=150000.0,
    rope_scaling=(("beta_fast", 32.0), ("beta_slow", 1.0), ("factor", 32.0),
                  ("original_max_position_embeddings", 4096), ("truncate", False)),
    rms_eps=1e-5, dtype="bfloat16", max_position=131072)  # the two sizes' common fields

SHAPES: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        family="mixtral", vocab_size=512, hidden_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=32, num_experts=16, top_k=2, expert_intermediate_size=128,
        rope_theta=1e4, router_bias=True, dtype="bfloat16", max_position=2048,
    ),
    "mixtral-8x7b": ModelConfig(
        family="mixtral", vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, num_experts=8, top_k=2, expert_intermediate_size=14336,
        rope_theta=1e6, rms_eps=1e-5, dtype="bfloat16", max_position=32768,
    ),
    "qwen3-30b-a3b": ModelConfig(
        family="qwen3_moe", vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32,
        num_kv_heads=4, head_dim=128, num_experts=128, top_k=8, expert_intermediate_size=768,
        qk_norm="head", norm_topk_prob=True, rope_theta=1e6, rms_eps=1e-6, dtype="bfloat16",
        max_position=40960,
    ),
    "seed-125b": ModelConfig(
        family="qwen2_moe", vocab_size=100352, hidden_size=8192, num_layers=48, num_heads=64,
        num_kv_heads=8, head_dim=128, num_experts=64, top_k=4, expert_intermediate_size=1280,
        shared_intermediate_size=18432, shared_gate=True, norm_topk_prob=True, rope_theta=1e6,
        dtype="bfloat16", max_position=32768,
    ),
    # The 2026 families at their released dimensions (Hugging Face configs of
    # deepseek-ai/DeepSeek-V3, zai-org/GLM-4.5-Air, MiniMaxAI/MiniMax-M2); `--layers N`
    # keeps N MoE layers after the dense-MLP ones.
    "deepseek-v3": ModelConfig(
        family="deepseek_v3", vocab_size=129280, hidden_size=7168, num_layers=58,
        dense_layers=3, dense_intermediate_size=18432, num_heads=128, num_kv_heads=128,
        head_dim=192, attention="mla", q_lora_rank=1536, kv_lora_rank=512,
        qk_rope_head_dim=64, v_head_dim=128, rope_interleave=True, num_experts=256, top_k=8,
        expert_intermediate_size=2048, shared_intermediate_size=2048, scoring="sigmoid",
        n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_theta=1e4, rope_scaling=(("beta_fast", 32), ("beta_slow", 1), ("factor", 40.0),
                                      ("mscale", 1.0), ("mscale_all_dim", 1.0),
                                      ("original_max_position_embeddings", 4096)),
        rms_eps=1e-6, dtype="bfloat16", max_position=163840,
    ),
    "glm-4.5-air": ModelConfig(
        family="glm4_moe", vocab_size=151552, hidden_size=4096, num_layers=45, dense_layers=1,
        dense_intermediate_size=10944, num_heads=96, num_kv_heads=8, head_dim=128,
        rotary_dim=64, attention_bias=True, num_experts=128, top_k=8,
        expert_intermediate_size=1408, shared_intermediate_size=1408, scoring="sigmoid",
        norm_topk_prob=True, rope_theta=1e6, rms_eps=1e-5, dtype="bfloat16",
        max_position=131072,
    ),
    "minimax-m2": ModelConfig(
        family="minimax_m2", vocab_size=200064, hidden_size=3072, num_layers=62, num_heads=48,
        num_kv_heads=8, head_dim=128, rotary_dim=64, qk_norm="full", num_experts=256, top_k=8,
        expert_intermediate_size=1536, scoring="sigmoid", norm_topk_prob=True, rope_theta=5e6,
        rms_eps=1e-6, dtype="bfloat16", max_position=196608,
    ),
    # GPT-OSS (openai/gpt-oss-20b and -120b): sliding-window (128) and full attention
    # alternating, sliding first; sinks; q/k/v/o biases; a biased top-k-then-softmax router;
    # biased experts with the clamped SwiGLU; YaRN x32. `--layers N` keeps the alternation.
    "gpt-oss-20b": ModelConfig(
        family="gpt_oss", vocab_size=201088, hidden_size=2880, num_layers=24, num_heads=64,
        num_kv_heads=8, head_dim=64, num_experts=32, top_k=4, expert_intermediate_size=2880,
        sliding_layers=tuple(range(0, 24, 2)), **_GPT_OSS),
    "gpt-oss-120b": ModelConfig(
        family="gpt_oss", vocab_size=201088, hidden_size=2880, num_layers=36, num_heads=64,
        num_kv_heads=8, head_dim=64, num_experts=128, top_k=4, expert_intermediate_size=2880,
        sliding_layers=tuple(range(0, 36, 2)), **_GPT_OSS),
    # Qwen3-Next (Qwen/Qwen3-Next-80B-A3B-Instruct): three Gated DeltaNet layers, then one
    # gated attention layer (q/k norm, rotary over a quarter of the head); 512 experts top-10
    # beside a gated shared expert. `--layers N` keeps the pattern.
    "qwen3-next-80b-a3b": ModelConfig(
        family="qwen3_next", vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=16,
        num_kv_heads=2, head_dim=256, rotary_dim=64, qk_norm="head", attention_gate=True,
        num_experts=512, top_k=10, expert_intermediate_size=512, shared_intermediate_size=512,
        shared_gate=True, norm_topk_prob=True, linear_layers=tuple(
            i for i in range(48) if (i + 1) % 4), linear_conv_kernel=4, linear_key_heads=16,
        linear_value_heads=32, linear_key_dim=128, linear_value_dim=128, rope_theta=1e7,
        rms_eps=1e-6, dtype="bfloat16", max_position=262144),
}  # fmt: skip

PIECE = 1 << 22  # elements per independent random stream
_BLOCK = 1 << 20  # max elements per XLA call: few GIL round trips, output reused by malloc
_MIN_XLA = 1 << 15  # shorter runs are cheaper in numpy (same bits)
_GLOBAL, _DENSE, _EXPERT, _ROUTE, _MLP, _MIXER = 0, 1, 2, 3, 4, 5  # seed-sequence domains
TOP_FRACTION = 0.2
MEASURE_MAX_PARAMS = 200_000_000
_MC_SEED, _MC_REPLICAS = 12345, 4


@dataclass(frozen=True)
class SynthStats:
    """What `synthesize` wrote and how fast; `top20_share` is measured on small models only,
    `trained` holds `train_synthetic`'s figures if the model was trained."""

    path: str
    shape: str
    params: int
    bytes: int
    seconds: float
    skew: float | None
    alpha: float
    top20_share: float | None
    trained: dict | None = None

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def __str__(self) -> str:
        line = (
            f"wrote {self.shape} ({self.params / 1e9:.3f} B params) to {self.path}: "
            f"{self.bytes / 1e9:.2f} GB in {self.seconds:.1f} s ({self.gb_per_s:.2f} GB/s)"
        )
        if self.skew is not None:
            line += f"; skew target {self.skew:.2f}, alpha {self.alpha:.3f}"
        if self.top20_share is not None:
            line += f"; measured top-20% share {self.top20_share:.3f}"
        if self.trained is not None:
            t = self.trained
            line += (
                f"; trained {t['steps']} steps, loss {t['initial_loss']:.3f} -> "
                f"{t['final_loss']:.3f} (language entropy {t['language_entropy']:.3f})"
            )
        return line


# ---------------------------------------------------------------------------- random tensors

_M1, _M2 = np.uint32(0x7FEB352D), np.uint32(0x846CA68B)  # lowbias32 multipliers
_BYTE_SUM_MEAN = 510  # sum of 4 uniform bytes: mean 4 * 255 / 2
_BYTE_SUM_VAR = 4 * (256**2 - 1) / 12  # and variance 21845, exactly


def _piece_key(entropy: Sequence[int], piece: int) -> tuple[int, int]:
    """(a, b) of one piece's stream: element i of the piece hashes a * i + b (mod 2^32)."""
    a, b = np.random.SeedSequence(list(entropy), spawn_key=(piece,)).generate_state(2)
    return int(a) | 1, int(b)


def _to_bf16_bits(f, xp):
    """Round-to-nearest-even of float32 to bfloat16, in integer ops (same bits everywhere)."""
    u = _bitcast(f, np.uint32, xp)
    return ((u + np.uint32(0x7FFF) + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _bitcast(x, dtype, xp):
    return x.view(dtype) if xp is np else lax.bitcast_convert_type(x, dtype)


def _values(x, scale, bf16: bool, xp):
    """The values for counters `x` (uint32): hash, sum of the hash's 4 bytes, centre, scale.

    Written once for numpy and jax.numpy, so both give the same bits: integer ops wrap
    mod 2^32 and the only float op is one exactly rounded multiply.
    """
    h = x ^ (x >> 16)  # lowbias32 (C. Wellons): a full-avalanche 32-bit integer hash
    h = h * _M1
    h = h ^ (h >> 15)
    h = h * _M2
    h = h ^ (h >> 16)
    pairs = (h & np.uint32(0x00FF00FF)) + ((h >> 8) & np.uint32(0x00FF00FF))
    total = (pairs * np.uint32(0x10001)) >> 16  # byte sum in [0, 1020]
    f = (total.astype(np.int32) - _BYTE_SUM_MEAN).astype(np.float32) * scale
    return _to_bf16_bits(f, xp) if bf16 else f


def _values_np(a: int, b: int, n: int, scale: np.float32, bf16: bool) -> np.ndarray:
    x = np.arange(n, dtype=np.uint32) * np.uint32(a) + np.uint32(b)
    return _values(x, scale, bf16, np)


@functools.cache
def _block_kernel(size: int, bf16: bool) -> Callable:
    """XLA:CPU kernel for `size` consecutive counters: the whole chain in one fused loop.

    numpy would make ~15 passes over memory (and as many GIL round trips) per block; fused,
    a block costs about one pass: ~0.4 core-s per GB of bf16 with the copy out (~2.5 GB/s).
    The output overwrites the donated `buf` in place: a fresh output per call would be
    page-faulted in again whenever malloc has given the last one back to the kernel.
    """

    def kernel(buf, args):  # args: uint32[3] = a, b, scale bits
        x = lax.iota(jnp.uint32, size) * args[0] + args[1]
        values = _values(x, lax.bitcast_convert_type(args[2], jnp.float32), bf16, jnp)
        return lax.dynamic_update_slice(buf, values, (0,))

    cpu = SingleDeviceSharding(jax.devices("cpu")[0])  # on the host even where a GPU is
    return jax.jit(kernel, donate_argnums=0, in_shardings=cpu, out_shardings=cpu)


_scratch = threading.local()  # each thread's donated output buffers, by (size, bf16)


def _xla_block(size: int, bf16: bool, args: np.ndarray) -> jax.Array:
    """One block from `_block_kernel`, in this thread's recycled buffer (valid until the
    thread's next call: copy it out and drop any numpy view of it before then)."""
    bufs = _scratch.__dict__.setdefault("bufs", {})
    buf = bufs.pop((size, bf16), None)
    if buf is None:
        dtype = np.uint16 if bf16 else np.float32
        buf = jax.device_put(np.zeros(size, dtype), jax.devices("cpu")[0])
    bufs[size, bf16] = buf = _block_kernel(size, bf16)(buf, args)
    return buf


def _fill_piece(out: np.ndarray, entropy: Sequence[int], piece: int, std: float) -> None:
    """Fill the flat `out` (one piece) with its stream: uint16 bf16 bits, float32 or other."""
    a, b = _piece_key(entropy, piece)
    scale = np.float32(std / math.sqrt(_BYTE_SUM_VAR))
    bf16 = out.dtype == np.uint16
    start = 0
    while start < out.size:
        n = out.size - start
        b_start = (b + a * start) % 2**32  # counters a * (start + i) + b
        if n >= _MIN_XLA:  # blocks of 2^k elements, _MIN_XLA <= 2^k <= _BLOCK: few kernels
            n = min(_BLOCK, 1 << (n.bit_length() - 1))
            args = np.array([a, b_start, scale.view(np.uint32)], np.uint32)
            out[start : start + n] = np.asarray(_xla_block(n, bf16, args))
        else:  # float32 is cast to other float dtypes on assignment
            out[start : start + n] = _values_np(a, b_start, n, scale, bf16)
        start += n


def random_array(
    shape: tuple[int, ...],
    dtype: np.dtype,
    std: float,
    entropy: Sequence[int],
    pool: ThreadPoolExecutor | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Deterministic zero-mean array of std `std` (into `out` if given; see module doc).

    Its `PIECE`-element pieces run on `pool` if given; the bytes do not depend on it.
    """
    dtype = np.dtype(dtype)
    if out is None:
        out = np.empty(shape, dtype)
    elif out.shape != tuple(shape) or out.dtype != dtype or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous {dtype} array of shape {shape}")
    flat = out.reshape(-1)
    if dtype == ml_dtypes.bfloat16:
        flat = flat.view(np.uint16)
    pieces = [(p, flat[s : s + PIECE]) for p, s in enumerate(range(0, flat.size, PIECE))]
    if pool is None or len(pieces) == 1:
        for p, chunk in pieces:
            _fill_piece(chunk, entropy, p, std)
    else:
        for f in [pool.submit(_fill_piece, c, entropy, p, std) for p, c in pieces]:
            f.result()
    return out


def _name_key(name: str) -> int:
    return zlib.crc32(name.encode())


def _init_std(name: str, shape: tuple[int, ...]) -> float | None:
    """Std of a random param, or None for params that are constant (norms 1, biases 0)."""
    if name == "embed":
        return 1.0
    if name == "lm_head":
        return shape[1] ** -0.5
    if name == "shared_gate":
        return shape[0] ** -0.5
    return shape[0] ** -0.5 if len(shape) == 2 else None


def _param(name, shape, dtype, entropy, pool) -> np.ndarray:
    std = _init_std(name, shape)
    if std is not None:
        return random_array(shape, dtype, std, [*entropy, _name_key(name)], pool)
    return np.full(shape, 1.0 if name.endswith("norm") else 0.0, dtype)


def global_params(cfg: ModelConfig, seed: int, pool=None) -> dict[str, np.ndarray]:
    dtype = numpy_dtype(cfg.dtype)
    return {
        name: _param(name, shape, dtype, [seed, _GLOBAL], pool)
        for name, shape in global_shapes(cfg).items()
    }


def layer_params(
    cfg: ModelConfig, seed: int, layer: int, alpha: float = 0.0, pool=None
) -> dict[str, np.ndarray]:
    """One layer's dense params; `router_bias` (if the config has it) is the skew bias."""
    dtype = numpy_dtype(cfg.dtype)
    params = {
        name: _param(name, shape, dtype, [seed, _DENSE, layer], pool)
        for name, shape in dense_layer_shapes(cfg).items()
    }
    if cfg.router_bias:
        params["router_bias"] = router_bias(cfg.num_experts, alpha, seed, layer).astype(dtype)
    return params


def mlp_layer_params(cfg: ModelConfig, seed: int, layer: int, pool=None) -> dict[str, np.ndarray]:
    """Dense-MLP layer `layer`'s params (`ModelConfig.dense_layers`)."""
    dtype = numpy_dtype(cfg.dtype)
    return {name: _param(name, shape, dtype, [seed, _MLP, layer], pool)
            for name, shape in mlp_layer_shapes(cfg).items()}


def mixer_params(cfg: ModelConfig, seed: int, kind: str, index: int,
                 pool=None) -> dict[str, np.ndarray]:
    """The token-mixer params of the `index`-th layer of `kind` ("attn" / "linear") of a
    model with linear layers (the decay's `a_log` and `dt_bias` 0: A = 1)."""
    dtype = numpy_dtype(cfg.dtype)
    domain = [seed, _MIXER, MIXER_KEYS[kind], index]
    return {name: _param(name, shape, dtype, domain, pool)
            for name, (shape, _) in mixer_arrays(cfg, kind).items()}


MIXER_KEYS = {"attn": 0, "linear": 1}
"""Each token-mixer kind's seed-sequence key (`mixer_params`)."""


def expert_array(
    cfg: ModelConfig, seed: int, layer: int, expert: int, kind: str, out: np.ndarray | None = None
) -> np.ndarray:
    """One expert weight [in, out], std 1/sqrt(in); written into `out` if given."""
    shape = expert_shape(cfg, kind)
    key = [seed, _EXPERT, layer, expert, EXPERT_KINDS.index(kind)]
    return random_array(shape, numpy_dtype(cfg.dtype), shape[0] ** -0.5, key, out=out)


# ---------------------------------------------------------------------------------- skew


def top_share(counts: np.ndarray, fraction: float = TOP_FRACTION) -> float:
    """Lorenz-curve value at `fraction` of the experts: share of the most-used ones.

    Counts are sorted descending; between integer numbers of experts the cumulative share is
    interpolated linearly (E=8 -> the top expert plus 0.6 of the second).
    """
    c = np.sort(np.asarray(counts, np.float64))[::-1]
    cum = np.concatenate([[0.0], np.cumsum(c)])
    return float(np.interp(fraction * c.size, np.arange(c.size + 1), cum) / cum[-1])


def max_top_share(num_experts: int, top_k: int, fraction: float = TOP_FRACTION) -> float:
    """Largest reachable share: each token picks an expert at most once (share <= 1/k each)."""
    return min(1.0, fraction * num_experts / top_k)


def bias_profile(num_experts: int) -> np.ndarray:
    """Popularity profile by rank: log(1 + rank), so p(rank) ~ (1 + rank)^-alpha (Zipf-like)."""
    return np.log1p(np.arange(num_experts, dtype=np.float64))


def router_bias(num_experts: int, alpha: float, seed: int, layer: int) -> np.ndarray:
    """Per-expert bias -alpha * profile(rank); ranks are a per-layer random permutation."""
    rank = np.random.default_rng([seed, _ROUTE, layer]).permutation(num_experts)
    return -alpha * bias_profile(num_experts)[rank]


def _layer_share(experts: np.ndarray, num_experts: int) -> float:
    return top_share(np.bincount(experts.reshape(-1), minlength=num_experts))


def _topk(logits: np.ndarray, k: int) -> np.ndarray:
    return np.argpartition(-logits, k - 1, axis=-1)[:, :k]


@functools.cache
def _mc_logits(num_tokens: int, num_experts: int) -> np.ndarray:
    """Fixed iid N(0, 1) router logits [replicas, tokens, experts] for the simulation."""
    rng = np.random.default_rng(_MC_SEED)
    return rng.standard_normal((_MC_REPLICAS, num_tokens, num_experts), np.float32)


def expected_top_share(num_experts: int, top_k: int, alpha: float, num_tokens: int = 2000) -> float:
    """Expected share measured over `num_tokens` tokens when logits ~ iid N(bias_e, 1).

    Averages `_MC_REPLICAS` simulated measurements, so the small upward bias of a finite
    sample (sorting picks the luckiest experts) matches `measure_top20_share`'s.
    """
    bias = -alpha * bias_profile(num_experts).astype(np.float32)
    sims = _mc_logits(num_tokens, num_experts)
    return float(np.mean([_layer_share(_topk(z + bias, top_k), num_experts) for z in sims]))


def calibrate_alpha(
    num_experts: int, top_k: int, skew: float, num_tokens: int = 2000, iters: int = 40
) -> float:
    """Bias strength whose expected top-20 % share equals `skew` (0 if skew <= uniform's)."""
    cap = max_top_share(num_experts, top_k)
    if not TOP_FRACTION <= skew < cap:
        raise ValueError(
            f"skew must be in [{TOP_FRACTION}, {cap:.3f}) for {num_experts} experts top-{top_k} "
            f"(each token uses an expert at most once), got {skew}"
        )
    share = functools.partial(expected_top_share, num_experts, top_k, num_tokens=num_tokens)
    if share(0.0) >= skew:
        return 0.0
    lo, hi = 0.0, 1.0
    while share(hi) < skew:
        lo, hi = hi, 2 * hi
        if hi > 1e4:
            raise ValueError(f"skew {skew} is not reachable for {num_experts} experts top-{top_k}")
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if share(mid) < skew else (lo, mid)
    return (lo + hi) / 2


def measure_top20_share(model: Model, num_tokens: int = 2000, seed: int = 0) -> float:
    """Run `model` (an api.Model) on random tokens; mean over layers of the top-20 % share."""
    cfg = model.config
    seq = min(64, num_tokens)
    batch = -(-num_tokens // seq)
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, seq), np.int32)
    experts = routing(model, tokens)[:, :num_tokens]
    return float(np.mean([_layer_share(e, cfg.num_experts) for e in experts]))


# ----------------------------------------------------------------------------- writing


def synth_config(
    shape: str, layers: int | None = None, skew: float | None = None, dtype: str = "bfloat16"
) -> ModelConfig:
    """The config `synthesize` writes: a SHAPES entry with overrides applied."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    cfg = SHAPES[shape].replace(dtype=dtype)
    if layers is not None:
        if layers < 1:
            raise ValueError(f"--layers must be >= 1, got {layers}")
        total = cfg.dense_layers + layers
        cfg = cfg.replace(num_layers=layers, sliding_layers=tuple(
            i for i in cfg.sliding_layers if i < total), linear_layers=tuple(
            i for i in cfg.linear_layers if i < total))
    if skew is not None:
        cfg = cfg.replace(router_bias=True)
    return cfg


def checkpoint_bytes(cfg: ModelConfig) -> int:
    """Bytes of all params as the writer stores them."""
    per_layer = sum(map(math.prod, dense_layer_shapes(cfg).values())) + cfg.num_experts * sum(
        math.prod(shape) for shape in _expert_shapes(cfg).values()
    )
    total = (sum(map(math.prod, global_shapes(cfg).values())) + cfg.num_layers * per_layer
             + cfg.dense_layers * sum(map(math.prod, mlp_layer_shapes(cfg).values())))
    for kind, n in mixer_counts(cfg).items():
        total += n * sum(math.prod(shape) for shape, _ in mixer_arrays(cfg, kind).values())
    return total * numpy_dtype(cfg.dtype).itemsize


def _expert_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """One expert's weights and (biased experts) biases."""
    return {**{k: expert_shape(cfg, k) for k in EXPERT_KINDS}, **expert_bias_shapes(cfg)}


def expert_biases(cfg: ModelConfig) -> dict[str, np.ndarray]:
    """One expert's biases (`ModelConfig.expert_bias`): zeros, as every synthetic bias."""
    dtype = numpy_dtype(cfg.dtype)
    return {k: np.zeros(shape, dtype) for k, shape in expert_bias_shapes(cfg).items()}


def _window(cfg: ModelConfig, workers: int, budget: int | None = None) -> int:
    """Expert chunk buffers: 4 per worker, <= 3 layers, <= budget (RAM / 8, at most 8 GiB)."""
    chunk = math.prod(expert_shape(cfg, "w1")) * numpy_dtype(cfg.dtype).itemsize
    if budget is None:
        budget = min(8 << 30, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8)
    three_layers = 3 * cfg.num_experts * len(EXPERT_KINDS)
    return max(2, min(three_layers, 4 * workers, budget // chunk))


class _Buffers:
    """At most `limit` flat expert buffers, made on demand and recycled after their write.

    Reuse keeps the kernel out of the loop: a fresh 100 MB array costs page faults on first
    touch and a munmap on free, both under the process-wide memory-map lock.
    """

    def __init__(self, size: int, dtype: np.dtype, limit: int) -> None:
        self._size, self._dtype, self._limit = size, dtype, limit
        self._free: list[np.ndarray] = []
        self._made = 0
        self._cv = threading.Condition()

    def take(self, block: bool = False) -> np.ndarray | None:
        """A free buffer, a new one while under the limit, else None (or wait if `block`)."""
        with self._cv:
            while not self._free and self._made >= self._limit:
                if not block:
                    return None
                self._cv.wait()
            if self._free:
                return self._free.pop()
            self._made += 1
        return np.empty(self._size, self._dtype)

    def give(self, buf: np.ndarray) -> None:
        with self._cv:
            self._free.append(buf)
            self._cv.notify()


def _dense_job(writer: CheckpointWriter, seed: int, layer: int | str | None,
               alpha: float) -> int:
    """Generate and save the globals (layer None), one MoE layer's dense params (an int),
    dense-MLP layer i's ("mlp<i>") or a token mixer's ("attn<i>", "linear<i>"); their
    bytes."""
    cfg = writer.config
    if layer is None:
        params = global_params(cfg, seed)
        writer.write_globals(params)
    elif isinstance(layer, str) and not layer.startswith("mlp"):
        kind = layer.rstrip("0123456789")
        index = int(layer.removeprefix(kind))
        params = mixer_params(cfg, seed, kind, index)
        writer.write_mixer(kind, index, params)
    elif isinstance(layer, str):
        index = int(layer.removeprefix("mlp"))
        params = mlp_layer_params(cfg, seed, index)
        writer.write_mlp_layer(index, params)
    else:
        params = layer_params(cfg, seed, layer, alpha)
        writer.write_layer_dense(layer, params)
    return sum(a.nbytes for a in params.values())


def _write_all(
    writer: CheckpointWriter,
    seed: int,
    alpha: float,
    pool: ThreadPoolExecutor,
    advance: Callable[[int], None],
) -> None:
    """Two independent lanes: dense params and experts; neither waits for the other.

    Dense lane (one thread): the globals, then each layer's dense params, each generated
    when its turn comes and saved by orbax, so at most one of them is in memory.
    Expert lane: each chunk is generated on `pool` into a recycled buffer, handed to the
    writer (which hashes and writes it on its own pool) in order as soon as it is ready,
    and its buffer is reused once the write is done. At most `_window` buffers exist, so
    generation runs ahead of the writer by a bounded amount and memory stays bounded.
    """
    cfg = writer.config
    chunks = [
        (li, e, k) for li in range(cfg.num_layers) for e in range(cfg.num_experts)
        for k in EXPERT_KINDS
    ]  # fmt: skip
    size = math.prod(expert_shape(cfg, "w1"))
    buffers = _Buffers(size, numpy_dtype(cfg.dtype), _window(cfg, pool._max_workers))
    generating: deque[tuple[tuple[int, int, str], np.ndarray, Future]] = deque()
    writing: deque[tuple[int, Future]] = deque()
    dense: deque[Future] = deque()

    def hand_over() -> None:  # oldest generated chunk -> writer
        (li, e, kind), buf, fut = generating.popleft()
        array = fut.result()
        done = writer.write_expert(li, e, kind, array)
        done.add_done_callback(lambda _: buffers.give(buf))
        writing.append((array.nbytes, done))

    def report(wait: bool = False) -> None:  # progress, in order; raises a failed job's error
        while writing and (wait or writing[0][1].done()):
            nbytes, fut = writing.popleft()
            fut.result()
            advance(nbytes)
        while dense and (wait or dense[0].done()):
            advance(dense.popleft().result())

    random_array((_BLOCK,), numpy_dtype(cfg.dtype), 1.0, [seed])  # compile once, not per thread
    dense_lane = ThreadPoolExecutor(1, thread_name_prefix="synth-dense")
    try:
        mlp = [f"mlp{i}" for i in range(cfg.dense_layers)]
        mixers = [f"{kind}{i}" for kind, n in mixer_counts(cfg).items() for i in range(n)]
        for layer in (None, *mlp, *mixers, *range(cfg.num_layers)):
            dense.append(dense_lane.submit(_dense_job, writer, seed, layer, alpha))
        for li, e, kind in chunks:
            buf = buffers.take()
            while buf is None and generating:
                hand_over()
                buf = buffers.take()
            if buf is None:  # all buffers are being written
                buf = buffers.take(block=True)
            view = buf.reshape(expert_shape(cfg, kind))
            job = pool.submit(expert_array, cfg, seed, li, e, kind, view)
            generating.append(((li, e, kind), buf, job))
            while generating and generating[0][2].done():
                hand_over()
            report()
        while generating:
            hand_over()
        for li in range(cfg.num_layers):
            for e in range(cfg.num_experts):
                for kind, array in expert_biases(cfg).items():
                    writing.append((array.nbytes, writer.write_expert(li, e, kind, array)))
            report()
        report(wait=True)
    finally:  # on an error, skip the dense layers not started yet
        dense_lane.shutdown(wait=True, cancel_futures=True)


def synthesize(
    shape: str,
    dst: str | os.PathLike,
    *,
    layers: int | None = None,
    skew: float | None = None,
    seed: int = 0,
    dtype: str = "bfloat16",
    overwrite: bool = False,
    workers: int | None = None,
    progress: bool | None = None,
    train_steps: int = 0,
) -> SynthStats:
    """Write a random-weight checkpoint of architecture `shape` to `dst`; see module doc.

    `train_steps` > 0 then trains it in place on a Markov language (`synth_train`; tiny models
    only): in float32, stored back in `dtype`. `progress=None` shows progress bars only on a
    terminal.
    """
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}")
    cfg = synth_config(shape, layers, skew, dtype)
    if train_steps:
        check_trainable(cfg, train_steps)
    dst = check_destination(dst, overwrite=overwrite)
    alpha = 0.0 if skew is None else calibrate_alpha(cfg.num_experts, cfg.top_k, skew)
    workers = workers or os.cpu_count() or 1
    t0 = time.perf_counter()
    extra = {"synthetic": {"shape": shape, "seed": seed, "skew": skew, "alpha": alpha}}
    disable = None if progress is None else not progress
    bar = tqdm(total=checkpoint_bytes(cfg), unit="B", unit_scale=True, disable=disable, desc=shape)
    with (
        bar,
        ThreadPoolExecutor(workers) as pool,
        CheckpointWriter(dst, cfg, overwrite=overwrite, extra=extra) as writer,
    ):
        _write_all(writer, seed, alpha, pool, bar.update)
        for name, data in byte_level_files(cfg.vocab_size).items():
            writer.write_file(name, data)
        path = writer.commit()
    seconds = time.perf_counter() - t0
    trained = None
    if train_steps:
        trained = train_synthetic(path, train_steps, seed=seed, progress=progress)
    share = None
    if cfg.param_counts()["total"] <= MEASURE_MAX_PARAMS:
        share = measure_top20_share(load(path))
    params = cfg.param_counts()["total"]
    written = checkpoint_bytes(cfg)
    return SynthStats(str(Path(path)), shape, params, written, seconds, skew, alpha, share, trained)


def synthetic_model(cfg: ModelConfig, seed: int = 0, alpha: float = 0.0) -> Model:
    """The api.Model that `synthesize` would write for `cfg`, built in memory (small models)."""
    layers = [layer_params(cfg, seed, li, alpha) for li in range(cfg.num_layers)]
    stacked = {name: np.stack([lp[name] for lp in layers]) for name in layers[0]}
    experts = {
        kind: np.stack([
            np.stack([expert_array(cfg, seed, li, e, kind) for e in range(cfg.num_experts)])
            for li in range(cfg.num_layers)
        ])
        for kind in EXPERT_KINDS
    }  # fmt: skip
    shape = (cfg.num_layers, cfg.num_experts)
    experts.update({k: np.broadcast_to(b, (*shape, *b.shape))
                    for k, b in expert_biases(cfg).items()})
    mlp = [mlp_layer_params(cfg, seed, i) for i in range(cfg.dense_layers)]
    stacked_mlp = {name: np.stack([lp[name] for lp in mlp]) for name in mlp[0]} if mlp else None
    mixers = {}
    for kind, n in mixer_counts(cfg).items():
        if n:
            each = [mixer_params(cfg, seed, kind, i) for i in range(n)]
            mixers[kind] = {name: np.stack([p[name] for p in each]) for name in each[0]}
    return from_arrays(cfg, global_params(cfg, seed), stacked, experts, stacked_mlp, mixers)
