"""Convert a Hugging Face MoE checkpoint (config.json + safetensors) into the Strata format.

Supported `model_type`s: mixtral, qwen2_moe, qwen3_moe, olmoe. The whole source is checked
(config fields, tensor names and shapes, read from the safetensors headers) before anything is
written; then tensors are streamed one layer at a time into a `CheckpointWriter`, and the
tokenizer files the source has (`tokenizer.TOKENIZER_FILES`) are copied beside them.

Safetensors files are read directly (8-byte header length, JSON header, raw little-endian
data), so bfloat16 sources need neither torch nor an upcast: they decode to ml_dtypes.bfloat16.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Container, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import ml_dtypes
import numpy as np
from tqdm import tqdm

from strata_jax.formats.checkpoint import (
    EXPERT_KINDS,
    CheckpointWriter,
    check_destination,
    dense_layer_shapes,
    expert_shape,
    global_shapes,
    numpy_dtype,
    read_json_object,
    require,
)
from strata_jax.formats.config import DTYPES, ModelConfig
from strata_jax.formats.safe_write import absolute
from strata_jax.formats.tokenizer import SOURCE_KEY, copy_tokenizer_files

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
REDOWNLOAD = "re-download or re-export the Hugging Face model"
# Non-parameter buffers some exporters include; they carry no weights we need.
IGNORED_TENSORS = re.compile(r"(^|\.)rotary_emb\.|\.inv_freq$")
SAFETENSORS_DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F64": np.dtype("<f8"),
}


@dataclass(frozen=True)
class Family:
    """How one HF `model_type` names its config fields and MoE tensors."""

    name: str
    experts_keys: tuple[str, ...]  # config keys for the expert count, first present wins
    intermediate_key: str  # config key for the routed expert FFN width
    moe_prefixes: tuple[str, ...]  # module holding router + experts; first is canonical
    split_names: tuple[str, str, str]  # per-expert tensor names for (w1, w3, w2)
    qk_norm: str
    rope_theta: float  # default when the config names none
    rms_eps: float


_PROJ_NAMES = ("gate_proj", "up_proj", "down_proj")
FAMILIES: dict[str, Family] = {
    "mixtral": Family("mixtral", ("num_local_experts", "num_experts"), "intermediate_size",
                      ("block_sparse_moe", "mlp"), ("w1", "w3", "w2"), "none", 1e6, 1e-5),
    "qwen2_moe": Family("qwen2_moe", ("num_experts", "num_local_experts"),
                        "moe_intermediate_size", ("mlp",), _PROJ_NAMES, "none", 1e4, 1e-6),
    "qwen3_moe": Family("qwen3_moe", ("num_experts", "num_local_experts"),
                        "moe_intermediate_size", ("mlp",), _PROJ_NAMES, "head", 1e4, 1e-6),
    "olmoe": Family("olmoe", ("num_experts", "num_local_experts"), "intermediate_size",
                    ("mlp",), _PROJ_NAMES, "full", 1e4, 1e-5),
}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# config.json -> ModelConfig


def family_of(hf: dict[str, Any]) -> Family:
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported families: {', '.join(FAMILIES)}"
        )
    return FAMILIES[model_type]


def _field(hf: dict[str, Any], *keys: str) -> Any:
    """The first of `keys` present (and not null) in the HF config."""
    for key in keys:
        if hf.get(key) is not None:
            return hf[key]
    raise ValueError(f"config.json: missing field {' / '.join(map(repr, keys))}")


def _reject(condition: bool, field: str, value: Any, why: str) -> None:
    if condition:
        raise ValueError(f"config.json: {field}={value!r} is not supported ({why})")


def _check_supported(hf: dict[str, Any], fam: Family) -> None:
    """Refuse configs whose math the Strata model does not implement."""
    act = hf.get("hidden_act", "silu")
    _reject(act != "silu", "hidden_act", act, "only SwiGLU experts with silu are implemented")
    if fam.name == "mixtral":
        window = hf.get("sliding_window")
        _reject(window is not None, "sliding_window", window, "no sliding-window attention")
    if fam.name in ("qwen2_moe", "qwen3_moe"):
        use_window = hf.get("use_sliding_window", False)
        _reject(bool(use_window), "use_sliding_window", use_window, "no sliding-window attention")
        types = hf.get("layer_types") or []
        _reject("sliding_attention" in types, "layer_types", types, "no sliding-window attention")
        step = hf.get("decoder_sparse_step", 1)
        _reject(step != 1, "decoder_sparse_step", step, "every layer must be an MoE layer")
        dense = hf.get("mlp_only_layers") or []
        _reject(bool(dense), "mlp_only_layers", dense, "every layer must be an MoE layer")
    if fam.name in ("qwen3_moe", "olmoe"):
        bias = hf.get("attention_bias", False)
        _reject(bool(bias), "attention_bias", bias, "o_proj bias is not implemented")


def _rope_theta(hf: dict[str, Any], fam: Family) -> float:
    """rope_theta from transformers-5 `rope_parameters` or the older top-level fields."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"config.json: rope_parameters={params!r} is not a mapping")
    rope_type = params.get("rope_type", params.get("type", "default"))
    _reject(rope_type != "default", "rope_type", rope_type, "only default RoPE is implemented")
    theta = params.get("rope_theta", hf.get("rope_theta"))
    return float(fam.rope_theta if theta is None else theta)


def _attention_bias(hf: dict[str, Any], fam: Family) -> bool:
    if fam.name == "qwen2_moe":
        return bool(hf.get("qkv_bias", True))
    if fam.name == "mixtral":
        return False
    return bool(hf.get("attention_bias", False))


def source_dtype(hf: dict[str, Any]) -> str:
    """The config's `dtype`/`torch_dtype` when Strata can store it, else float32."""
    name = hf.get("dtype") or hf.get("torch_dtype")
    return name if name in DTYPES else "float32"


def model_config_from_hf(hf: dict[str, Any], dtype: str | None = None) -> ModelConfig:
    """Map a Hugging Face config.json dict onto a ModelConfig, rejecting unsupported math."""
    fam = family_of(hf)
    _check_supported(hf, fam)
    hidden, heads = int(_field(hf, "hidden_size")), int(_field(hf, "num_attention_heads"))
    shared = int(hf.get("shared_expert_intermediate_size") or 0) if fam.name == "qwen2_moe" else 0
    clip = hf.get("clip_qkv") if fam.name == "olmoe" else None
    return ModelConfig(
        family=fam.name,
        vocab_size=int(_field(hf, "vocab_size")),
        hidden_size=hidden,
        num_layers=int(_field(hf, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        num_experts=int(_field(hf, *fam.experts_keys)),
        top_k=int(_field(hf, "num_experts_per_tok")),
        expert_intermediate_size=int(_field(hf, fam.intermediate_key)),
        shared_intermediate_size=shared,
        shared_gate=shared > 0,
        norm_topk_prob=True if fam.name == "mixtral" else bool(hf.get("norm_topk_prob", False)),
        qk_norm=fam.qk_norm,
        attention_bias=_attention_bias(hf, fam),
        clip_qkv=None if clip is None else float(clip),
        rope_theta=_rope_theta(hf, fam),
        rms_eps=float(hf.get("rms_norm_eps") or fam.rms_eps),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        dtype=dtype or source_dtype(hf),
        max_position=int(hf["max_position_embeddings"]) if hf.get("max_position_embeddings")
        else None,
    )


# ---------------------------------------------------------------------------------------------
# safetensors, read one tensor at a time


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: file, dtype, shape and absolute byte range."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def _read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse one safetensors file's header (no tensor data is read)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 0 < n <= size - 8:
            raise ValueError(f"{path}: not a safetensors file (header length {n})")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: corrupt safetensors header ({e})") from e
    base = 8 + n
    try:
        infos = {name: _info(path, base, e) for name, e in header.items() if name != "__metadata__"}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: malformed safetensors header ({e!r})") from e
    past_end = [name for name, info in infos.items() if info.end > size]
    if past_end:
        raise ValueError(f"{path}: truncated; tensor {past_end[0]!r} ends past the end of file")
    return infos


def _info(path: Path, base: int, entry: dict[str, Any]) -> TensorInfo:
    begin, end = entry["data_offsets"]
    return TensorInfo(path, entry["dtype"], tuple(entry["shape"]), base + begin, base + end)


class TensorSource:
    """Every tensor of a HF checkpoint directory, read lazily by name."""

    def __init__(self, src: Path) -> None:
        self.src = src
        self.files, self.tensors = _scan(src)
        self._stack = ExitStack()
        self._handles: dict[Path, BinaryIO] = {}

    def __enter__(self) -> TensorSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def describe(self) -> str:
        """The file set searched, for error messages."""
        return f"{self.src} (searched {', '.join(f.name for f in self.files)})"

    def read(self, name: str) -> np.ndarray:
        """One tensor as a fresh numpy array in its stored dtype (bf16 -> ml_dtypes)."""
        info = self.tensors[name]
        if info.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(
                f"tensor {name!r} in {info.file.name} has dtype {info.dtype}; supported: "
                f"{', '.join(SAFETENSORS_DTYPES)} (quantized sources are not supported)"
            )
        dtype = SAFETENSORS_DTYPES[info.dtype]
        count = int(np.prod(info.shape, dtype=np.int64))
        if info.end - info.start != count * dtype.itemsize:
            raise ValueError(f"tensor {name!r} in {info.file.name}: byte range mismatches shape")
        f = self._handle(info.file)
        f.seek(info.start)
        data = f.read(info.end - info.start)
        if len(data) != info.end - info.start:
            raise ValueError(f"tensor {name!r} in {info.file.name}: file is truncated")
        return np.frombuffer(data, dtype=dtype, count=count).reshape(info.shape)

    def _handle(self, path: Path) -> BinaryIO:
        if path not in self._handles:
            self._handles[path] = self._stack.enter_context(open(path, "rb"))
        return self._handles[path]


def _scan(src: Path) -> tuple[list[Path], dict[str, TensorInfo]]:
    """Files and tensor table of `src`: the sharded index if present, else model.safetensors."""
    index_path, single = src / INDEX_FILE, src / SINGLE_FILE
    if index_path.exists():
        index = read_json_object(index_path, REDOWNLOAD)
        weight_map: dict[str, str] = require(index, "weight_map", dict, index_path, REDOWNLOAD)
        files = [src / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.exists():
                raise FileNotFoundError(f"{index_path} names shard {f.name}, which is missing")
        headers = {f.name: _read_header(f) for f in files}
        tensors = {}
        for name, fname in weight_map.items():
            if name not in headers[fname]:
                raise ValueError(f"{INDEX_FILE} maps tensor {name!r} to {fname}, which lacks it")
            tensors[name] = headers[fname][name]
        return files, tensors
    if single.exists():
        return [single], _read_header(single)
    raise FileNotFoundError(f"{src}: neither {SINGLE_FILE} nor {INDEX_FILE} found")


# ---------------------------------------------------------------------------------------------
# HF tensor names -> Strata params


@dataclass(frozen=True)
class Ref:
    """One Strata param read from one HF tensor: `how` is copy, transpose, or flatten."""

    hf_name: str
    how: str
    shape: tuple[int, ...]  # the Strata shape

    @property
    def hf_shape(self) -> tuple[int, ...]:
        if self.how == "T":
            return self.shape[::-1]
        if self.how == "flat":
            return (1, *self.shape)
        return self.shape


@dataclass(frozen=True)
class MoeLayout:
    """Where one layer's router and experts live: module prefix and expert storage style."""

    prefix: str  # e.g. "model.layers.3.mlp."
    style: str  # "split": one tensor per (expert, kind); "fused": gate_up_proj + down_proj
    split_names: tuple[str, str, str]


_DENSE_HF = {
    "attn_norm": ("input_layernorm.weight", "copy"),
    "mlp_norm": ("post_attention_layernorm.weight", "copy"),
    "wq": ("self_attn.q_proj.weight", "T"),
    "wk": ("self_attn.k_proj.weight", "T"),
    "wv": ("self_attn.v_proj.weight", "T"),
    "wo": ("self_attn.o_proj.weight", "T"),
    "bq": ("self_attn.q_proj.bias", "copy"),
    "bk": ("self_attn.k_proj.bias", "copy"),
    "bv": ("self_attn.v_proj.bias", "copy"),
    "q_norm": ("self_attn.q_norm.weight", "copy"),
    "k_norm": ("self_attn.k_norm.weight", "copy"),
}
_MOE_HF = {
    "router": ("gate.weight", "T"),
    "shared_w1": ("shared_expert.gate_proj.weight", "T"),
    "shared_w3": ("shared_expert.up_proj.weight", "T"),
    "shared_w2": ("shared_expert.down_proj.weight", "T"),
    "shared_gate": ("shared_expert_gate.weight", "flat"),
}


def detect_layout(fam: Family, names: Container[str], layer: int) -> MoeLayout:
    """Pick the MoE module prefix and expert style present for `layer` (canonical if none)."""
    base = f"model.layers.{layer}."
    prefix = next(
        (f"{base}{p}." for p in fam.moe_prefixes if f"{base}{p}.gate.weight" in names),
        f"{base}{fam.moe_prefixes[0]}.",
    )
    if f"{prefix}experts.gate_up_proj" in names:
        return MoeLayout(prefix, "fused", fam.split_names)
    for split in (fam.split_names, ("w1", "w3", "w2"), _PROJ_NAMES):
        if f"{prefix}experts.0.{split[0]}.weight" in names:
            return MoeLayout(prefix, "split", split)
    return MoeLayout(prefix, "split", fam.split_names)


def dense_refs(cfg: ModelConfig, layout: MoeLayout, layer: int) -> dict[str, Ref]:
    """Strata dense param -> HF tensor it comes from, for one layer."""
    base = f"model.layers.{layer}."
    refs = {}
    for name, shape in dense_layer_shapes(cfg).items():
        if name in _DENSE_HF:
            suffix, how = _DENSE_HF[name]
            refs[name] = Ref(base + suffix, how, shape)
        elif name in _MOE_HF:
            suffix, how = _MOE_HF[name]
            refs[name] = Ref(layout.prefix + suffix, how, shape)
        else:
            raise ValueError(f"no Hugging Face source for Strata param {name!r}")
    return refs


def expert_tensors(cfg: ModelConfig, layout: MoeLayout) -> dict[str, tuple[int, ...]]:
    """HF expert tensor names of one layer -> their expected HF shapes."""
    d, f, n = cfg.hidden_size, cfg.expert_intermediate_size, cfg.num_experts
    if layout.style == "fused":
        return {
            f"{layout.prefix}experts.gate_up_proj": (n, 2 * f, d),
            f"{layout.prefix}experts.down_proj": (n, d, f),
        }
    return {
        f"{layout.prefix}experts.{e}.{hf_kind}.weight": expert_shape(cfg, kind)[::-1]
        for e in range(n)
        for kind, hf_kind in zip(EXPERT_KINDS, layout.split_names, strict=True)
    }


def global_refs(cfg: ModelConfig) -> dict[str, Ref]:
    names = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight",
             "lm_head": "lm_head.weight"}  # fmt: skip
    return {k: Ref(names[k], "copy", shape) for k, shape in global_shapes(cfg).items()}


@dataclass(frozen=True)
class Plan:
    """Everything a conversion will read, checked against the source before writing."""

    config: ModelConfig
    layouts: tuple[MoeLayout, ...]

    def expected(self) -> dict[str, tuple[int, ...]]:
        """Every HF tensor the conversion reads -> its expected shape."""
        shapes = {r.hf_name: r.hf_shape for r in global_refs(self.config).values()}
        for layer, layout in enumerate(self.layouts):
            refs = dense_refs(self.config, layout, layer).values()
            shapes.update({r.hf_name: r.hf_shape for r in refs})
            shapes.update(expert_tensors(self.config, layout))
        return shapes


def _ignorable(name: str, cfg: ModelConfig) -> bool:
    return bool(IGNORED_TENSORS.search(name)) or (
        cfg.tie_word_embeddings and name == "lm_head.weight"
    )


def _preview(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(map(repr, names[:limit]))
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def check_source(plan: Plan, source: TensorSource) -> None:
    """Missing, mis-shaped and unexpected tensors, all found before anything is written."""
    expected = plan.expected()
    missing = [n for n in expected if n not in source.tensors]
    if missing:
        raise ValueError(
            f"missing tensor{'s' if len(missing) > 1 else ''} {_preview(missing)} "
            f"in {source.describe()}"
        )
    for name, shape in expected.items():
        got = source.tensors[name].shape
        if got != shape:
            raise ValueError(
                f"tensor {name!r} in {source.tensors[name].file.name} has shape {got}, "
                f"expected {shape}"
            )
    extra = sorted(
        n for n in source.tensors if n not in expected and not _ignorable(n, plan.config)
    )
    if extra:
        raise ValueError(
            f"unexpected tensor{'s' if len(extra) > 1 else ''} {_preview(extra)} in "
            f"{source.describe()}; refusing to drop weights the Strata model would not use"
        )


# ---------------------------------------------------------------------------------------------
# conversion


def _cast(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if array.dtype == dtype:
        return array
    return array.astype(np.float32).astype(dtype)


def _load(source: TensorSource, ref: Ref, dtype: np.dtype) -> np.ndarray:
    array = _cast(source.read(ref.hf_name), dtype)
    if ref.how == "T":
        return np.ascontiguousarray(array.T)
    return array.reshape(ref.shape)


def iter_experts(
    source: TensorSource, cfg: ModelConfig, layout: MoeLayout, dtype: np.dtype
) -> Iterator[tuple[int, str, np.ndarray]]:
    """(expert, kind, [in, out] array) for one layer, one expert weight at a time."""
    if layout.style == "fused":
        f = cfg.expert_intermediate_size
        gate_up = source.read(f"{layout.prefix}experts.gate_up_proj")
        down = source.read(f"{layout.prefix}experts.down_proj")
        for e in range(cfg.num_experts):
            yield e, "w1", _cast(gate_up[e, :f].T, dtype)
            yield e, "w3", _cast(gate_up[e, f:].T, dtype)
            yield e, "w2", _cast(down[e].T, dtype)
        return
    for e in range(cfg.num_experts):
        for kind, hf_kind in zip(EXPERT_KINDS, layout.split_names, strict=True):
            name = f"{layout.prefix}experts.{e}.{hf_kind}.weight"
            yield e, kind, _cast(source.read(name).T, dtype)


def read_hf_config(src: Path) -> dict[str, Any]:
    path = src / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{src}: no config.json (expected a Hugging Face model directory)")
    return read_json_object(path, REDOWNLOAD)


def convert_hf(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    dtype: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Convert the HF checkpoint directory `src` into a Strata checkpoint at `dst`."""
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES} or None, got {dtype!r}")
    src = absolute(src)
    dst = check_destination(dst, overwrite=overwrite, sources=(src,))
    hf = read_hf_config(src)
    cfg = model_config_from_hf(hf, dtype)
    with TensorSource(src) as source:
        fam = family_of(hf)
        layouts = tuple(detect_layout(fam, source.tensors, i) for i in range(cfg.num_layers))
        plan = Plan(cfg, layouts)
        check_source(plan, source)
        provenance = {"format": "huggingface", "model_type": fam.name, "path": str(src)}
        if hf.get("eos_token_id") is not None:  # end-of-turn ids some models list only here
            provenance["eos_token_id"] = hf["eos_token_id"]
        with CheckpointWriter(
            dst, cfg, overwrite=overwrite, extra={SOURCE_KEY: provenance}, sources=(src,)
        ) as writer:
            _write_all(writer, source, plan)
            copy_tokenizer_files(src, writer)
            return writer.commit()


def _write_all(writer: CheckpointWriter, source: TensorSource, plan: Plan) -> None:
    cfg, np_dtype = plan.config, numpy_dtype(plan.config.dtype)
    writer.write_globals({k: _load(source, r, np_dtype) for k, r in global_refs(cfg).items()})
    for layer in tqdm(range(cfg.num_layers), desc="convert", unit="layer"):
        layout = plan.layouts[layer]
        refs = dense_refs(cfg, layout, layer)
        writer.write_layer_dense(layer, {k: _load(source, r, np_dtype) for k, r in refs.items()})
        for expert, kind, array in iter_experts(source, cfg, layout, np_dtype):
            writer.write_expert(layer, expert, kind, array)
