"""The Strata checkpoint format: orbax dense params, one TensorStore chunk per expert weight.

Layout (see checkpoints/README.md):
    DST/config.json          format, version, model config, dtype, quantization
    DST/manifest.json        every expert chunk's sha256, written last
    DST/dense/globals/       orbax: embed, lm_head, final_norm
    DST/dense/layer_NNNN/    orbax: MoE layer NNNN's attention, norms, router, shared expert
    DST/dense/mlp_layer_NNNN/  orbax: dense-MLP layer NNNN (the `dense_layers` before them)
    DST/dense/attn_NNNN/, linear_NNNN/  orbax: a model with linear layers
                             (`ModelConfig.linear_layers`): the token-mixer params of its
                             NNNN-th attention layer / Gated DeltaNet layer
    DST/dense/mtp_NNNN/      orbax: multi-token-prediction module NNNN's dense params; its
                             experts are the expert arrays' layer num_layers + NNNN
    DST/experts/{w1,w3,w2}/  zarr3 [layer, expert, in, out], chunk = one (layer, expert)
    DST/experts/{b1,b3,b2}/  biased experts only (GPT-OSS): zarr3 [layer, expert, out]

A writer fills `DST.partial-<pid>` and swaps it into place only after the manifest is
written (`safe_write`), so a killed conversion never leaves a directory that `read_*` accepts
and a replaced checkpoint is removed only once the new one is complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from strata_jax.formats import safe_write
from strata_jax.formats.config import (
    F32_PARAMS,
    ModelConfig,
    attn_layer_shapes,
    dense_layer_shapes,
    linear_layer_shapes,
    mlp_layer_shapes,
    mtp_layer_shapes,
)
from strata_jax.formats.quant import GROUP as INT4_GROUP

FORMAT = "strata"
FORMAT_VERSION = 2  # 2: int4 experts packed output-major in K pairs (1: group half-split)
EXPERT_KINDS = ("w1", "w3", "w2")
EXPERT_BIASES = ("b1", "b3", "b2")  # the biases of EXPERT_KINDS (`ModelConfig.expert_bias`)
GLOBAL_NAMES = ("embed", "lm_head", "final_norm")
CONFIG_FILE, MANIFEST_FILE = "config.json", "manifest.json"
REWRITE = "re-create the checkpoint with the command that wrote it (convert, synth, quantize)"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, or corrupt."""


def read_json_object(path: Path, fix: str = REWRITE) -> dict[str, Any]:
    """The JSON object in `path`; CheckpointError naming the file, what is wrong and `fix`."""
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); {fix}"
        ) from e
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: not a UTF-8 text file; {fix}") from e
    except OSError as e:
        raise CheckpointError(f"{path}: unreadable ({e.strerror or e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(
            f"{path}: expected a JSON object {{...}}, got {type(data).__name__}; {fix}")
    return data


def require(doc: dict[str, Any], key: str, kind: type | tuple[type, ...], path: Path,
            fix: str = REWRITE) -> Any:
    """doc[key], which must be a `kind`; else CheckpointError naming `path`, `key` and `fix`."""
    if key not in doc:
        raise CheckpointError(f"{path}: missing key {key!r}; {fix}")
    value = doc[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise CheckpointError(
            f"{path}: key {key!r} should be {names}, got {type(value).__name__}; {fix}")
    return value


def numpy_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def expert_shape(cfg: ModelConfig, kind: str) -> tuple[int, int]:
    d, f = cfg.hidden_size, cfg.expert_intermediate_size
    return (f, d) if kind == "w2" else (d, f)


def expert_bias_shapes(cfg: ModelConfig) -> dict[str, tuple[int]]:
    """The biases of one expert (`ModelConfig.expert_bias`; none otherwise): each weight's
    output width."""
    if not cfg.expert_bias:
        return {}
    return {b: (expert_shape(cfg, w)[1],) for b, w in zip(EXPERT_BIASES, EXPERT_KINDS,
                                                           strict=True)}


FLOAT = {"dense": "none", "experts": "none"}
DENSE_QUANTS = ("none", "int8")
EXPERT_QUANTS = ("none", "int4-g128")
# dense matrices that int8 quantization covers (router, norms, biases stay in the model dtype)
INT8_MATRICES = ("wq", "wk", "wv", "wo", "shared_w1", "shared_w3", "shared_w2", "wq_a", "wq_b",
                 "wkv_a", "ffn_w1", "ffn_w3", "ffn_w2")

ArraySpec = tuple[tuple[int, ...], str]  # (shape, dtype name)


def _check_version(config_path: Path, meta: dict, quant: dict[str, str]) -> None:
    """Version 1 differs only in the int4 expert layout, so its float-expert checkpoints load."""
    require(meta, "format", str, config_path)
    version = require(meta, "format_version", int, config_path)
    if meta["format"] != FORMAT or version not in (1, FORMAT_VERSION):
        raise CheckpointError(
            f"{config_path}: unsupported format {meta.get('format')!r} version {version!r}")
    if version == 1 and quant.get("experts") != "none":
        raise CheckpointError(
            f"{config_path}: format version 1 packs int4 experts in the retired group half-split "
            "layout; re-run `strata quantize` on the float checkpoint")


def checkpoint_problem(path: Path) -> str | None:
    """Why the folder `path` is not a Strata checkpoint (its config.json and manifest.json, as
    the reader finds them), or None if it is one."""
    missing = [n for n in (CONFIG_FILE, MANIFEST_FILE) if not (path / n).is_file()]
    if missing:
        return f"no {' or '.join(missing)}"
    try:
        meta = read_json_object(path / CONFIG_FILE)
    except CheckpointError as e:
        return str(e)
    if meta.get("format") != FORMAT:
        return f"{path / CONFIG_FILE} has format {meta.get('format')!r}, not {FORMAT!r}"
    return None


def check_destination(
    dst: str | os.PathLike, *, overwrite: bool = False, sources: Iterable[str | os.PathLike] = ()
) -> Path:
    """The absolute path a checkpoint may be written to, or a clear error (see `safe_write`).

    Writers call it before any work; `CheckpointWriter` checks again when it starts.
    """
    return safe_write.prepare_destination(
        dst, overwrite=overwrite, replaceable=checkpoint_problem, sources=sources)


def check_quantization(quant: dict[str, str]) -> None:
    if quant.get("dense") not in DENSE_QUANTS or quant.get("experts") not in EXPERT_QUANTS:
        raise CheckpointError(
            f"unsupported quantization {quant}; dense in {DENSE_QUANTS}, experts in {EXPERT_QUANTS}"
        )


def expert_arrays(cfg: ModelConfig, quant: dict[str, str] = FLOAT) -> dict[str, ArraySpec]:
    """Stored arrays of one expert: w1/w3/w2 in the model dtype, or packed int4 + scales; the
    biases of biased experts in the model dtype, never quantized."""
    biases = {b: (shape, cfg.dtype) for b, shape in expert_bias_shapes(cfg).items()}
    if quant["experts"] == "none":
        return {**{kind: (expert_shape(cfg, kind), cfg.dtype) for kind in EXPERT_KINDS},
                **biases}
    specs: dict[str, ArraySpec] = {}
    for kind in EXPERT_KINDS:
        k, n = expert_shape(cfg, kind)
        if k % INT4_GROUP:
            raise CheckpointError(
                f"expert {kind}: input dim {k} is not a multiple of the int4 group {INT4_GROUP}"
            )
        specs[kind] = ((n, k // 2), "uint8")  # output-major K pairs (quant.pack_int4)
        specs[f"{kind}_scale"] = ((k // INT4_GROUP, n), "bfloat16")
    return {**specs, **biases}


def dense_layer_arrays(cfg: ModelConfig, quant: dict[str, str] = FLOAT) -> dict[str, ArraySpec]:
    """Stored arrays of one MoE layer's dense params, with int8 matrices + scales if quantized."""
    return _stored(cfg, dense_layer_shapes(cfg), quant)


def mlp_layer_arrays(cfg: ModelConfig, quant: dict[str, str] = FLOAT) -> dict[str, ArraySpec]:
    """Stored arrays of one dense-MLP layer (`ModelConfig.dense_layers`), as above."""
    return _stored(cfg, mlp_layer_shapes(cfg), quant)


MIXER_KINDS = ("attn", "linear")
"""The token-mixer param groups of a model with linear layers: its attention layers' and its
Gated DeltaNet layers' (`mixer_arrays`)."""


def mixer_arrays(cfg: ModelConfig, kind: str,
                 quant: dict[str, str] = FLOAT) -> dict[str, ArraySpec]:
    """Stored arrays of one token mixer of `kind` ("attn" / "linear"), as above."""
    shapes = {"attn": attn_layer_shapes, "linear": linear_layer_shapes}[kind](cfg)
    return _stored(cfg, shapes, quant)


def mixer_counts(cfg: ModelConfig) -> dict[str, int]:
    """How many token mixers of each kind a checkpoint of `cfg` stores apart (none without
    linear layers: the attention params are then the MoE layers')."""
    if not cfg.linear_layers:
        return {"attn": 0, "linear": 0}
    linear = len(cfg.linear_layers)
    return {"attn": cfg.num_layers - linear, "linear": linear}


def mtp_layer_arrays(cfg: ModelConfig, quant: dict[str, str] = FLOAT) -> dict[str, ArraySpec]:
    """Stored arrays of one multi-token-prediction module's dense params, as above."""
    return _stored(cfg, mtp_layer_shapes(cfg), quant)


def _stored(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]],
            quant: dict[str, str]) -> dict[str, ArraySpec]:
    specs: dict[str, ArraySpec] = {}
    for name, shape in shapes.items():
        if quant["dense"] == "int8" and name in INT8_MATRICES:
            specs[name] = (shape, "int8")
            specs[f"{name}_scale"] = ((shape[-1],), "bfloat16")
        elif cfg.scoring == "sigmoid" and name in F32_PARAMS:
            specs[name] = (shape, "float32")
        else:
            specs[name] = (shape, cfg.dtype)
    return specs


def global_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    shapes = {"embed": (cfg.vocab_size, cfg.hidden_size), "final_norm": (cfg.hidden_size,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, cfg.hidden_size)
    return shapes


@dataclass(frozen=True)
class StoredModel:
    """What a checkpoint of `config` stored with `quantization` holds, without one on disk:
    the attributes of a `CheckpointReader` that sizes and plans read (`strata plan --shape`)."""

    config: ModelConfig
    quantization: dict[str, str]

    def __post_init__(self) -> None:
        check_quantization(self.quantization)

    @property
    def expert_specs(self) -> dict[str, ArraySpec]:
        return expert_arrays(self.config, self.quantization)

    @property
    def dense_specs(self) -> dict[str, ArraySpec]:
        return dense_layer_arrays(self.config, self.quantization)

    @property
    def mlp_specs(self) -> dict[str, ArraySpec]:
        return mlp_layer_arrays(self.config, self.quantization)


def _shapes(specs: dict[str, ArraySpec]) -> dict[str, tuple[int, ...]]:
    return {k: v[0] for k, v in specs.items()}


def _check_shapes(expected: dict[str, tuple[int, ...]], got: dict[str, Any], where: str) -> None:
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    if missing or extra:
        raise CheckpointError(f"{where}: missing params {missing}, unexpected params {extra}")
    for name, shape in expected.items():
        if tuple(got[name].shape) != shape:
            raise CheckpointError(
                f"{where}: param {name!r} has shape {tuple(got[name].shape)}, expected {shape}"
            )


def _chunk_key(kind: str, layer: int, expert: int) -> str:
    return f"{kind}/{layer}/{expert}"


def _sha256(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).view(np.uint8).data).hexdigest()


def _expert_spec(path: Path, shape: tuple[int, ...], dtype: str, create: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(path)},
    }
    if create:
        spec["metadata"] = {
            "shape": list(shape),
            "data_type": dtype,
            "chunk_grid": {
                "name": "regular",
                "configuration": {"chunk_shape": [1, 1, *shape[2:]]},
            },
            # plain bytes: without this TensorStore shards each chunk into 1024x1024
            # sub-chunks behind an index, and one expert is no longer one plain read
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
        }
        spec["create"] = True
    return spec


DENSE_CHUNK_BYTES = 64 << 20
"""The most bytes of one stored chunk of a dense array."""


class CheckpointWriter:
    """Streams a checkpoint layer by layer into a temporary directory, swapped in on `commit`.

    Expert chunks are written and hashed on a thread pool; `write_expert` returns at once.
    Use as a context manager: leaving the block by an exception deletes the partial directory
    and leaves `dst` as it was. `dst` follows `check_destination`'s rules (`sources`: what the
    writer reads from, which it must not overwrite).
    """

    def __init__(
        self,
        dst: str | os.PathLike,
        config: ModelConfig,
        *,
        overwrite: bool = False,
        quantization: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
        workers: int | None = None,
        sources: Iterable[str | os.PathLike] = (),
    ) -> None:
        self.config = config
        self.quantization = dict(quantization or FLOAT)
        check_quantization(self.quantization)
        self._expert_specs = expert_arrays(config, self.quantization)
        self._dense_specs = dense_layer_arrays(config, self.quantization)
        self._mlp_specs = mlp_layer_arrays(config, self.quantization)
        self._mtp_specs = mtp_layer_arrays(config, self.quantization)
        self._mixer_specs = {k: mixer_arrays(config, k, self.quantization) for k in MIXER_KINDS}
        self.extra = extra or {}
        self._target = safe_write.SafeWrite(
            dst, overwrite=overwrite, replaceable=checkpoint_problem, sources=sources)
        self.dst, self.tmp = self._target.dst, self._target.tmp
        try:
            self._open(workers)
        except BaseException:
            self._target.abort()
            raise

    def _open(self, workers: int | None) -> None:
        config = self.config
        self._pool = ThreadPoolExecutor(workers or min(16, os.cpu_count() or 1))
        self._pending: list[Future] = []
        self._hashes: dict[str, str] = {}
        self._lock = threading.Lock()
        self._layers_done: set[int] = set()
        self._mlp_layers_done: set[int] = set()
        self._mtp_done: set[int] = set()
        self._mixers_done: dict[str, set[int]] = {k: set() for k in MIXER_KINDS}
        self._globals_done = False
        self._checkpointer = ocp.StandardCheckpointer()
        self._experts = {
            kind: ts.open(
                _expert_spec(
                    self.tmp / "experts" / kind,
                    (config.num_layers + config.mtp_layers, config.num_experts, *shape),
                    dtype,
                    create=True,
                )
            ).result()
            for kind, (shape, dtype) in self._expert_specs.items()
        }
        self.bytes_written = 0

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()

    def abort(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._target.abort()

    def _save_dense(self, name: str, tree: dict[str, np.ndarray], dtypes: dict[str, str]) -> None:
        tree = {k: np.asarray(v, dtype=numpy_dtype(dtypes[k])) for k, v in tree.items()}
        # chunked, so that a read decodes the chunks of one large array (an embedding) on all
        # cores at once instead of the whole array on one
        chunks = {k: ocp.SaveArgs(chunk_byte_size=DENSE_CHUNK_BYTES) for k in tree}
        self._checkpointer.save(self.tmp / "dense" / name, tree, save_args=chunks)
        self._checkpointer.wait_until_finished()
        self.bytes_written += sum(v.nbytes for v in tree.values())

    def write_globals(self, params: dict[str, np.ndarray]) -> None:
        """Embeddings, final norm and (untied) lm_head."""
        _check_shapes(global_shapes(self.config), params, "globals")
        self._save_dense("globals", params, {k: self.config.dtype for k in params})
        self._globals_done = True

    def write_layer_dense(self, layer: int, params: dict[str, np.ndarray]) -> None:
        _check_shapes(_shapes(self._dense_specs), params, f"layer {layer}")
        dtypes = {k: v[1] for k, v in self._dense_specs.items()}
        self._save_dense(f"layer_{layer:04d}", params, dtypes)
        with self._lock:
            self._layers_done.add(layer)

    def write_mlp_layer(self, layer: int, params: dict[str, np.ndarray]) -> None:
        """Dense-MLP layer `layer` (of `ModelConfig.dense_layers`)."""
        _check_shapes(_shapes(self._mlp_specs), params, f"dense-MLP layer {layer}")
        self._save_dense(f"mlp_layer_{layer:04d}", params,
                         {k: v[1] for k, v in self._mlp_specs.items()})
        with self._lock:
            self._mlp_layers_done.add(layer)

    def write_mtp_layer(self, index: int, params: dict[str, np.ndarray]) -> None:
        """Multi-token-prediction module `index`'s dense params (its experts: `write_expert`
        at layer num_layers + index)."""
        _check_shapes(_shapes(self._mtp_specs), params, f"MTP module {index}")
        self._save_dense(f"mtp_{index:04d}", params,
                         {k: v[1] for k, v in self._mtp_specs.items()})
        with self._lock:
            self._mtp_done.add(index)

    def write_mixer(self, kind: str, index: int, params: dict[str, np.ndarray]) -> None:
        """The token-mixer params of the `index`-th layer of `kind` ("attn" / "linear") of a
        model with linear layers."""
        specs = self._mixer_specs[kind]
        _check_shapes(_shapes(specs), params, f"{kind} layer {index}")
        self._save_dense(f"{kind}_{index:04d}", params, {k: v[1] for k, v in specs.items()})
        with self._lock:
            self._mixers_done[kind].add(index)

    def write_file(self, name: str, data: bytes) -> None:
        """A file beside config.json (the tokenizer's), swapped in with the rest on `commit`."""
        if Path(name).name != name or name in (CONFIG_FILE, MANIFEST_FILE):
            raise CheckpointError(f"write_file: {name!r} is not a plain file name of its own")
        (self.tmp / name).write_bytes(data)

    def write_expert(self, layer: int, expert: int, kind: str, array: np.ndarray) -> Future:
        """Queue one expert array (see `expert_arrays`) for writing; returns its future."""
        if kind not in self._expert_specs:
            raise CheckpointError(
                f"layer {layer} expert {expert}: unknown array {kind!r} for quantization "
                f"{self.quantization}; expected one of {sorted(self._expert_specs)}"
            )
        shape, dtype = self._expert_specs[kind]
        if tuple(array.shape) != shape:
            raise CheckpointError(
                f"layer {layer} expert {expert} {kind}: shape {tuple(array.shape)}, "
                f"expected {shape}"
            )
        array = np.ascontiguousarray(array, dtype=numpy_dtype(dtype))
        fut = self._pool.submit(self._write_chunk, layer, expert, kind, array)
        self._pending.append(fut)
        if len(self._pending) > 4 * self._pool._max_workers:
            self._drain(keep=2 * self._pool._max_workers)
        return fut

    def _write_chunk(self, layer: int, expert: int, kind: str, array: np.ndarray) -> None:
        digest = _sha256(array)
        self._experts[kind][layer, expert].write(array).result()
        with self._lock:
            self._hashes[_chunk_key(kind, layer, expert)] = digest
            self.bytes_written += array.nbytes

    def _drain(self, keep: int = 0) -> None:
        while len(self._pending) > keep:
            self._pending.pop(0).result()

    def commit(self) -> Path:
        """Wait for all writes, check completeness, write metadata and swap into place.

        On any failure the partial directory is removed and `dst` is left as it was.
        """
        try:
            self._finish()
        except BaseException:
            self.abort()
            raise
        return self._target.commit()

    def _finish(self) -> None:
        self._drain()
        self._pool.shutdown(wait=True)
        cfg = self.config
        missing_layers = sorted(set(range(cfg.num_layers)) - self._layers_done)
        missing_mlp = sorted(set(range(cfg.dense_layers)) - self._mlp_layers_done)
        missing_mtp = sorted(set(range(cfg.mtp_layers)) - self._mtp_done)
        missing_mixers = {k: sorted(set(range(n)) - self._mixers_done[k])
                          for k, n in mixer_counts(cfg).items()}
        if (missing_layers or missing_mlp or missing_mtp or any(missing_mixers.values())
                or not self._globals_done):
            raise CheckpointError(
                f"incomplete checkpoint: dense params of MoE layers missing {missing_layers}, "
                f"dense-MLP layers missing {missing_mlp}, MTP modules missing {missing_mtp}, "
                f"token mixers missing {missing_mixers}, globals written={self._globals_done}"
            )
        expected = ((cfg.num_layers + cfg.mtp_layers) * cfg.num_experts
                    * len(self._expert_specs))
        if len(self._hashes) != expected:
            raise CheckpointError(f"incomplete checkpoint: {len(self._hashes)}/{expected} chunks")
        meta = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "dtype": cfg.dtype,
            "quantization": self.quantization,
            "model": cfg.to_dict(),
            **self.extra,
        }
        (self.tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
        manifest = {"format_version": FORMAT_VERSION, "expert_chunks": self._hashes}
        _write_fsynced(self.tmp / MANIFEST_FILE, json.dumps(manifest, sort_keys=True))


def _write_fsynced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _model_config(config_path: Path, meta: dict[str, Any]) -> ModelConfig:
    try:
        return ModelConfig.from_dict(require(meta, "model", dict, config_path))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{config_path}: key 'model': {e}; {REWRITE}") from e


class CheckpointReader:
    """Reads a committed checkpoint; verifies expert chunks against the manifest."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = safe_write.absolute(path)  # tensorstore refuses relative and `..` paths
        config_path, manifest_path = self.path / CONFIG_FILE, self.path / MANIFEST_FILE
        if not self.path.is_dir():
            raise CheckpointError(f"no checkpoint at {self.path}")
        if not config_path.exists() or not manifest_path.exists():
            raise CheckpointError(
                f"{self.path} is not a complete Strata checkpoint (config.json or manifest.json "
                "missing; an interrupted conversion leaves no manifest)"
            )
        self.meta = read_json_object(config_path)
        self.quantization = dict(require(self.meta, "quantization", dict, config_path)
                                 if "quantization" in self.meta else FLOAT)
        _check_version(config_path, self.meta, self.quantization)
        self.config = _model_config(config_path, self.meta)
        check_quantization(self.quantization)
        self.expert_specs = expert_arrays(self.config, self.quantization)
        self.dense_specs = dense_layer_arrays(self.config, self.quantization)
        self.mlp_specs = mlp_layer_arrays(self.config, self.quantization)
        self.mtp_specs = mtp_layer_arrays(self.config, self.quantization)
        self.mixer_specs = {k: mixer_arrays(self.config, k, self.quantization)
                            for k in MIXER_KINDS}
        manifest = read_json_object(manifest_path)
        require(manifest, "format_version", int, manifest_path)
        self.hashes: dict[str, str] = require(manifest, "expert_chunks", dict, manifest_path)
        self._checkpointer = ocp.StandardCheckpointer()
        self._experts: dict[str, ts.TensorStore] = {}

    def _dense(self, name: str, expected: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
        path = self.path / "dense" / name
        if not path.exists():
            raise CheckpointError(f"{self.path}: dense params {name!r} missing")
        tree = self._checkpointer.restore(path)
        _check_shapes(expected, tree, f"{self.path} {name}")
        return {k: np.asarray(v) for k, v in tree.items()}

    def read_globals(self) -> dict[str, np.ndarray]:
        return self._dense("globals", global_shapes(self.config))

    def read_layer_dense(self, layer: int) -> dict[str, np.ndarray]:
        return self._dense(f"layer_{layer:04d}", _shapes(self.dense_specs))

    def read_mlp_layer(self, layer: int) -> dict[str, np.ndarray]:
        """Dense-MLP layer `layer` (of `ModelConfig.dense_layers`)."""
        return self._dense(f"mlp_layer_{layer:04d}", _shapes(self.mlp_specs))

    def read_mtp_layer(self, index: int) -> dict[str, np.ndarray]:
        """Multi-token-prediction module `index`'s dense params (its experts:
        `iter_layer_experts(num_layers + index)`)."""
        return self._dense(f"mtp_{index:04d}", _shapes(self.mtp_specs))

    def read_mixer(self, kind: str, index: int) -> dict[str, np.ndarray]:
        """The token-mixer params of the `index`-th layer of `kind` (`write_mixer`)."""
        return self._dense(f"{kind}_{index:04d}", _shapes(self.mixer_specs[kind]))

    def expert_store(self, kind: str) -> ts.TensorStore:
        if kind not in self._experts:
            if kind not in self.expert_specs:
                raise CheckpointError(f"{self.path}: no expert array {kind!r}")
            spec = _expert_spec(self.path / "experts" / kind, (), "", create=False)
            self._experts[kind] = ts.open(spec, read=True).result()
        return self._experts[kind]

    def read_expert(self, layer: int, expert: int, kind: str, verify: bool = True) -> np.ndarray:
        """One expert weight, checked against its manifest hash."""
        where = f"{self.path}: layer {layer} expert {expert} weight {kind}"
        try:
            array = self.expert_store(kind)[layer, expert].read().result()
        except Exception as e:  # tensorstore raises ValueError/OSError variants
            raise CheckpointError(f"{where}: unreadable chunk ({e})") from e
        if verify:
            want = self.hashes.get(_chunk_key(kind, layer, expert))
            if want is None:
                raise CheckpointError(f"{where}: not listed in manifest.json")
            if _sha256(array) != want:
                raise CheckpointError(f"{where}: checksum mismatch (corrupt chunk)")
        return array

    def iter_layer_experts(self, layer: int) -> Iterator[tuple[str, np.ndarray]]:
        """(kind, [E, ...]) for each stored expert array of one layer, verified. The chunks are
        read and hashed on threads (both release the GIL), into one array per kind."""
        num = self.config.num_experts
        with ThreadPoolExecutor(min(16, os.cpu_count() or 1, num)) as pool:
            for kind, (shape, dtype) in self.expert_specs.items():
                out = np.empty((num, *shape), numpy_dtype(dtype))

                def one(e: int, kind: str = kind, out: np.ndarray = out) -> None:
                    out[e] = self.read_expert(layer, e, kind)

                list(pool.map(one, range(num)))
                yield kind, out
