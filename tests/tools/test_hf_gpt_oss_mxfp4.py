"""GPT-OSS as released, its experts in MXFP4 (`*_blocks` + `*_scales`, quantization_config
`mxfp4`): `strata convert hf` imports them dequantized exactly (`formats/mxfp4.py`), so the
converted experts equal transformers' own dequantization bit for bit and the model reproduces
the logits of transformers' model holding those weights."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
hf_mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

import strata_jax  # noqa: E402
from strata_jax.formats.checkpoint import CheckpointReader  # noqa: E402
from strata_jax.tools.hf_convert import convert_hf  # noqa: E402
from tests.tools.test_hf_convert import assert_logits_close, hf_logits  # noqa: E402
from tests.tools.test_hf_gpt_oss import PROMPTS, build  # noqa: E402

PROJECTIONS = ("gate_up_proj", "down_proj")


def _mxfp4(shape_in_out: tuple[int, int, int], rng) -> tuple[np.ndarray, np.ndarray]:
    """Random blocks [E, out, in / 32, 16] and scales [E, out, in / 32] of moderate size
    (scales 2 ** -7 .. 2 ** -4: weights up to 0.375)."""
    e, k, n = shape_in_out
    blocks = rng.integers(0, 256, size=(e, n, k // 32, 16), dtype=np.uint8)
    scales = rng.integers(120, 124, size=(e, n, k // 32), dtype=np.uint8)
    return blocks, scales


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """(transformers' model holding the dequantized experts, the MXFP4 folder, the converted
    checkpoint)."""
    root = tmp_path_factory.mktemp("mxfp4")
    hf = build("window-4")
    hf.save_pretrained(root / "hf")
    tensors = safetensors_numpy.load_file(root / "hf" / "model.safetensors")
    rng = np.random.default_rng(7)
    params = dict(hf.named_parameters())
    for name in [n for n in tensors if n.endswith(PROJECTIONS)]:
        blocks, scales = _mxfp4(tensors.pop(name).shape, rng)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        dequantized = hf_mxfp4.convert_moe_packed_tensors(
            torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
        with torch.no_grad():
            params[name].copy_(dequantized)
    safetensors_numpy.save_file(tensors, root / "hf" / "model.safetensors",
                                metadata={"format": "pt"})
    config = json.loads((root / "hf" / "config.json").read_text())
    config["quantization_config"] = {  # as GPT-OSS ships it
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"]}
    (root / "hf" / "config.json").write_text(json.dumps(config))
    convert_hf(root / "hf", root / "strata")
    return hf, root / "hf", root / "strata"


def test_the_experts_are_transformers_dequantization_bit_for_bit(released):
    hf, _, converted = released
    reader = CheckpointReader(converted)
    for layer, block in enumerate(hf.model.layers):
        gate_up = block.mlp.experts.gate_up_proj.detach().numpy()  # [E, D, 2F] interleaved
        down = block.mlp.experts.down_proj.detach().numpy()  # [E, F, D]
        for e in (0, gate_up.shape[0] - 1):
            np.testing.assert_array_equal(reader.read_expert(layer, e, "w1"), gate_up[e, :, 0::2])
            np.testing.assert_array_equal(reader.read_expert(layer, e, "w3"), gate_up[e, :, 1::2])
            np.testing.assert_array_equal(reader.read_expert(layer, e, "w2"), down[e])


def test_the_model_gives_transformers_logits_of_the_dequantized_weights(released):
    hf, _, converted = released
    assert_logits_close(strata_jax.logits(strata_jax.load(converted), PROMPTS),
                        hf_logits(hf, PROMPTS))


def test_a_block_without_its_scales_is_refused_by_name(released, tmp_path):
    _, src, _ = released
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in src.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    tensors = safetensors_numpy.load_file(bad / "model.safetensors")
    name = "model.layers.1.mlp.experts.down_proj_scales"
    del tensors[name]
    safetensors_numpy.save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="down_proj_scales"):
        convert_hf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()
