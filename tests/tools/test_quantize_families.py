"""`strata quantize` on the 2026 families: MLA's projections, the dense-MLP layers, the
sigmoid routers and GPT-OSS's sliding layers and biased experts go through the same int8 /
int4 paths as the four older families."""

from __future__ import annotations

import numpy as np
import pytest

import strata_jax
from strata_jax.formats import quant
from strata_jax.formats.checkpoint import INT8_MATRICES, CheckpointReader
from strata_jax.tools.quantize import quantize_checkpoint
from tests.helpers import tiny_config, write_checkpoint

DIMS = dict(hidden_size=128, expert_intermediate_size=128, shared_intermediate_size=128,
            dense_intermediate_size=128)
CONFIGS = {
    "deepseek_v3": tiny_config("deepseek_v3", **DIMS, head_dim=48, q_lora_rank=128,
                               kv_lora_rank=128, qk_rope_head_dim=16, v_head_dim=32),
    "deepseek_v3-noqlora": tiny_config("deepseek_v3", **DIMS, head_dim=48, q_lora_rank=None,
                                       kv_lora_rank=128, qk_rope_head_dim=16, v_head_dim=32),
    "glm4_moe": tiny_config("glm4_moe", **DIMS, head_dim=32),
    "gpt_oss": tiny_config("gpt_oss", **DIMS, head_dim=32),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def float_ckpt(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "float"
    write_checkpoint(CONFIGS[request.param], path, seed=1)
    return path


def test_round_to_nearest_stores_each_matrix_as_the_reference_rounds_it(float_ckpt):
    """Every int8 matrix (MLA's, the dense-MLP layers') and int4 expert equals
    `quant`'s rounding of the float source; the routers stay float32."""
    dst = float_ckpt.parent / "rtn"
    quantize_checkpoint(float_ckpt, dst, experts="int4-rtn", dense="int8", progress=False)
    src, got = CheckpointReader(float_ckpt), CheckpointReader(dst)
    cfg = src.config
    layers = [(src.read_layer_dense(i), got.read_layer_dense(i)) for i in range(cfg.num_layers)]
    layers += [(src.read_mlp_layer(i), got.read_mlp_layer(i)) for i in range(cfg.dense_layers)]
    checked = set()
    for a, b in layers:
        for name, w in a.items():
            if name in INT8_MATRICES:
                ref = quant.quantize_int8(np.asarray(w, np.float32))
                np.testing.assert_array_equal(b[name], ref.q)
                np.testing.assert_array_equal(b[f"{name}_scale"], ref.scales)
                checked.add(name)
            else:
                np.testing.assert_array_equal(np.asarray(b[name], np.float32),
                                              np.asarray(w, np.float32))
    mla = {"wq_a", "wq_b", "wkv_a"} if cfg.q_lora_rank else {"wq", "wkv_a"}
    ffn = {"ffn_w1", "ffn_w3", "ffn_w2"} if cfg.dense_layers else set()
    assert checked >= (ffn | {"wo"} | (mla if cfg.attention == "mla" else {"wq", "wk", "wv"}))
    if cfg.scoring == "sigmoid":
        assert got.read_layer_dense(0)["router_correction"].dtype == np.float32
    for bias in ("b1", "b3", "b2") if cfg.expert_bias else ():  # carried as they are
        np.testing.assert_array_equal(got.read_expert(1, 3, bias), src.read_expert(1, 3, bias))
    w1 = src.read_expert(1, 3, "w1")
    ref = quant.quantize_int4_rtn(np.asarray(w1, np.float32))
    np.testing.assert_array_equal(got.read_expert(1, 3, "w1"), ref.packed)


def test_gptq_calibrates_through_the_dense_layers_and_mla(float_ckpt):
    """GPTQ runs the calibration tokens through the dense-MLP layers and MLA's q-LoRA; the
    quantized model stays close to the float one."""
    dst = float_ckpt.parent / "gptq"
    report = quantize_checkpoint(float_ckpt, dst, experts="int4-gptq", dense="int8-gptq",
                                 calib=16, calib_len=32, min_tokens=1, progress=False)
    cfg = CheckpointReader(float_ckpt).config
    logged = {(layer, name) for layer, name, _ in report.dense}
    assert {(0, "wo")} | ({(-1, "ffn_w2")} if cfg.dense_layers else set()) <= logged
    assert any(method == "gptq" for _, _, method in report.dense)
    a, b = strata_jax.load(float_ckpt), strata_jax.load(dst)
    tokens = np.arange(24)[None] % cfg.vocab_size
    la, lb = strata_jax.logits(a, tokens), strata_jax.logits(b, tokens)
    assert np.linalg.norm(la - lb) <= 0.6 * np.linalg.norm(la)


def test_eval_quant_streams_through_the_dense_layers(float_ckpt):
    """`strata eval quant`'s layer-by-layer comparison runs the dense-MLP layers first: its
    KL and top-1 agreement are those of the two whole models' logits, and its byte table
    counts the dense-MLP layers."""
    from strata_jax.tools.quant_eval import bytes_table, compare_streamed, kl_top1

    dst = float_ckpt.parent / "rtn-eval"
    quantize_checkpoint(float_ckpt, dst, experts="int4-rtn", dense="int8", progress=False)
    ref, got = CheckpointReader(float_ckpt), CheckpointReader(dst)
    tokens = np.random.default_rng(3).integers(0, ref.config.vocab_size, (3, 12))
    _, kl, top1 = compare_streamed(ref, got, tokens, min_tokens=1)
    p = strata_jax.logits(strata_jax.load(float_ckpt), tokens)
    q = strata_jax.logits(strata_jax.load(dst), tokens)
    want_kl, want_top1 = kl_top1(p, q)
    assert kl == pytest.approx(float(want_kl.mean()), rel=1e-3, abs=1e-6)
    assert top1 == pytest.approx(float(want_top1.mean()))
    rows = {r.component: r for r in bytes_table(ref, got)}
    assert ("dense-MLP layers (x1)" in rows) == (ref.config.dense_layers == 1)
