"""`strata synth` / `quantize` / `eval quant` as a user types them: relative paths, refused
destinations (exit 2, one line on stderr, nothing touched), broken checkpoint files named.

`strata convert hf` gets the same checks in tests/tools/test_hf_convert.py (it needs transformers).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

import strata_jax
from strata_jax.formats.checkpoint import CheckpointReader
from strata_runtime.cli.main import main
from tests.helpers import tiny_config, write_checkpoint

CFG = tiny_config("mixtral", hidden_size=128, expert_intermediate_size=128, head_dim=32,
                  num_experts=4)  # fmt: skip


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli_writers") / "float"
    write_checkpoint(CFG, path, seed=1)
    return path


def one_error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith(f"strata {command}: error: ") and err.count("\n") == 1, err
    return err


def listing(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_synth_writes_and_overwrites_a_relative_destination(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["synth", "--shape", "tiny", "--layers", "1", "--dtype", "float32", "out/rel"]
    assert main(args) == 0
    first = CheckpointReader(tmp_path / "out" / "rel").read_expert(0, 0, "w1")
    assert main([*args[:-1], "--seed", "1", "--overwrite", "out/rel"]) == 0
    second = CheckpointReader(tmp_path / "out" / "rel").read_expert(0, 0, "w1")
    assert not np.array_equal(first, second)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["rel"]


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_synth_refuses_a_file_or_a_foreign_folder(tmp_path, capsys, overwrite):
    (tmp_path / "model.bin").write_bytes(b"not yours")
    photos = tmp_path / "photos"
    photos.mkdir()
    (photos / "cat.jpg").write_bytes(b"meow")
    before = listing(tmp_path)
    synth = ["synth", "--shape", "tiny", "--layers", "1", *overwrite]
    assert main([*synth, str(tmp_path / "model.bin")]) == 2
    assert f"{tmp_path / 'model.bin'} is a file, not a folder" in one_error_line(capsys, "synth")
    assert main([*synth, str(photos)]) == 2
    err = one_error_line(capsys, "synth")
    if overwrite:
        assert f"refusing to overwrite {photos}" in err and "no config.json" in err
    else:
        assert f"{photos} already exists; pass --overwrite" in err
    assert listing(tmp_path) == before and (photos / "cat.jpg").read_bytes() == b"meow"


def test_quantize_with_relative_paths(src, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rel_src = os.path.relpath(src, tmp_path)
    assert not Path(rel_src).is_absolute()
    assert main(["quantize", rel_src, "q", "--experts", "int4-rtn"]) == 0
    assert strata_jax.load(tmp_path / "q").config == CFG
    report = json.loads((tmp_path / "q" / "quantize_report.json").read_text())
    assert report["src"] == str(src) and report["dst"] == str(tmp_path / "q")


@pytest.mark.parametrize("where, why", [
    (".", "is the source itself"),
    ("inner", "lies inside the source"),
    ("..", "contains the source"),
])  # fmt: skip
def test_quantize_refuses_to_write_over_its_source(src, capsys, where, why):
    before = listing(src.parent)
    assert main(["quantize", str(src), str(src / where), "--overwrite"]) == 2
    assert why in one_error_line(capsys, "quantize")
    assert listing(src.parent) == before


def test_quantize_checks_the_destination_before_any_work(src, tmp_path, capsys):
    """The destination is refused before the calibration file is even looked for."""
    (tmp_path / "out").write_text("a file")
    args = ["quantize", str(src), str(tmp_path / "out"), "--calib", str(tmp_path / "no.npy")]
    assert main(args) == 2
    assert "is a file, not a folder" in one_error_line(capsys, "quantize")
    assert main([*args[:2], str(tmp_path / "fresh"), *args[3:]]) == 2
    assert "calibration file" in one_error_line(capsys, "quantize")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("name", ["config.json", "manifest.json"])
def test_broken_checkpoint_files_are_named_by_quantize_and_eval(src, tmp_path, capsys, name):
    broken = tmp_path / "broken"
    write_checkpoint(CFG, broken, seed=1)
    (broken / name).write_text('{"format": "strata", oops}')
    assert main(["quantize", str(broken), str(tmp_path / "q")]) == 2
    err = one_error_line(capsys, "quantize")
    assert f"{broken / name}: not valid JSON" in err and "line 1 column 22" in err
    assert main(["eval", "quant", str(broken), "--ref", str(src)]) == 2
    assert f"{broken / name}: not valid JSON" in one_error_line(capsys, "eval")
    assert not (tmp_path / "q").exists()


def test_manifest_missing_a_key_is_named(src, tmp_path, capsys):
    broken = tmp_path / "broken"
    write_checkpoint(CFG, broken, seed=1)
    (broken / "manifest.json").write_text(json.dumps({"format_version": 2}))
    assert main(["quantize", str(broken), str(tmp_path / "q")]) == 2
    err = one_error_line(capsys, "quantize")
    assert f"{broken / 'manifest.json'}: missing key 'expert_chunks'" in err


def test_quantize_prints_calibration_warnings_as_lines(src, tmp_path, capsys):
    """Too little calibration for GPTQ: one warning line per layer, then the report."""
    calib = tmp_path / "calib.json"
    calib.write_text(json.dumps([[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11]]))
    args = ["quantize", str(src), str(tmp_path / "q"), "--calib", str(calib), "--mix-random", "0"]
    assert main(args) == 0
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert [line.split(":")[:3] for line in lines] == [
        ["strata quantize", " warning", " layer 0"], ["strata quantize", " warning", " layer 1"]
    ]
    assert all("4 of 4 experts got fewer routed calibration tokens than GPTQ needs (256" in line
               for line in lines)  # fmt: skip
    assert "RTN fallback for 8 experts" in captured.out
