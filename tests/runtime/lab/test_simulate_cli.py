"""`strata trace synth`, `strata trace stats` and `strata simulate`: files, tables, errors."""

import dataclasses

import numpy as np
import pytest

from strata_jax.tools.synth import SHAPES
from strata_runtime.cli.main import main
from strata_runtime.engine.trace import load_trace, save_trace, synthetic_trace

SYNTH = ["--layers", "2", "--experts", "16", "--top-k", "2", "--steps", "40", "--rows", "4",
         "--skew", "1.2"]


@pytest.fixture
def trace_file(tmp_path, capsys):
    path = tmp_path / "skew.npz"
    assert main(["trace", "synth", str(path), *SYNTH, "--seed", "3", "--drift-at", "20"]) == 0
    assert f"wrote {path}: 40 steps of 4 rows" in capsys.readouterr().out
    return path


def test_synth_is_seeded(trace_file, tmp_path, capsys):
    again, other = tmp_path / "again.npz", tmp_path / "other.npz"
    assert main(["trace", "synth", str(again), *SYNTH, "--seed", "3", "--drift-at", "20"]) == 0
    assert main(["trace", "synth", str(other), *SYNTH, "--seed", "4", "--drift-at", "20"]) == 0
    a, b, c = (load_trace(p) for p in (trace_file, again, other))
    np.testing.assert_array_equal(a.experts, b.experts)
    assert not np.array_equal(a.experts, c.experts)
    assert a.seed == 3 and a.extra["synthetic"]["drift_at"] == 20


def test_stats_prints_the_tables(trace_file, capsys):
    assert main(["trace", "stats", str(trace_file)]) == 0
    out = capsys.readouterr().out
    assert "2 layers, 16 experts, top-2, seed 3" in out
    assert "| layer | distinct experts | entropy (bits) | top-8 share |" in out
    assert "| reuse distance | re-accesses |" in out


def _rows(out: str) -> dict[str, list[str]]:
    lines = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    return {cells[0]: cells[1:] for cells in
            ([c.strip() for c in line.strip("|").split("|")] for line in lines[1:])}


def test_simulate_prints_policies_beside_belady(trace_file, capsys):
    argv = ["simulate", str(trace_file), "--hardware", "rtx3090-pcie3-xeon-v4", "--shape",
            "tiny", "--pinned", "6", "--cache", "8", "--staging", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert ("| policy | hits | hit rate | Belady hit rate | perfect-prefetch bound | copies/step "
            "| predicted tok/s | binding | tok/s, perfect prefetch |") in out
    rows = _rows(out)
    assert list(rows) == ["static", "lru", "lfu", "lfru", "belady"]
    belady = float(rows["belady"][1])
    for name, cells in rows.items():
        assert float(cells[1]) <= belady and float(cells[2]) == belady, name
        assert float(cells[5]) > 0 and cells[6] in ("hbm", "compute", "pcie", "host-read")
    assert "6 pinned" in out and "8 cache slots" in out and "engine admission" in out
    assert "at best (Belady's cache, perfect prefetch):" in out
    assert "reported on rtx3090-pcie3-xeon-v4: the write-up: ~110 tok/s" in out
    assert main([*argv, "--miss", "auto"]) == 0  # its PCIe 3 link: the host takes misses
    rows = _rows(capsys.readouterr().out)
    assert float(rows["lru"][5]) > float(_rows(out)["lru"][5])

    assert main([*argv, "--policy", "lru", "--policy", "lfu", "--admission", "demand"]) == 0
    assert list(_rows(capsys.readouterr().out)) == ["lru", "lfu", "belady"]


def test_simulate_with_explicit_bytes(trace_file, capsys):
    assert main(["simulate", str(trace_file), "--hardware", "h200-pcie5", "--bytes-per-expert",
                 "117MB", "--dense-bytes", "2GB", "--hidden", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "117 MB per expert, 2 GB dense" in out and "in time 50%" in out
    assert "| pcie |" in out


def test_simulate_reads_the_model_from_a_recorded_trace(tmp_path, capsys):
    cfg = SHAPES["tiny"]
    path = tmp_path / "rec.npz"
    t = synthetic_trace(cfg.num_layers, cfg.num_experts, cfg.top_k, 20, 2, 1.0, seed=1)
    save_trace(path, dataclasses.replace(t, extra={"model_config": cfg.to_dict(),
                                                     "bytes_per_expert": 55_000}))
    assert main(["simulate", str(path), "--hardware", "rtx4090-pcie4", "--policy", "lru"]) == 0
    assert "0.055 MB per expert" in capsys.readouterr().out


@pytest.mark.parametrize("extra, message", [
    ([], "needs the model's bytes: give --shape NAME"),
    (["--shape", "mixtral-8x7b"], "the model has 8 experts, top-2; the trace 16, top-2"),
])
def test_simulate_refusals(trace_file, capsys, extra, message):
    assert main(["simulate", str(trace_file), "--hardware", "h200-pcie5", *extra]) == 2
    assert message in capsys.readouterr().err


def test_bad_trace_files_name_the_path(tmp_path, capsys):
    bad = tmp_path / "bad.npz"
    bad.write_text("no trace here")
    assert main(["trace", "stats", str(bad)]) == 2
    assert f"{bad} is not a routing trace" in capsys.readouterr().err
    assert main(["simulate", str(tmp_path / "missing.npz"), "--hardware", "h200-pcie5"]) == 2
    assert "missing.npz" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["simulate", str(bad), "--hardware", "a100"])
    assert "invalid choice: 'a100'" in capsys.readouterr().err
