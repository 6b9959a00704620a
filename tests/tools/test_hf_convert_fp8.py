"""`strata convert hf` of block-FP8 sources (DeepSeek-V3 style) and quantizing while converting.

The source is a tiny transformers Mixtral whose linear weights (attention projections and
experts; not norms, embeddings, lm_head or the router) are rewritten by torch as
float8_e4m3fn with 128x128 block scales, scale_inv = block absmax / 448, as DeepSeek does; head
dim 48 makes the q/k/v/o grids end in partial blocks. The float reference holds those weights
dequantized by torch, so a conversion of either source must give the same bits.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import strata_jax  # noqa: E402
from strata_jax.formats import quant  # noqa: E402
from strata_jax.formats.checkpoint import EXPERT_KINDS, CheckpointReader  # noqa: E402
from strata_jax.tools.hf_convert import convert_hf  # noqa: E402
from strata_jax.tools.quantize import REPORT_FILE  # noqa: E402
from strata_runtime.cli import main as cli  # noqa: E402
from tests.tools.test_hf_convert import (  # noqa: E402
    BASE,
    PROMPTS,
    ROUTING_MARGIN,
    _draw_model,
    assert_logits_close,
    hf_logits,
    routing_margin,
)

BLOCK = (128, 128)
E4M3_MAX = 448.0
QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": list(BLOCK),
}
SHAPE = dict(hidden_size=256, intermediate_size=256, head_dim=48, num_local_experts=8)
LINEAR = re.compile(r"(self_attn\.[qkvo]_proj|experts\.\d+\.w[123])\.weight$")
"""The weights DeepSeek-style checkpoints store in FP8 (the router, norms, embeddings and
lm_head stay float)."""
SINGLE = "model.safetensors"


# ------------------------------------------------------------------------ torch reference


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch e4m3 with 128x128 block scales: (w_fp8, scale_inv = block absmax / 448)."""
    rows, cols = w.shape
    nr, nc = math.ceil(rows / BLOCK[0]), math.ceil(cols / BLOCK[1])
    padded = torch.zeros(nr * BLOCK[0], nc * BLOCK[1])
    padded[:rows, :cols] = w
    tiles = padded.reshape(nr, BLOCK[0], nc, BLOCK[1])
    scale_inv = (tiles.abs().amax(dim=(1, 3)) / E4M3_MAX).to(torch.float32)
    q = (w / expand(scale_inv, w.shape)).clamp(-E4M3_MAX, E4M3_MAX)
    return q.to(torch.float8_e4m3fn), scale_inv


def expand(scale_inv: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Each element's block scale, cropped to the weight's shape (partial edge blocks)."""
    s = scale_inv.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)
    return s[: shape[0], : shape[1]]


def dequantize_fp8(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    return q.to(torch.float32) * expand(scale_inv, q.shape)


@dataclass(frozen=True)
class Sources:
    """The FP8 source, the float source holding its dequantized weights, their HF model."""

    fp8: Path
    float: Path
    hf: transformers.PreTrainedModel
    tensors: dict[str, torch.Tensor]  # the FP8 source's tensors


def write_source(dst: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(config))
    safetensors_torch.save_file(tensors, dst / SINGLE)
    return dst


def fp8_tensors(saved: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """(FP8 tensors + scales, float tensors with the dequantized weights) of `saved`."""
    fp8, floats = {}, {}
    for name, w in saved.items():
        if LINEAR.search(name):
            q, s = quantize_fp8(w)
            fp8[name], fp8[f"{name}_scale_inv"] = q, s
            floats[name] = dequantize_fp8(q, s)
        else:
            fp8[name] = floats[name] = w
    return fp8, floats


def draw_fp8(root: Path, seed: int, **shape) -> tuple[dict, dict, dict]:
    """(config.json, FP8 tensors + scales, float tensors holding their dequantized weights) of
    a random Mixtral of SHAPE changed by `shape`."""
    cfg = transformers.AutoConfig.for_model("mixtral", **{**BASE, **SHAPE, **shape})
    raw = root / "raw"
    _draw_model(cfg, seed).save_pretrained(raw)
    fp8, floats = fp8_tensors(safetensors_torch.load_file(raw / SINGLE))
    config = json.loads((raw / "config.json").read_text())
    shutil.rmtree(raw)
    return {**config, "quantization_config": QUANTIZATION_CONFIG}, fp8, floats


def build_sources(root: Path, seed: int = 0) -> Sources:
    """Draws a model until its dequantized weights route PROMPTS away from ties."""
    for draw in range(seed, seed + 20):
        config, fp8, floats = draw_fp8(root, draw)
        float_config = {k: v for k, v in config.items() if k != "quantization_config"}
        float_dir = write_source(root / f"float{draw}", float_config, floats)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            float_dir, dtype=torch.float32, experts_implementation="eager").eval()
        if routing_margin(hf, PROMPTS) >= ROUTING_MARGIN:
            return Sources(write_source(root / "fp8", config, fp8), float_dir, hf, fp8)
    raise AssertionError(f"20 draws all route PROMPTS within {ROUTING_MARGIN} of a tie")


def variant(src: Sources, dst: Path, edit: Callable[[dict], None] = lambda t: None,
            **config_changes) -> Path:  # fmt: skip
    """A copy of the FP8 source with its tensors changed by `edit`, its config by the rest."""
    tensors = dict(src.tensors)
    edit(tensors)
    config = {**json.loads((src.fp8 / "config.json").read_text()), **config_changes}
    return write_source(dst, {k: v for k, v in config.items() if v is not None}, tensors)


# ------------------------------------------------------------------------ checkpoints


def arrays(path: Path) -> dict[str, np.ndarray]:
    """Every stored array of a Strata checkpoint, by name."""
    r = CheckpointReader(path)
    out = {f"globals/{k}": v for k, v in r.read_globals().items()}
    for layer in range(r.config.num_layers):
        out.update({f"{layer}/{k}": v for k, v in r.read_layer_dense(layer).items()})
        for kind in r.expert_specs:
            for e in range(r.config.num_experts):
                out[f"{layer}/{e}/{kind}"] = r.read_expert(layer, e, kind)
    return out


def assert_same_bits(got: Path, want: Path) -> None:
    a, b = arrays(got), arrays(want)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert a[name].tobytes() == b[name].tobytes(), f"{name} differs"


def meta(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf_convert_fp8")


@pytest.fixture(scope="module")
def sources(root) -> Sources:
    return build_sources(root)


@pytest.fixture(scope="module")
def converted(root, sources) -> Path:
    dst = root / "fp8.strata"
    convert_hf(sources.fp8, dst)
    return dst


# ------------------------------------------------------------------------ (a), (b): exact


def test_source_has_fp8_weights_with_partial_blocks(sources):
    t = sources.tensors
    q = "model.layers.0.self_attn.q_proj.weight"
    assert t[q].dtype == torch.float8_e4m3fn and tuple(t[q].shape) == (192, 256)
    assert tuple(t[f"{q}_scale_inv"].shape) == (2, 2)  # rows 128 + 64: a partial block
    assert sum(n.endswith("_scale_inv") for n in t) == 2 * (4 + 3 * 8)
    assert t["model.layers.0.block_sparse_moe.gate.weight"].dtype == torch.float32


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_fp8_conversion_equals_the_dequantized_float_one(root, sources, converted, dtype):
    if dtype is None:
        got = converted
    else:
        got = root / f"fp8.{dtype}.strata"
        convert_hf(sources.fp8, got, dtype=dtype)
    want = root / f"float.{dtype}.strata"
    convert_hf(sources.float, want, dtype=dtype)
    assert_same_bits(got, want)
    assert meta(got)["source"]["quantization_config"] == QUANTIZATION_CONFIG
    assert "quantization_config" not in meta(want)["source"]


def test_fp8_logits_match_transformers_on_the_dequantized_model(converted, sources):
    model = strata_jax.load(converted)
    assert model.config.head_dim == 48 and model.config.num_experts == 8
    assert_logits_close(strata_jax.logits(model, PROMPTS), hf_logits(sources.hf, PROMPTS))


def test_scales_in_another_shard(root, sources, converted):
    """The index may put a weight and its scale grid in different shards."""
    src = root / "sharded"
    src.mkdir()
    shutil.copy(sources.fp8 / "config.json", src / "config.json")
    shards = ({}, {})
    for name, t in sources.tensors.items():
        shards[name.endswith("_scale_inv")][name] = t
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        safetensors_torch.save_file(shard, src / fname)
        weight_map.update(dict.fromkeys(shard, fname))
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    convert_hf(src, root / "sharded.strata")
    assert_same_bits(root / "sharded.strata", converted)


def test_fused_expert_tensors(root, sources, converted):
    """transformers-5 expert names in FP8 (experts.gate_up_proj [E, 2F, D], down_proj [E, D,
    F], each with a grid per expert); F = 256 makes the gate and up halves whole blocks, so
    this is the split source's FP8, read one layer's tensor at a time."""
    tensors = {n: v for n, v in sources.tensors.items() if ".experts." not in n}
    for layer in range(2):
        pre = f"model.layers.{layer}.block_sparse_moe.experts."

        def stacked(*kinds: str, suffix: str = "", pre: str = pre) -> torch.Tensor:
            return torch.stack([
                torch.cat([sources.tensors[f"{pre}{e}.{k}.weight{suffix}"] for k in kinds])
                for e in range(8)
            ])  # fmt: skip

        for name, kinds in (("gate_up_proj", ("w1", "w3")), ("down_proj", ("w2",))):
            tensors[pre + name] = stacked(*kinds)
            tensors[f"{pre}{name}_scale_inv"] = stacked(*kinds, suffix="_scale_inv")
    fused = tensors["model.layers.1.block_sparse_moe.experts.gate_up_proj"]
    assert fused.dtype == torch.float8_e4m3fn and tuple(fused.shape) == (8, 512, 256)
    config = json.loads((sources.fp8 / "config.json").read_text())
    src = write_source(root / "fused_fp8", config, tensors)
    convert_hf(src, root / "fused.strata")
    assert_same_bits(root / "fused.strata", converted)


# ------------------------------------------------------------------------ (c): memory


def test_peak_memory_is_a_few_tensors_not_the_model(root, converted, monkeypatch):
    """Python/numpy allocations (tracemalloc) stay a few tensors, far below the model.

    The model: 8 layers of 8 experts, 192 expert weights of 256 KiB in float32. What is live at
    the peak: the expert arrays the writer has queued (up to 4 x its workers + 1; one worker
    here, where there would be one per core), one layer's dense params, and the tensor being
    read (its FP8 bytes, float32 result and transposed copy; int4: the rounding's and the error
    measure's temporaries). `converted` ran a conversion first, so that one-time imports and
    set-up are not counted.
    """
    config, tensors, _ = draw_fp8(root, 0, num_hidden_layers=8)
    src = write_source(root / "deep_fp8", config, tensors)
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    float32_bytes = {n: t.numel() * 4 for n, t in tensors.items() if "_scale_inv" not in n}
    largest, model = max(float32_bytes.values()), sum(float32_bytes.values())
    assert largest == 256 * 256 * 4 and model > 192 * largest
    for name, quantize in (("float", {}), ("int4", {"experts": "int4-rtn", "dense": "int8"})):
        tracemalloc.start()
        try:
            convert_hf(src, root / f"deep.{name}", **quantize)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        print(f"{name}: peak {peak / 2**20:.2f} MiB traced = {peak / largest:.1f} x the largest "
              f"float32 tensor ({largest / 2**10:.0f} KiB); model float32 "
              f"{model / 2**20:.1f} MiB")  # fmt: skip
        assert peak < 16 * largest < model / 12
        assert CheckpointReader(root / f"deep.{name}").config.num_layers == 8


# ------------------------------------------------------------------------ (d): quantize


QUANT_FLAGS = ("--experts", "int4-rtn", "--dense", "int8")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quantizing_while_converting_equals_convert_then_quantize(root, sources, dtype):
    once, floats, twice = (root / f"{name}.{dtype}" for name in ("once", "floats", "twice"))
    flags = ("--dtype", dtype)
    assert cli.main(["convert", "hf", str(sources.fp8), str(once), *flags, *QUANT_FLAGS]) == 0
    assert cli.main(["convert", "hf", str(sources.fp8), str(floats), *flags]) == 0
    assert cli.main(["quantize", str(floats), str(twice), *QUANT_FLAGS]) == 0
    assert_same_bits(once, twice)
    assert meta(once)["quantization"] == meta(twice)["quantization"] == {
        "dense": "int8", "experts": "int4-g128"}  # fmt: skip
    q = meta(once)["quantize"]
    assert (q["experts"], q["dense"], q["expert_methods"]) == ("int4-rtn", "int8", {"rtn": 16})

    report, ref = (json.loads((p / REPORT_FILE).read_text()) for p in (once, twice))
    assert report["options"] == ref["options"] and report["dense"] == ref["dense"]
    assert [{k: r[k] for k in ("layer", "expert", "methods")} for r in report["experts"]] == [
        {k: r[k] for k in ("layer", "expert", "methods")} for r in ref["experts"]]  # fmt: skip
    assert "weight_error" not in ref and "weight_error" not in ref["experts"][0]
    check_weight_errors(report, CheckpointReader(floats), CheckpointReader(once), dtype)


def check_weight_errors(report: dict, floats: CheckpointReader, once: CheckpointReader,
                        dtype: str) -> None:  # fmt: skip
    """Each expert's reported error is |W - Wq| / |W| against the float32 source weight."""
    errors = []
    for r in report["experts"]:
        for kind in EXPERT_KINDS:
            w = floats.read_expert(r["layer"], r["expert"], kind).astype(np.float32)
            wq = quant.dequantize_int4(quant.Int4Weight(
                once.read_expert(r["layer"], r["expert"], kind),
                once.read_expert(r["layer"], r["expert"], f"{kind}_scale")))  # fmt: skip
            want = np.linalg.norm(wq - w) / np.linalg.norm(w)
            if dtype == "float32":  # bf16 storage: the report measures against the FP8 source
                assert r["weight_error"][kind] == pytest.approx(want, rel=1e-5)
            errors.append(r["weight_error"][kind])
    assert 0.01 < min(errors) and max(errors) < 0.2  # int4 g128 of Gaussian weights: ~0.1
    summary = report["weight_error"]
    assert summary["max"] == max(errors) and summary["mean"] == pytest.approx(np.mean(errors))


def test_dense_only_keeps_float_experts(root, sources, converted):
    dst = root / "dense_only"
    convert_hf(sources.fp8, dst, dense="int8")
    assert meta(dst)["quantization"] == {"dense": "int8", "experts": "none"}
    a, b = arrays(dst), arrays(converted)
    assert all(a[k].tobytes() == b[k].tobytes() for k in a if k.count("/") == 2)
    report = json.loads((dst / REPORT_FILE).read_text())
    assert report["expert_methods"] == {"none": 16} and "weight_error" not in report


# ------------------------------------------------------------------------ (e): errors


def _drop(name: str) -> Callable[[dict], None]:
    return lambda t: t.pop(name)


def _shrink(name: str) -> Callable[[dict], None]:
    def edit(t):
        t[name] = t[name][:1].clone()

    return edit


Q_PROJ = "model.layers.1.self_attn.q_proj.weight"
EXPERT = "model.layers.0.block_sparse_moe.experts.5.w2.weight"


@pytest.mark.parametrize("case, edit, changes, pattern", [
    ("no_scale", _drop(f"{EXPERT}_scale_inv"), {},
     rf"tensor '{EXPERT}' in model\.safetensors is FP8 .* block scales '{EXPERT}_scale_inv' "
     r"are missing"),
    ("bad_grid", _shrink(f"{Q_PROJ}_scale_inv"), {},
     rf"tensor '{Q_PROJ}_scale_inv' in model\.safetensors has shape \(1, 2\), but '{Q_PROJ}' "
     r"of shape \(192, 256\) in 128x128 blocks \(quantization_config\.weight_block_size\) "
     r"needs \(2, 2\)"),
    ("awq", lambda t: None, {"quantization_config": {"quant_method": "awq", "bits": 4}},
     r"config\.json: quantization_config\.quant_method = 'awq' is not supported"),
    ("no_config", lambda t: None, {"quantization_config": None},
     r"tensor '.*' in model\.safetensors is FP8 \(F8_E4M3\) but config\.json has no "
     r"quantization_config"),
    ("per_tensor", lambda t: None, {"quantization_config": {"quant_method": "fp8"}},
     r"quantization_config\.weight_block_size is missing"),
])  # fmt: skip
def test_bad_fp8_sources_are_named_before_writing(root, sources, case, edit, changes, pattern):
    src = variant(sources, root / f"bad_{case}", edit, **changes)
    dst = root / f"bad_{case}.strata"
    with pytest.raises(ValueError, match=pattern):
        convert_hf(src, dst)
    assert not dst.exists() and not list(root.glob(f"{dst.name}.partial-*"))


def test_gptq_while_converting_is_refused(root, sources):
    with pytest.raises(ValueError, match=r"experts='int4-gptq' needs calibration .*`strata "
                                         r"quantize --experts int4-gptq`"):  # fmt: skip
        convert_hf(sources.fp8, root / "gptq.strata", experts="int4-gptq")
    assert not (root / "gptq.strata").exists()
