"""Convert a Hugging Face MoE checkpoint (config.json + safetensors) into the Strata format.

Supported `model_type`s: `hf_families.FAMILIES`. The whole source is checked
(config fields, tensor names and shapes, read from the safetensors headers) before anything is
written; then tensors are streamed one layer at a time into a `CheckpointWriter`, and the
tokenizer files the source has (`tokenizer.TOKENIZER_FILES`) are copied beside them.

Safetensors files are read directly (8-byte header length, JSON header, raw little-endian
data), so bfloat16 sources need neither torch nor an upcast: they decode to ml_dtypes.bfloat16.

Block-FP8 sources (DeepSeek-V3 style: config.json's `quantization_config` with `quant_method:
"fp8"`, each F8_E4M3 weight beside a float32 `<name>_scale_inv` grid, see `formats/fp8.py`)
convert too: every weight that has a scale grid is dequantized to float32 as it is read, one
tensor at a time, then stored like a float source's; its grid is checked with the rest. MXFP4
experts (GPT-OSS as released: `quant_method: "mxfp4"`, each `<name>_blocks` beside its
`<name>_scales`, see `formats/mxfp4.py`) read as the float tensor `<name>` they encode,
dequantized exactly. Other quantization methods are refused (dequantize them with their own
tools first).

`experts="int4-rtn"` / `dense="int8"` quantize while converting, so that a large FP8 model goes
straight to int4 experts and int8 dense matrices without a float copy on disk. Each weight is
rounded as `strata quantize` rounds the float checkpoint (the same `formats.quant` calls on the
weight in the storage dtype), so the result is bit for bit convert-then-quantize with the same
methods; quantize_report.json adds each expert's weight error against the source. GPTQ needs
calibration through the model and stays with `strata quantize`.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Container, Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import ml_dtypes
import numpy as np
from tqdm import tqdm

from strata_jax.formats import fp8, mxfp4, quant
from strata_jax.formats.checkpoint import (
    EXPERT_BIASES,
    EXPERT_KINDS,
    FLOAT,
    INT8_MATRICES,
    CheckpointWriter,
    check_destination,
    expert_arrays,
    numpy_dtype,
    read_json_object,
    require,
)
from strata_jax.formats.config import DTYPES, F32_PARAMS, ModelConfig
from strata_jax.formats.fp8 import Fp8Format, scale_name
from strata_jax.formats.safe_write import absolute
from strata_jax.formats.tokenizer import SOURCE_KEY, copy_tokenizer_files
from strata_jax.tools.hf_families import (
    Family,
    MoeLayout,
    Ref,
    dense_refs,
    detect_layout,
    expert_tensors,
    family_of,
    global_refs,
    mixer_indices,
    mixer_refs,
    mlp_refs,
    model_config_from_hf,
    mtp_count,
    mtp_refs,
    shared_copies,
)
from strata_jax.tools.quant_report import ExpertQuant, QuantOptions, QuantReport, weight_error
from strata_jax.tools.quantize import REPORT_FILE, quantize_entry, write_report

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
REDOWNLOAD = "re-download or re-export the Hugging Face model"
# Non-parameter buffers some exporters include; they carry no weights we need.
IGNORED_TENSORS = re.compile(r"(^|\.)rotary_emb\.|\.inv_freq$|^mtp\.")
"""Tensors no Strata param reads: rope tables, and Qwen3-Next's MTP module (`mtp.*`, which
transformers drops on load too)."""
SAFETENSORS_DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F64": np.dtype("<f8"),
}
FP8_DTYPE = "F8_E4M3"  # safetensors' name for torch.float8_e4m3fn
SCALE_DTYPES = ("F32", "F8_E8M0")
CONVERT_EXPERTS = ("int4-rtn", "none")  # quantize while converting: no calibration, so no GPTQ
CONVERT_DENSE = ("int8", "none")
CONVERT_CALIBRATION = "none (round-to-nearest while converting)"


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
    """Every tensor of a HF checkpoint directory, read lazily by name; with `fmt` (the source's
    `quantization_config`), block-FP8 weights are read dequantized."""

    def __init__(self, src: Path, fmt: Fp8Format | None = None, mxfp4: bool = False) -> None:
        self.src = src
        self.fmt = fmt
        self.files, self.tensors = _scan(src)
        self.mxfp4 = _mxfp4_pairs(self.tensors, mxfp4)
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
        """One tensor as a fresh numpy array in its stored dtype (bf16 -> ml_dtypes); an FP8
        weight dequantized to float32 (exactly: one float32 multiply per element); the tensor an
        MXFP4 pair encodes, in bfloat16 (exact for every e2m1 value, and half float32's
        memory: `mxfp4.dequantize_mxfp4`)."""
        if name in self.mxfp4:
            blocks, scales = self.mxfp4[name]
            return mxfp4.dequantize_mxfp4(self._raw(blocks, np.dtype(np.uint8)),
                                          self._raw(scales, np.dtype(np.uint8)), "bfloat16", name)
        self.check_dtype(name)
        info = self.tensors[name]
        if info.dtype != FP8_DTYPE:
            return self._raw(name, SAFETENSORS_DTYPES[info.dtype])
        assert self.fmt is not None  # check_dtype
        scale = scale_name(name)
        codes = self._raw(name, fp8.E4M3)
        scales = self._raw(scale, fp8.SAFETENSORS_DTYPES[self.tensors[scale].dtype])
        try:
            return fp8.dequantize_block_fp8(codes, scales, self.fmt.block, np.float32, name)
        except ValueError as e:  # non-finite values: name the file too
            raise ValueError(f"{e} (in {info.file.name})") from e

    def check_dtype(self, name: str) -> None:
        """ValueError naming the tensor and its file unless `read` can decode it: a float
        dtype, or F8_E4M3 with a `<name>_scale_inv` grid of the config's block shape."""
        if name in self.mxfp4:  # its parts were checked when found
            return
        info = self.tensors[name]
        where = f"tensor {name!r} in {info.file.name}"
        scale = scale_name(name)
        if info.dtype != FP8_DTYPE:
            if info.dtype not in SAFETENSORS_DTYPES:
                raise ValueError(
                    f"{where} has dtype {info.dtype}; supported: "
                    f"{', '.join(SAFETENSORS_DTYPES)}, and {FP8_DTYPE} with block scales"
                )
            if scale in self.tensors:
                raise ValueError(
                    f"{where} has dtype {info.dtype} but also block scales {scale!r}; "
                    f"only {FP8_DTYPE} weights have scales ({REDOWNLOAD})"
                )
            return
        if self.fmt is None:
            raise ValueError(
                f"{where} is FP8 ({FP8_DTYPE}) but config.json has no quantization_config "
                f"giving its block size; {REDOWNLOAD}"
            )
        if scale not in self.tensors:
            raise ValueError(
                f"{where} is FP8 ({FP8_DTYPE}) but its block scales {scale!r} are missing "
                f"from {self.describe()}; {REDOWNLOAD}"
            )
        s = self.tensors[scale]
        if s.dtype not in SCALE_DTYPES:
            raise ValueError(
                f"tensor {scale!r} in {s.file.name} has dtype {s.dtype}; block scales must be "
                f"{' or '.join(SCALE_DTYPES)}"
            )
        want = scale_grid(info.shape, self.fmt.block)
        if s.shape != want:
            rows, cols = self.fmt.block
            raise ValueError(
                f"tensor {scale!r} in {s.file.name} has shape {s.shape}, but {name!r} of shape "
                f"{info.shape} in {rows}x{cols} blocks (quantization_config.weight_block_size) "
                f"needs {want}"
            )

    def _raw(self, name: str, dtype: np.dtype) -> np.ndarray:
        """Tensor `name`'s bytes as a fresh array of `dtype` (its stored dtype)."""
        info = self.tensors[name]
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


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """Shape of the `_scale_inv` grid of an FP8 weight: one scale per block of its last two
    dims, partial edge blocks included."""
    if len(shape) < 2:
        return ()  # no grid fits: a 1-D FP8 tensor is refused as mis-shaped scales
    *lead, rows, cols = shape
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def fp8_format(hf: dict[str, Any], src: Path) -> Fp8Format | None:
    """The block-FP8 format of config.json's `quantization_config`, None without one or for
    MXFP4 (`declares_mxfp4`: its tensors describe themselves); any other quantization method
    is refused, naming the field."""
    qc = hf.get("quantization_config")
    if qc is None or declares_mxfp4(hf):
        return None
    where = src / "config.json"
    method = qc.get("quant_method") if isinstance(qc, Mapping) else None
    if method != "fp8":
        raise ValueError(
            f"{where}: quantization_config.quant_method = {method!r} is not supported; "
            "strata convert hf reads float sources, block-FP8 ones (quant_method 'fp8', "
            "DeepSeek-V3 style) and MXFP4 experts (quant_method 'mxfp4', GPT-OSS): "
            "dequantize the model with its own tools first"
        )
    try:
        return Fp8Format.from_hf(qc)
    except fp8.Fp8FormatError as e:
        raise fp8.Fp8FormatError(f"{where}: {e}") from e


def declares_mxfp4(hf: dict[str, Any]) -> bool:
    """Whether config.json's `quantization_config` is MXFP4's (GPT-OSS as released)."""
    qc = hf.get("quantization_config")
    return isinstance(qc, Mapping) and qc.get("quant_method") == "mxfp4"


def _mxfp4_pairs(tensors: dict[str, TensorInfo], declared: bool
                 ) -> dict[str, tuple[str, str]]:
    """Each MXFP4 pair `<name>_blocks` + `<name>_scales` of `tensors`, stood for there by the
    float tensor `<name>` it encodes (shape [experts, in, out], `formats/mxfp4.py`): name ->
    (blocks, scales), the parts kept for reading. A pair's parts are checked here (uint8,
    matching shapes), naming them."""
    pairs = {}
    for blocks in [n for n in tensors if n.endswith(mxfp4.BLOCKS_SUFFIX)]:
        name = blocks.removesuffix(mxfp4.BLOCKS_SUFFIX)
        scales, info = name + mxfp4.SCALES_SUFFIX, tensors[blocks]
        where = f"tensor {blocks!r} in {info.file.name}"
        if not declared:
            raise ValueError(f"{where}: MXFP4 blocks, but config.json's quantization_config is "
                             f"not quant_method 'mxfp4'; {REDOWNLOAD}")
        if scales not in tensors:
            raise ValueError(f"{where}: MXFP4 blocks without their scales {scales!r}; "
                             f"{REDOWNLOAD}")
        for part in (blocks, scales):
            if tensors[part].dtype != "U8":
                raise ValueError(f"tensor {part!r} in {tensors[part].file.name} has dtype "
                                 f"{tensors[part].dtype}; MXFP4 blocks and scales are U8")
        try:
            experts, out, inputs = mxfp4.check_mxfp4(info.shape, tensors[scales].shape, name)
        except mxfp4.Mxfp4Error as e:
            raise ValueError(f"{e} (in {info.file.name})") from e
        tensors[name] = TensorInfo(info.file, "MXFP4", (experts, inputs, out), 0, 0)
        pairs[name] = (blocks, scales)
    return pairs


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


@dataclass(frozen=True)
class Plan:
    """Everything a conversion will read, checked against the source before writing."""

    config: ModelConfig
    family: Family
    layouts: tuple[MoeLayout, ...]
    """One per MoE layer, then one per multi-token-prediction module."""

    @classmethod
    def of(cls, hf: dict[str, Any], cfg: ModelConfig, names: Container[str]) -> Plan:
        """The plan of `cfg` (its `mtp_layers` as many as the source holds) over `names`."""
        fam = family_of(hf)
        cfg = cfg.replace(mtp_layers=mtp_count(cfg, names))
        layouts = tuple(detect_layout(fam, names, cfg.dense_layers + i)
                        for i in range(cfg.num_layers + cfg.mtp_layers))
        return cls(cfg, fam, layouts)

    def dense_refs(self, layer: int) -> dict[str, Ref]:
        """MoE layer `layer`'s (from num_layers on: MTP module layer - num_layers's)."""
        refs = mtp_refs if layer >= self.config.num_layers else dense_refs
        return refs(self.config, self.family, self.layouts[layer])

    def expected(self) -> dict[str, tuple[int, ...]]:
        """Every HF tensor the conversion reads -> its expected shape."""
        shapes = {r.hf_name: r.hf_shape
                  for r in global_refs(self.config, self.family).values()}
        for layer, _ in mixer_indices(self.config):
            _, refs = mixer_refs(self.config, self.family, self.config.dense_layers + layer)
            shapes.update({r.hf_name: r.hf_shape for r in refs.values()})
        for layer in range(self.config.dense_layers):
            shapes.update({r.hf_name: r.hf_shape for r in mlp_refs(self.config, layer).values()})
        for layer, layout in enumerate(self.layouts):  # the MTP modules' too
            shapes.update({r.hf_name: r.hf_shape for r in self.dense_refs(layer).values()})
            shapes.update(expert_tensors(self.config, layout))
        return shapes


def _ignorable(name: str, plan: Plan) -> bool:
    cfg = plan.config
    return bool(IGNORED_TENSORS.search(name)) or (
        cfg.tie_word_embeddings and name == "lm_head.weight") or name in shared_copies(cfg)


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
        source.check_dtype(name)
    scales = {scale_name(n) for n in expected if scale_name(n) in source.tensors}
    scales |= {part for n in expected if n in source.mxfp4 for part in source.mxfp4[n]}
    extra = sorted(
        n for n in source.tensors
        if n not in expected and n not in scales
        and not _ignorable(n.removesuffix(fp8.SCALE_SUFFIX), plan)
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
    array = source.read(ref.hf_name)
    if ref.offset:  # in float32, as transformers adds it
        array = array.astype(np.float32) + np.float32(ref.offset)
    array = _cast(array, dtype)
    if ref.regroup is not None:
        array = _regrouped(array, ref.regroup)
    if ref.how == "T":
        return np.ascontiguousarray(array.T)
    if ref.how == "conv":
        return np.ascontiguousarray(array.reshape(ref.shape[::-1]).T)
    return array.reshape(ref.shape)


def _regrouped(array: np.ndarray, regroup: tuple[int, tuple[int, ...], tuple[int, ...]]
               ) -> np.ndarray:
    """The rows of `array` [groups * sum(parts), in] as `Ref.regroup` lays them out."""
    groups, parts, kept = regroup
    blocks = array.reshape(groups, sum(parts), array.shape[-1])
    edges = np.cumsum((0, *parts))
    return np.concatenate([blocks[:, edges[p]:edges[p + 1]].reshape(-1, array.shape[-1])
                           for p in kept])


def iter_experts(
    source: TensorSource, cfg: ModelConfig, layout: MoeLayout, dtype: np.dtype
) -> Iterator[tuple[int, str, np.ndarray]]:
    """(expert, kind, [in, out] array) for one layer, one expert weight at a time (biased
    experts: then their biases, `EXPERT_BIASES`)."""
    if layout.style == "interleaved":
        yield from _interleaved_experts(source, cfg, layout, dtype)
        return
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


def _interleaved_experts(
    source: TensorSource, cfg: ModelConfig, layout: MoeLayout, dtype: np.dtype
) -> Iterator[tuple[int, str, np.ndarray]]:
    """GPT-OSS's experts: gate_up_proj [E, D, 2F] holds gate and up in alternate columns
    (their biases likewise), down_proj [E, F, D]: already [in, out]."""
    gate_up = source.read(f"{layout.prefix}experts.gate_up_proj")
    gate_up_bias = source.read(f"{layout.prefix}experts.gate_up_proj_bias")
    down = source.read(f"{layout.prefix}experts.down_proj")
    down_bias = source.read(f"{layout.prefix}experts.down_proj_bias")
    for e in range(cfg.num_experts):
        yield e, "w1", _cast(np.ascontiguousarray(gate_up[e, :, 0::2]), dtype)
        yield e, "w3", _cast(np.ascontiguousarray(gate_up[e, :, 1::2]), dtype)
        yield e, "w2", _cast(np.ascontiguousarray(down[e]), dtype)
        yield e, "b1", _cast(np.ascontiguousarray(gate_up_bias[e, 0::2]), dtype)
        yield e, "b3", _cast(np.ascontiguousarray(gate_up_bias[e, 1::2]), dtype)
        yield e, "b2", _cast(np.ascontiguousarray(down_bias[e]), dtype)


def read_hf_config(src: Path) -> dict[str, Any]:
    path = src / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{src}: no config.json (expected a Hugging Face model directory)")
    return read_json_object(path, REDOWNLOAD)


def convert_options(experts: str = "none", dense: str = "none") -> QuantOptions | None:
    """What to quantize while converting (None: nothing); GPTQ is refused with the way to it."""
    for what, value, allowed in (("experts", experts, CONVERT_EXPERTS),
                                 ("dense", dense, CONVERT_DENSE)):  # fmt: skip
        if value.endswith("-gptq"):
            raise ValueError(
                f"{what}={value!r} needs calibration through the model, which a conversion "
                f"does not run: convert (with --{what} none), then `strata quantize --{what} "
                f"{value}`"
            )
        if value not in allowed:
            raise ValueError(f"{what} must be one of {allowed}, got {value!r}")
    opts = QuantOptions(experts, dense)
    return None if opts.storage == FLOAT else opts


def convert_hf(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    dtype: str | None = None,
    overwrite: bool = False,
    *,
    experts: str = "none",
    dense: str = "none",
) -> Path:
    """Convert the HF checkpoint directory `src` into a Strata checkpoint at `dst`, quantizing
    the routed experts (`experts="int4-rtn"`) and dense matrices (`dense="int8"`) on the way;
    see the module doc."""
    t0 = time.perf_counter()
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES} or None, got {dtype!r}")
    opts = convert_options(experts, dense)
    src = absolute(src)
    dst = check_destination(dst, overwrite=overwrite, sources=(src,))
    hf = read_hf_config(src)
    fmt = fp8_format(hf, src)
    cfg = model_config_from_hf(hf, dtype)
    quantization = FLOAT if opts is None else opts.storage
    expert_arrays(cfg, quantization)  # the int4 group must fit, before any reading
    with TensorSource(src, fmt, declares_mxfp4(hf)) as source:
        plan = Plan.of(hf, cfg, source.tensors)
        cfg = plan.config
        check_source(plan, source)
        provenance = {"format": "huggingface", "model_type": plan.family.name, "path": str(src)}
        if hf.get("eos_token_id") is not None:  # end-of-turn ids some models list only here
            provenance["eos_token_id"] = hf["eos_token_id"]
        if fmt is not None:
            provenance["quantization_config"] = hf["quantization_config"]
        with CheckpointWriter(
            dst, cfg, overwrite=overwrite, quantization=quantization,
            extra={SOURCE_KEY: provenance}, sources=(src,),
        ) as writer:  # fmt: skip
            records, dense_log = _write_all(writer, source, plan, opts)
            if opts is not None:
                report = QuantReport(
                    str(src), str(dst), opts, CONVERT_CALIBRATION, 0, 0, tuple(records),
                    tuple(dense_log), time.perf_counter() - t0,
                )  # fmt: skip
                writer.extra["quantize"] = quantize_entry(report)
                write_report(writer.tmp / REPORT_FILE, report)
            copy_tokenizer_files(src, writer)
            return writer.commit()


DenseLog = list[tuple[int, str, str]]  # (layer, matrix, "rtn" | "none"), as `strata quantize`


def _load_dense(source: TensorSource, cfg: ModelConfig,
                refs: dict[str, Ref]) -> dict[str, np.ndarray]:
    """One layer's dense params in the model dtype (the routing's float32 ones in float32,
    `config.F32_PARAMS`)."""
    keep = F32_PARAMS if cfg.scoring == "sigmoid" else ()
    return {k: _load(source, r, np.dtype(np.float32) if k in keep else numpy_dtype(cfg.dtype))
            for k, r in refs.items()}


def _write_all(
    writer: CheckpointWriter, source: TensorSource, plan: Plan, opts: QuantOptions | None = None
) -> tuple[list[ExpertQuant], DenseLog]:
    """Stream every tensor into `writer`, quantized as `opts` asks (None: as floats); returns
    the quantize report's expert records and dense log (empty without `opts`)."""
    cfg, np_dtype = plan.config, numpy_dtype(plan.config.dtype)
    writer.write_globals({k: _load(source, r, np_dtype)
                          for k, r in global_refs(cfg, plan.family).items()})
    for layer, index in mixer_indices(cfg):
        kind, refs = mixer_refs(cfg, plan.family, cfg.dense_layers + layer)
        writer.write_mixer(kind, index, _load_dense(source, cfg, refs))
    records: list[ExpertQuant] = []
    dense_log: DenseLog = []
    for layer in range(cfg.dense_layers):
        mlp = _load_dense(source, cfg, mlp_refs(cfg, layer))
        if opts is not None:
            mlp = quantize_dense(-1 - layer, mlp, opts, dense_log)
        writer.write_mlp_layer(layer, mlp)
    # the MoE layers, then the MTP modules (their experts the layers past num_layers)
    for layer in tqdm(range(len(plan.layouts)), desc="convert", unit="layer"):
        layout = plan.layouts[layer]
        dense = _load_dense(source, cfg, plan.dense_refs(layer))
        if opts is not None:
            dense = quantize_dense(layer, dense, opts, dense_log)
        if layer < cfg.num_layers:
            writer.write_layer_dense(layer, dense)
        else:
            writer.write_mtp_layer(layer - cfg.num_layers, dense)
        del dense  # else it lives on while the next layer's are read
        if opts is not None and opts.experts == "int4-rtn":
            records += _write_int4_experts(writer, source, cfg, layout, layer, np_dtype)
            continue
        for expert, kind, array in iter_experts(source, cfg, layout, np_dtype):
            writer.write_expert(layer, expert, kind, array)
        if opts is not None:
            records += [ExpertQuant(layer, e, 0, ("none",) * 3) for e in range(cfg.num_experts)]
    return records, dense_log


def quantize_dense(
    layer: int, params: dict[str, np.ndarray], opts: QuantOptions, log: DenseLog
) -> dict[str, np.ndarray]:
    """One layer's dense params with its `INT8_MATRICES` int8 if `opts.dense` asks, logged.

    `strata quantize --dense int8` quantizes wq/wk/wv as one fused matrix, but its scales are
    per output column, so one matrix at a time gives the same bits."""
    names = [n for n in INT8_MATRICES if n in params]
    if opts.dense == "none":
        log += [(layer, n, "none") for n in names]
        return params
    out = dict(params)
    for n in names:
        w = quant.quantize_int8(np.asarray(params[n], np.float32), name=f"layer {layer} {n}")
        out[n], out[f"{n}_scale"] = w.q, w.scales
        log.append((layer, n, "rtn"))
    return out


def _write_int4_experts(
    writer: CheckpointWriter, source: TensorSource, cfg: ModelConfig, layout: MoeLayout,
    layer: int, dtype: np.dtype,
) -> list[ExpertQuant]:  # fmt: skip
    """Round one layer's experts to int4, one weight at a time, and queue them for writing.

    Each weight is rounded as stored in `dtype` (what `strata quantize` reads from the float
    checkpoint); its error is measured against the float32 source (FP8: the dequantized one).
    """
    errors: dict[int, dict[str, float]] = {}
    for e, kind, w in iter_experts(source, cfg, layout, np.dtype(np.float32)):
        if kind in EXPERT_BIASES:  # biases stay floats
            writer.write_expert(layer, e, kind, _cast(w, dtype))
            continue
        stored = np.asarray(_cast(w, dtype), np.float32)
        q = quant.quantize_int4_rtn(stored, name=f"layer {layer} expert {e} {kind}")
        writer.write_expert(layer, e, kind, q.packed)
        writer.write_expert(layer, e, f"{kind}_scale", q.scales)
        errors.setdefault(e, {})[kind] = weight_error(w, q)
    return [
        ExpertQuant(layer, e, 0, ("rtn",) * 3, tuple(errs[k] for k in EXPERT_KINDS))
        for e, errs in sorted(errors.items())
    ]
