"""Checkpoint format: round trip, corruption detection, atomic commit."""

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

import strata_jax
from strata_jax import api
from strata_jax.formats.checkpoint import (
    FORMAT_VERSION,
    CheckpointError,
    CheckpointReader,
    CheckpointWriter,
    expert_arrays,
)
from tests.helpers import random_arrays, tiny_config, write_checkpoint

_write = write_checkpoint


def test_round_trip_is_exact(tmp_path):
    cfg = tiny_config("qwen2_moe")
    arrays = _write(cfg, tmp_path / "ck")
    loaded = strata_jax.load(tmp_path / "ck")
    assert loaded.config == cfg
    ref = api.from_arrays(cfg, *arrays)
    tokens = np.array([[1, 2, 3, 4], [9, 8, 7, 6]])
    np.testing.assert_array_equal(strata_jax.logits(loaded, tokens), api.logits(ref, tokens))
    meta = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert meta["format"] == "strata" and meta["quantization"]["experts"] == "none"


def test_bfloat16_checkpoint_loads_as_bfloat16(tmp_path):
    cfg = tiny_config(dtype="bfloat16")
    _write(cfg, tmp_path / "ck")
    m = strata_jax.load(tmp_path / "ck")
    assert m.experts.w1.dtype.name == "bfloat16"
    assert np.isfinite(strata_jax.logits(m, np.array([[1, 2, 3]]))).all()


def _chunk_files(root, kind):
    return sorted(p for p in (root / "experts" / kind).rglob("*") if p.is_file()
                  and p.name != "zarr.json")


def test_corrupt_expert_chunk_names_layer_and_expert(tmp_path):
    cfg = tiny_config()
    _write(cfg, tmp_path / "ck")
    target = tmp_path / "ck" / "experts" / "w3" / "c" / "1" / "4" / "0" / "0"
    assert target.exists(), _chunk_files(tmp_path / "ck", "w3")
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"layer 1 expert 4 weight w3.*checksum"):
        strata_jax.load(tmp_path / "ck")


def test_truncated_expert_chunk_names_layer_and_expert(tmp_path):
    cfg = tiny_config()
    _write(cfg, tmp_path / "ck")
    target = tmp_path / "ck" / "experts" / "w2" / "c" / "0" / "2" / "0" / "0"
    target.write_bytes(target.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"layer 0 expert 2 weight w2"):
        strata_jax.load(tmp_path / "ck")


def test_failed_write_leaves_nothing(tmp_path):
    cfg = tiny_config()
    g, layers, _ = random_arrays(cfg)
    with pytest.raises(CheckpointError, match="incomplete"):
        with CheckpointWriter(tmp_path / "ck", cfg) as w:
            w.write_globals(g)
            w.write_layer_dense(0, {k: v[0] for k, v in layers.items()})
            w.commit()
    assert os.listdir(tmp_path) == []
    with pytest.raises(CheckpointError, match="no checkpoint"):
        strata_jax.load(tmp_path / "ck")


def test_uncommitted_directory_is_rejected(tmp_path):
    cfg = tiny_config()
    g, _, _ = random_arrays(cfg)
    w = CheckpointWriter(tmp_path / "ck", cfg)
    w.write_globals(g)
    with pytest.raises(CheckpointError, match="not a complete"):
        CheckpointReader(w.tmp)
    w.abort()


def test_existing_destination_needs_overwrite(tmp_path):
    cfg = tiny_config()
    _write(cfg, tmp_path / "ck", seed=0)
    with pytest.raises(FileExistsError, match="overwrite"):
        CheckpointWriter(tmp_path / "ck", cfg)
    _, _, experts = _write(cfg, tmp_path / "ck", seed=1, overwrite=True)
    got = CheckpointReader(tmp_path / "ck").read_expert(1, 3, "w1")
    np.testing.assert_array_equal(got, experts["w1"][1, 3])


def test_wrong_shapes_are_named(tmp_path):
    cfg = tiny_config()
    g, _, _ = random_arrays(cfg)
    with CheckpointWriter(tmp_path / "ck", cfg) as w:
        with pytest.raises(CheckpointError, match="layer 0 expert 1 w2"):
            w.write_expert(0, 1, "w2", np.ones((3, 3), np.float32))
        with pytest.raises(CheckpointError, match="embed"):
            w.write_globals({**g, "embed": g["embed"][:5]})
        w.abort()


def _set_meta(path, **changes):
    config = path / "config.json"
    meta = json.loads(config.read_text())
    meta.update(changes)
    config.write_text(json.dumps(meta))


def test_format_version_1_loads_float_experts_and_refuses_int4(tmp_path):
    """Version 1 differs only in the int4 expert layout (group half-split bytes)."""
    cfg = tiny_config()
    _write(cfg, tmp_path / "ck")
    _set_meta(tmp_path / "ck", format_version=1)
    assert CheckpointReader(tmp_path / "ck").config == cfg
    _set_meta(tmp_path / "ck", quantization={"dense": "none", "experts": "int4-g128"})
    with pytest.raises(CheckpointError, match="re-run `strata quantize`"):
        CheckpointReader(tmp_path / "ck")
    _set_meta(tmp_path / "ck", format_version=7)
    with pytest.raises(CheckpointError, match="version 7"):
        CheckpointReader(tmp_path / "ck")


# --- errors that name the file and the key ------------------------------------------------------


@pytest.mark.parametrize("name", ["config.json", "manifest.json"])
@pytest.mark.parametrize("text, why", [
    ('{"format": "strata",', r"not valid JSON \(Expecting .* at line 1 column \d+\)"),
    ("[1, 2]", r"expected a JSON object \{\.\.\.\}, got list"),
    ("\udcff", "not a UTF-8 text file"),
])  # fmt: skip
def test_broken_json_names_the_file(tmp_path, name, text, why):
    _write(tiny_config(), tmp_path / "ck")
    (tmp_path / "ck" / name).write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(CheckpointError, match=rf"{tmp_path / 'ck' / name}: {why}; re-create"):
        CheckpointReader(tmp_path / "ck")


@pytest.mark.parametrize("name, key", [
    ("manifest.json", "expert_chunks"),
    ("manifest.json", "format_version"),
    ("config.json", "model"),
    ("config.json", "format"),
])  # fmt: skip
def test_missing_key_names_the_file_and_the_key(tmp_path, name, key):
    _write(tiny_config(), tmp_path / "ck")
    path = tmp_path / "ck" / name
    doc = json.loads(path.read_text())
    doc.pop(key)
    path.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=rf"{path}: missing key '{key}'; re-create"):
        CheckpointReader(tmp_path / "ck")


def test_wrong_or_missing_model_fields_name_the_file(tmp_path):
    _write(tiny_config(), tmp_path / "ck")
    path = tmp_path / "ck" / "config.json"
    meta = json.loads(path.read_text())
    del meta["model"]["num_layers"]
    path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=rf"{path}: key 'model': missing ModelConfig "
                                              r"fields: \['num_layers'\]"):  # fmt: skip
        CheckpointReader(tmp_path / "ck")
    _set_meta(tmp_path / "ck", model="mixtral", format_version=2)
    with pytest.raises(CheckpointError, match=rf"{path}: key 'model' should be dict, got str"):
        CheckpointReader(tmp_path / "ck")
    _set_meta(tmp_path / "ck", format_version="2")
    with pytest.raises(CheckpointError, match=r"key 'format_version' should be int, got str"):
        CheckpointReader(tmp_path / "ck")


def test_checkpoints_readme_matches_what_the_writer_stores():
    """checkpoints/README.md: the version, and each expert array's name, dtype and shape."""
    text = (Path(__file__).resolve().parents[2] / "checkpoints" / "README.md").read_text()
    assert text.startswith(f"# The Strata checkpoint format (version {FORMAT_VERSION})")
    cfg = tiny_config(hidden_size=128, expert_intermediate_size=256)
    dims = {"L": cfg.num_layers, "E": cfg.num_experts, "D": 128, "F": 256}
    rows = re.findall(r"^\| (`[\w`, ]+`) \| (\w+) \| \[([\w/, ]+)\] \|", text, re.M)
    documented = {
        name: (dtype, tuple(eval(dim, {}, dims) for dim in shape.split(", ")))
        for names, dtype, shape in rows for name in re.findall(r"`(\w+)`", names)
    }  # fmt: skip
    int4 = {"dense": "none", "experts": "int4-g128"}
    for kind, (shape, dtype) in expert_arrays(cfg, int4).items():
        assert documented[kind] == (dtype, (cfg.num_layers, cfg.num_experts, *shape)), kind
    assert documented["w1"][0] == "uint8" and len(expert_arrays(cfg, int4)) == 6
