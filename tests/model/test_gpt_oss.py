"""GPT-OSS's pieces against transformers' own modules: attention with sinks over a sliding
window, the clamped SwiGLU of the experts, the biased top-k-then-softmax router."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")

from strata_jax import api  # noqa: E402
from strata_jax.model import decoder  # noqa: E402
from strata_jax.model.moe import ExpertPool  # noqa: E402
from strata_jax.model.routing import route_topk_softmax  # noqa: E402
from strata_jax.ops.expert_kernels import SWIGLU, Glu, grouped_swiglu_xla, swiglu_xla  # noqa: E402
from strata_jax.ops.layers import attend  # noqa: E402
from tests.helpers import random_model, tiny_config  # noqa: E402


def _config(**kw):
    from transformers import GptOssConfig

    return GptOssConfig(**{**dict(hidden_size=32, intermediate_size=8, num_local_experts=6,
                                  num_experts_per_tok=3, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=8, num_hidden_layers=2), **kw})


@pytest.mark.parametrize("window", [None, 3])
def test_attention_with_sinks_matches_transformers(window):
    rng = np.random.default_rng(0)
    b, t, hq, hkv, hd = 2, 7, 4, 2, 8
    q, k, v = (rng.normal(size=(b, t, h, hd)).astype(np.float32) for h in (hq, hkv, hkv))
    sinks = rng.normal(size=hq).astype(np.float32) * 2
    pos = np.arange(t)
    mask = pos[None, :] <= pos[:, None]
    if window:
        mask &= pos[None, :] > pos[:, None] - window
    got = attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                 jnp.asarray(np.broadcast_to(mask, (b, t, t))), jnp.asarray(sinks))

    module = torch.nn.Module()
    module.num_key_value_groups, module.training = hq // hkv, False
    module.sinks = torch.tensor(sinks)
    additive = torch.where(torch.tensor(mask), 0.0, float("-inf"))[None, None]
    ref, _ = gpt_oss.eager_attention_forward(
        module, *(torch.tensor(a).transpose(1, 2) for a in (q, k, v)), additive,
        scaling=hd ** -0.5)
    np.testing.assert_allclose(np.asarray(got), ref.reshape(b, t, hq * hd).numpy(),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("limit", [7.0, 0.5])
def test_clamped_swiglu_experts_match_transformers(limit):
    """An expert's output with its biases, gate and up interleaved as the source holds them:
    the sorted path's `swiglu_xla` and the grouped XLA path both."""
    cfg = _config(swiglu_limit=limit)
    experts = gpt_oss.GptOssExperts(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn_like(p))
    x = torch.randn(5, cfg.hidden_size)
    e = 2
    with torch.no_grad():
        ref = (experts._apply_gate(x @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e])
               @ experts.down_proj[e] + experts.down_proj_bias[e]).numpy()
    gate_up, gate_up_b = experts.gate_up_proj.detach().numpy(), experts.gate_up_proj_bias.detach()
    w1, w3, w2 = gate_up[:, :, 0::2], gate_up[:, :, 1::2], experts.down_proj.detach().numpy()
    b1, b3 = gate_up_b.numpy()[:, 0::2], gate_up_b.numpy()[:, 1::2]
    b2 = experts.down_proj_bias.detach().numpy()
    glu = Glu(limit=limit, alpha=cfg.swiglu_alpha)
    xs = jnp.asarray(x.numpy())
    got = swiglu_xla(xs, w1[e], w3[e], w2[e], (b1[e], b3[e], b2[e]), glu)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5)
    pool = ExpertPool(*map(jnp.asarray, (w1, w3, w2)), b1=jnp.asarray(b1),
                      b3=jnp.asarray(b3), b2=jnp.asarray(b2))
    grouped = grouped_swiglu_xla(xs, jnp.asarray([e]), pool, glu=glu)[0, 0]
    np.testing.assert_allclose(np.asarray(grouped), ref, rtol=1e-5, atol=1e-5)
    assert glu != SWIGLU and not np.allclose(ref, 0)


def test_router_matches_transformers_and_a_forced_replay_keeps_its_bits():
    cfg = _config()
    router = gpt_oss.GptOssTopKRouter(cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        router.weight.normal_()
        router.bias.normal_()
    h = torch.randn(9, cfg.hidden_size)
    with torch.no_grad():
        logits, scores, indices = router(h)
    experts, weights = route_topk_softmax(jnp.asarray(logits.numpy()), cfg.num_experts_per_tok)
    np.testing.assert_array_equal(np.asarray(experts), indices.numpy())
    np.testing.assert_allclose(np.asarray(weights), scores.numpy(), rtol=1e-6)

    tiny = tiny_config("gpt_oss")
    model = random_model(tiny, seed=2)
    lp = {k: v[0] for k, v in model.params["params"]["layers"].items()}
    x = jnp.asarray(np.random.default_rng(3).normal(size=(6, tiny.hidden_size)), jnp.float32)
    _, routing = decoder.route_layer(tiny, lp, x)
    forced = decoder.force_routing(tiny, routing, routing.experts)
    np.testing.assert_array_equal(np.asarray(forced.weights), np.asarray(routing.weights))


def test_a_pool_without_the_expert_biases_is_refused_by_family():
    cfg = tiny_config("gpt_oss")
    model = random_model(cfg, seed=4)
    bare = model.experts._replace(b1=None, b3=None, b2=None)
    with pytest.raises(ValueError, match="gpt_oss: the expert pool lacks expert biases"):
        api.logits(api.Model(cfg, model.params, bare, model.slot_table), [[1, 2, 3]])
