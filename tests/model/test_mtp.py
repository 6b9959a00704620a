"""The multi-token-prediction module of a DeepSeek-V3 checkpoint: `strata convert hf` keeps it,
`strata quantize` carries it, and `api.mtp_logits` equals a float64 reference built from
transformers' own decoder layer (transformers runs no MTP module itself)."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import strata_jax  # noqa: E402
from strata_jax import api  # noqa: E402
from strata_jax.formats import quant  # noqa: E402
from strata_jax.formats.checkpoint import CheckpointReader  # noqa: E402
from strata_jax.tools.quantize import quantize_checkpoint  # noqa: E402
from strata_runtime.cli.main import main as cli  # noqa: E402
from tests.tools.test_hf_families import build  # noqa: E402

TOKENS = np.random.default_rng(5).integers(0, 128, size=(2, 11))


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@pytest.fixture(scope="module")
def mtp_case(tmp_path_factory):
    """A 4-layer model whose last layer becomes the MTP module of the 3-layer model saved."""
    root = tmp_path_factory.mktemp("mtp")
    full = build("deepseek_v3-qlora", num_hidden_layers=4)
    full.save_pretrained(root / "hf")
    d = full.config.hidden_size
    gen = torch.Generator().manual_seed(3)
    extra = {
        "enorm.weight": 1 + 0.1 * torch.randn(d, generator=gen),
        "hnorm.weight": 1 + 0.1 * torch.randn(d, generator=gen),
        "eh_proj.weight": 0.15 * torch.randn(d, 2 * d, generator=gen),
        "shared_head.norm.weight": 1 + 0.1 * torch.randn(d, generator=gen),
        "shared_head.head.weight": full.lm_head.weight.detach().clone(),
        "embed_tokens.weight": full.model.embed_tokens.weight.detach().clone(),
    }
    tensors = safetensors_torch.load_file(root / "hf" / "model.safetensors")
    tensors.update({f"model.layers.3.{k}": v.contiguous() for k, v in extra.items()})
    safetensors_torch.save_file(tensors, root / "hf" / "model.safetensors",
                                metadata={"format": "pt"})
    config = json.loads((root / "hf" / "config.json").read_text())
    config.update(num_hidden_layers=3, num_nextn_predict_layers=1)
    (root / "hf" / "config.json").write_text(json.dumps(config))
    assert cli(["convert", "hf", str(root / "hf"), str(root / "strata")]) == 0
    return full, extra, root


def _reference(full, extra, tokens: np.ndarray) -> np.ndarray:
    """float64: h from the model's first three layers (layer 3's input), then the module."""
    model = full.double()
    eps = model.config.rms_norm_eps
    captured = {}

    def grab(_module, args, kwargs):
        captured["h"] = kwargs.get("hidden_states", args[0] if args else None)

    layer = model.model.layers[3]
    handle = layer.register_forward_pre_hook(grab, with_kwargs=True)
    ids = torch.tensor(tokens)
    with torch.no_grad():
        model(ids)
        handle.remove()
        x64 = {k: v.double() for k, v in extra.items()}
        e = _rms(model.model.embed_tokens(ids[:, 1:]), x64["enorm.weight"], eps)
        h = _rms(captured["h"][:, :-1], x64["hnorm.weight"], eps)
        x = torch.cat([e, h], -1) @ x64["eh_proj.weight"].T
        t = x.shape[1]
        pos = torch.arange(t)[None].expand(x.shape[0], t)
        mask = torch.full((t, t), float("-inf"), dtype=torch.float64).triu(1)[None, None]
        out = layer(x, attention_mask=mask, position_ids=pos,
                    position_embeddings=model.model.rotary_emb(x, pos))
        out = out[0] if isinstance(out, tuple) else out
        logits = _rms(out, x64["shared_head.norm.weight"], eps) @ model.lm_head.weight.T
    full.float()
    return logits.numpy()


def test_mtp_logits_match_a_float64_reference(mtp_case):
    full, extra, root = mtp_case
    model = strata_jax.load(root / "strata")
    assert model.config.mtp_layers == 1 and model.config.total_layers == 3
    got = api.mtp_logits(model, api.load_mtp(root / "strata"), TOKENS)
    ref = _reference(full, extra, TOKENS)
    assert got.shape == ref.shape == (2, 10, 128)
    err, scale = np.abs(got - ref).max(), np.abs(ref).max()
    assert err <= 1e-4 * scale, f"max |delta| {err:.3g} vs {scale:.3g}"


def test_quantize_carries_the_mtp_module(mtp_case):
    _, _, root = mtp_case
    quantize_checkpoint(root / "strata", root / "int8", experts="none", dense="int8",
                        progress=False)
    reader, src = CheckpointReader(root / "int8"), CheckpointReader(root / "strata")
    assert reader.config.mtp_layers == 1
    got, ref = reader.read_mtp_layer(0), src.read_mtp_layer(0)
    for name in ("wq_a", "wq_b", "wkv_a", "wo", "shared_w2"):
        q = quant.quantize_int8(np.asarray(ref[name], np.float32))
        np.testing.assert_array_equal(got[name], q.q)
        np.testing.assert_array_equal(got[f"{name}_scale"], q.scales)
    np.testing.assert_array_equal(got["eh_proj"], ref["eh_proj"])
    layer = reader.config.num_layers  # the module's experts, past the MoE layers'
    np.testing.assert_array_equal(reader.read_expert(layer, 5, "w2"),
                                  src.read_expert(layer, 5, "w2"))
    logits = api.mtp_logits(strata_jax.load(root / "int8"), api.load_mtp(root / "int8"),
                            TOKENS)
    assert np.isfinite(logits).all() and logits.shape == (2, 10, 128)
    with pytest.raises(ValueError, match="no MTP module 1"):
        api.load_mtp(root / "int8", 1)


def test_gptq_calibrates_the_mtp_module_on_the_models_output(mtp_case, tmp_path):
    """With int8-gptq the module's matrices are fitted to the inputs it runs on (the last MoE
    layer's output and each position's next token, `mtp.mtp_input`), not rounded to nearest:
    on the calibration tokens, under the same quantized model, its logits come closer to the
    float module's than the RTN module's do."""
    _, _, root = mtp_case
    calib = np.random.default_rng(11).integers(0, 128, size=(8, 24)).astype(np.int32)
    np.save(tmp_path / "calib.npy", calib)
    out = {}
    for dense in ("int8", "int8-gptq"):
        report = quantize_checkpoint(root / "strata", tmp_path / dense, experts="none",
                                     dense=dense, calib=str(tmp_path / "calib.npy"),
                                     progress=False)
        out[dense] = report
    layer = CheckpointReader(root / "strata").config.num_layers  # the module's
    methods = {name: m for lr, name, m in out["int8-gptq"].dense if lr == layer}
    assert methods and set(methods.values()) == {"gptq"}, methods
    # the same (GPTQ) model under each module; the reference: the float module on it
    model = strata_jax.load(tmp_path / "int8-gptq")
    ref = api.mtp_logits(model, api.load_mtp(root / "strata"), calib)
    err = {dense: np.abs(api.mtp_logits(model, api.load_mtp(tmp_path / dense), calib)
                         - ref).mean() for dense in out}
    assert err["int8-gptq"] < err["int8"], err
