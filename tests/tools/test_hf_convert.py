"""Acceptance tests for `strata convert hf`: tiny random transformers models, converted by the
real CLI, must reproduce transformers' logits and greedy generations."""

from __future__ import annotations

import copy
import functools
import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

import strata_jax  # noqa: E402
from strata_jax import api  # noqa: E402
from strata_jax.formats.checkpoint import CheckpointError  # noqa: E402
from strata_jax.tools.hf_convert import convert_hf, model_config_from_hf  # noqa: E402
from strata_runtime.cli import main as cli  # noqa: E402

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
BASE = dict(
    vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, num_experts_per_tok=2, eos_token_id=None, pad_token_id=0,
    bos_token_id=None,
)  # fmt: skip
FAMILY_KW = {
    "mixtral": dict(num_local_experts=8, intermediate_size=32),
    "qwen2_moe": dict(num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                      intermediate_size=64),
    "qwen3_moe": dict(num_experts=8, moe_intermediate_size=32, intermediate_size=64, head_dim=32,
                      norm_topk_prob=True, tie_word_embeddings=True),
    "olmoe": dict(num_experts=8, intermediate_size=32, clip_qkv=1.5),
}  # fmt: skip
PROMPTS = np.random.default_rng(1).integers(0, 128, size=(2, 10)).tolist()
GEN_PROMPTS = [PROMPTS[0][:5], PROMPTS[1]]
LOGIT_TOL = 1e-4


ROUTING_MARGIN = 1e-4  # least gap between the k-th and (k+1)-th router probability


def build_model(family: str, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """A tiny float32 model whose weights are large enough for non-degenerate routing.

    The reference runs transformers' eager experts (one plain matmul per expert): its default
    `grouped_mm` experts round differently at the ulp level. The weights are redrawn (next
    seed) until no token of PROMPTS sits within ROUTING_MARGIN of a routing tie, where an ulp
    in either library would pick other experts and the comparison would test nothing.
    """
    cfg = transformers.AutoConfig.for_model(family, **{**BASE, **FAMILY_KW[family], **overrides})
    for draw in range(seed, seed + 50):
        model = _draw_model(cfg, draw)
        if routing_margin(model, PROMPTS) >= ROUTING_MARGIN:
            return model
    raise AssertionError(f"{family}: 50 draws all route PROMPTS within {ROUTING_MARGIN} of a tie")


def _draw_model(cfg, seed: int) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, dtype=torch.float32, experts_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def routing_margin(model, prompts: list[list[int]]) -> float:
    """Smallest gap, over tokens and layers, between the last chosen and the first unchosen
    expert's router probability."""
    k = model.config.num_experts_per_tok
    gaps = []

    def hook(_module, _inputs, out):
        logits = out[0] if isinstance(out, tuple) else out
        top = torch.topk(torch.softmax(logits.float(), dim=-1), k + 1, dim=-1).values
        gaps.append(float((top[..., k - 1] - top[..., k]).min()))

    gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    handles = [g.register_forward_hook(hook) for g in gates]
    try:
        hf_logits(model, prompts)
    finally:
        for h in handles:
            h.remove()
    assert len(gaps) == model.config.num_hidden_layers, "router modules not found"
    return min(gaps)


def logit_margin(model, prompts: list[list[int]], router_suffix: str) -> float:
    """Smallest gap, over tokens and layers, between the k-th and (k+1)-th router logit of
    the modules whose names end in `router_suffix` (top-k over logits: GPT-OSS, Qwen3-Next)."""
    k, gaps = model.config.num_experts_per_tok, []

    def hook(_module, _inputs, out):
        top = torch.topk(out[0].double(), k + 1, dim=-1).values
        gaps.append(float((top[:, k - 1] - top[:, k]).min()))

    routers = [m for n, m in model.named_modules() if n.endswith(router_suffix)]
    handles = [r.register_forward_hook(hook) for r in routers]
    try:
        hf_logits(model, prompts)
    finally:
        for h in handles:
            h.remove()
    assert len(gaps) == model.config.num_hidden_layers, "router modules not found"
    return min(gaps)


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of one unpadded prompt, exactly `n` tokens (the mask
    given: a token 0 is no padding here)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=n, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


def hf_logits(model, prompts: list[list[int]]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(prompts)).logits.float().numpy()


def hf_generate(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy continuations of a left-padded batch, exactly `n` new tokens each."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n
        )
    return out[:, width:].tolist()


def bf16_rounded(model):
    """A float32 copy of an HF model whose parameters (not rotary buffers) are bf16-rounded."""
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    return rounded


def upcast(model: strata_jax.Model) -> strata_jax.Model:
    """A float32 copy of a Strata model (same weights, float32 compute)."""

    def f32(x):
        return jnp.asarray(x, jnp.float32)

    return strata_jax.Model(
        model.config.replace(dtype="float32"),
        jax.tree.map(f32, model.params),
        jax.tree.map(f32, model.experts),
        model.slot_table,
    )


def assert_logits_close(got: np.ndarray, ref: np.ndarray, rel: float = LOGIT_TOL) -> None:
    err, scale = np.abs(got - ref).max(), np.abs(ref).max()
    assert err <= rel * scale, f"max |Δ| = {err:.3g} > {rel} * max|ref| = {rel * scale:.3g}"


def assert_matches(model: strata_jax.Model, hf) -> None:
    """Strata logits of PROMPTS match the transformers model's."""
    assert_logits_close(strata_jax.logits(model, PROMPTS), hf_logits(hf, PROMPTS))


def convert(src: Path, dst: Path, *flags: str) -> None:
    assert cli.main(["convert", "hf", str(src), str(dst), *flags]) == 0


@dataclass(frozen=True)
class Case:
    """One family's HF model, its saved directory, and the converted Strata model."""

    family: str
    hf: transformers.PreTrainedModel
    src: Path
    dst: Path
    model: strata_jax.Model


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf_convert")


@pytest.fixture(scope="module")
def case(root) -> Callable[[str], Case]:
    """Builds, saves and converts each family once per module."""
    cache: dict[str, Case] = {}

    def get(family: str) -> Case:
        if family not in cache:
            hf = build_model(family)
            src, dst = root / family, root / f"{family}.strata"
            hf.save_pretrained(src)
            convert(src, dst)
            cache[family] = Case(family, hf, src, dst, strata_jax.load(dst))
        return cache[family]

    return get


def copy_source(src: Path, dst: Path, edit: Callable[[dict[str, np.ndarray]], None]) -> Path:
    """A copy of single-file HF checkpoint `src` with its tensors changed by `edit`."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = safetensors_numpy.load_file(src / "model.safetensors")
    edit(tensors)
    safetensors_numpy.save_file(tensors, dst / "model.safetensors")
    return dst


def edit_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


# --- acceptance per family ---------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(case, family):
    c = case(family)
    assert c.model.config.family == family
    assert_matches(c.model, c.hf)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_transformers(case, family):
    c = case(family)
    ref = hf_generate(c.hf, GEN_PROMPTS, 16)
    assert [len(r) for r in ref] == [16, 16]
    assert strata_jax.generate(c.model, GEN_PROMPTS, 16) == ref


def test_config_mapping(case):
    cfg = case("qwen3_moe").model.config
    assert (cfg.head_dim, cfg.qk_norm, cfg.tie_word_embeddings, cfg.norm_topk_prob) == (
        32, "head", True, True,
    )  # fmt: skip
    qwen2 = case("qwen2_moe").model.config
    assert (qwen2.shared_intermediate_size, qwen2.shared_gate, qwen2.attention_bias) == (
        64, True, True,
    )  # fmt: skip
    olmoe = case("olmoe").model.config
    assert (olmoe.qk_norm, olmoe.clip_qkv, olmoe.expert_intermediate_size) == ("full", 1.5, 32)
    assert case("mixtral").model.config.rope_theta == 1e6


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_tree_is_the_flax_model_tree(case, family):
    """The HF import gives the param tree that the Flax model's `init` lays out."""
    model = case(family).model
    init = jax.eval_shape(functools.partial(api.init_params, model.config), jax.random.key(0))
    chex.assert_trees_all_equal_shapes_and_dtypes(init, model.params)


# --- source layouts and dtypes -----------------------------------------------------------------


def test_sharded_checkpoint(case, root):
    c = case("qwen2_moe")
    src, dst = root / "sharded", root / "sharded.strata"
    c.hf.save_pretrained(src, max_shard_size=100_000)
    assert (src / "model.safetensors.index.json").exists()
    assert len(list(src.glob("*.safetensors"))) > 1
    convert(src, dst)
    assert_matches(strata_jax.load(dst), c.hf)


def test_fused_expert_names(case, root):
    """transformers-5 in-memory names (mlp.experts.gate_up_proj / down_proj) also convert."""
    c = case("mixtral")
    src, dst = root / "fused", root / "fused.strata"
    src.mkdir()
    shutil.copy(c.src / "config.json", src / "config.json")
    state = {k: v.numpy() for k, v in c.hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    safetensors_numpy.save_file(state, src / "model.safetensors")
    convert(src, dst)
    assert_matches(strata_jax.load(dst), c.hf)


def test_bfloat16_conversion(case, root):
    c = case("qwen2_moe")
    dst = root / "bf16.strata"
    convert(c.src, dst, "--dtype", "bfloat16")
    model = strata_jax.load(dst)
    assert model.config.dtype == "bfloat16" and model.experts.w1.dtype == jnp.bfloat16
    assert_matches(upcast(model), bf16_rounded(c.hf))  # stored weights: exactly rounded float32
    got, ref = strata_jax.logits(model, PROMPTS), hf_logits(c.hf, PROMPTS)
    assert np.linalg.norm(got - ref) <= 5e-2 * np.linalg.norm(ref)  # bf16 compute: close


def test_bfloat16_source(case, root):
    """bf16 safetensors decode exactly; the default storage dtype follows the source."""
    c = case("olmoe")
    src, dst = root / "bf16_src", root / "bf16_src.strata"
    copy.deepcopy(c.hf).to(torch.bfloat16).save_pretrained(src)
    convert(src, dst)
    assert json.loads((dst / "config.json").read_text())["dtype"] == "bfloat16"
    convert(src, dst, "--dtype", "float32", "--overwrite")
    model = strata_jax.load(dst)
    assert model.config.dtype == "float32"
    assert_matches(model, bf16_rounded(c.hf))


# --- errors ------------------------------------------------------------------------------------


def test_unknown_model_type_lists_families(case, root, capsys):
    src = edit_config(case("mixtral").src, root / "llama", model_type="llama")
    assert cli.main(["convert", "hf", str(src), str(root / "llama.strata")]) == 2
    err = capsys.readouterr().err
    assert "'llama'" in err and all(f in err for f in FAMILIES)
    assert not (root / "llama.strata").exists()


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"sliding_window": 16}, "sliding_window"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0}}, "rope_type"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
         "original_max_position_embeddings"),
    ],
)
def test_unsupported_config_names_field(case, root, changes, field):
    src = edit_config(case("mixtral").src, root / f"bad_{field}", **changes)
    with pytest.raises(ValueError, match=field):
        convert_hf(src, root / f"bad_{field}.strata")


def test_unsupported_qwen_layouts():
    hf = {**BASE, **FAMILY_KW["qwen3_moe"], "model_type": "qwen3_moe"}
    assert model_config_from_hf(hf).num_experts == 8
    for changes, field in [
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
        ({"mlp_only_layers": [0]}, "mlp_only_layers"),
    ]:
        with pytest.raises(ValueError, match=field):
            model_config_from_hf({**hf, **changes})


def test_missing_tensor_is_named(case, root):
    name = "model.layers.1.block_sparse_moe.experts.3.w3.weight"
    src = copy_source(case("mixtral").src, root / "missing", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=rf"{name}.*model\.safetensors"):
        convert_hf(src, root / "missing.strata")
    assert not (root / "missing.strata").exists()


def test_misshaped_tensor_is_named(case, root):
    name = "model.layers.0.self_attn.k_proj.weight"

    def truncate(t):
        t[name] = t[name][:16]

    src = copy_source(case("mixtral").src, root / "misshaped", truncate)
    with pytest.raises(ValueError, match=rf"{name}.*\(16, 64\).*\(32, 64\)"):
        convert_hf(src, root / "misshaped.strata")


def test_unexpected_layer_tensor_is_refused(case, root):
    name = "model.layers.0.self_attn.o_proj.bias"

    def add(t):
        t[name] = np.zeros(64, np.float32)

    src = copy_source(case("mixtral").src, root / "extra", add)
    with pytest.raises(ValueError, match=rf"unexpected tensor '{name}'"):
        convert_hf(src, root / "extra.strata")


def test_existing_destination_needs_overwrite(case, capsys):
    c = case("mixtral")
    assert cli.main(["convert", "hf", str(c.src), str(c.dst)]) == 2
    assert "already exists" in capsys.readouterr().err
    convert(c.src, c.dst, "--overwrite")
    assert_matches(strata_jax.load(c.dst), c.hf)


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("strata convert: error: ") and err.count("\n") == 1, err
    return err


def test_relative_paths(case, root, monkeypatch):
    c = case("mixtral")
    monkeypatch.chdir(root)
    convert(Path(c.src.name), Path("out") / ".." / "relative.strata")
    assert_matches(strata_jax.load(root / "relative.strata"), c.hf)
    assert (root / "relative.strata").is_dir() and not (root / "out").exists()


@pytest.mark.parametrize("where, why", [
    (".", "is the source itself"),
    ("sub/dst", "lies inside the source"),
    ("..", "contains the source"),
])  # fmt: skip
def test_destination_overlapping_the_source_is_refused(case, capsys, where, why):
    src = case("mixtral").src
    before = sorted((p.name, p.stat().st_size) for p in src.iterdir())
    assert cli.main(["convert", "hf", str(src), str(src / where), "--overwrite"]) == 2
    assert why in one_error_line(capsys)
    assert sorted((p.name, p.stat().st_size) for p in src.iterdir()) == before


def test_file_destination_is_refused_before_reading_the_source(case, root, capsys):
    """The source here has no tensors at all: the destination is refused before they are read."""
    src = root / "config_only"
    src.mkdir()
    shutil.copy(case("mixtral").src / "config.json", src / "config.json")
    dst = root / "taken.bin"
    dst.write_bytes(b"keep")
    for flags in ([], ["--overwrite"]):
        assert cli.main(["convert", "hf", str(src), str(dst), *flags]) == 2
        assert f"destination {dst} is a file, not a folder" in one_error_line(capsys)
    assert dst.read_bytes() == b"keep"
    assert cli.main(["convert", "hf", str(src), str(root / "config_only.strata")]) == 2
    assert "neither model.safetensors nor" in one_error_line(capsys)


def test_overwrite_refuses_a_folder_that_is_not_a_checkpoint(case, root, capsys):
    other = root / "other_hf"
    shutil.copytree(case("mixtral").src, other)
    assert cli.main(["convert", "hf", str(case("mixtral").src), str(other), "--overwrite"]) == 2
    err = one_error_line(capsys)
    assert f"refusing to overwrite {other}" in err and "no manifest.json" in err
    assert (other / "model.safetensors").exists()


@pytest.mark.parametrize("text, why", [
    ('{"model_type": "mixtral",', "not valid JSON"),
    ('"mixtral"', "expected a JSON object"),
])  # fmt: skip
def test_broken_config_json_is_named(case, root, capsys, text, why):
    src = root / f"broken_config_{len(text)}"
    shutil.copytree(case("mixtral").src, src)
    (src / "config.json").write_text(text)
    assert cli.main(["convert", "hf", str(src), str(root / "broken.strata")]) == 2
    err = one_error_line(capsys)
    assert f"{src / 'config.json'}: {why}" in err and "re-download" in err
    assert not (root / "broken.strata").exists()


def test_index_without_weight_map_is_named(case, root):
    src = root / "no_weight_map"
    shutil.copytree(case("mixtral").src, src)
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match=r"index\.json: missing key 'weight_map'"):
        convert_hf(src, root / "no_weight_map.strata")


# --- crash safety ------------------------------------------------------------------------------


def test_killed_conversion_leaves_nothing_loadable(root):
    src, dst = root / "deep", root / "deep.strata"
    build_model("mixtral", num_hidden_layers=8).save_pretrained(src)
    cmd = [sys.executable, "-m", "strata_runtime.cli", "convert", "hf", str(src), str(dst)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        partial = _wait_for_partial(proc, dst)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "conversion finished before it could be killed"
    assert partial.exists() and not dst.exists()
    with pytest.raises(CheckpointError):
        strata_jax.load(dst)
    with pytest.raises(CheckpointError):
        strata_jax.load(partial)
    convert(src, dst)
    assert not partial.exists()
    assert strata_jax.load(dst).config.num_layers == 8


def _wait_for_partial(proc: subprocess.Popen, dst: Path, timeout: float = 60.0) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = list(dst.parent.glob(f"{dst.name}.partial-*"))
        if found:
            return found[0]
        assert proc.poll() is None, f"conversion exited ({proc.returncode}) before writing"
        time.sleep(0.002)
    raise AssertionError(f"no {dst.name}.partial-* directory within {timeout}s")
