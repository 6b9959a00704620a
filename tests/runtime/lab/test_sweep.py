"""`strata sweep`: the shipped tiny ladder on a CPU (a row per rung in sweep.jsonl, the table,
the plot), every rung checked before anything runs, grids, dry runs, failed rungs, resume."""

import json
from pathlib import Path

import pytest

from strata_runtime.cli.main import main
from strata_runtime.lab.cost_model import prediction_error, time_split
from strata_runtime.lab.sweep import SweepError, _progress, load_sweep
from strata_runtime.lab.sweep_report import _provenance

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "sweeps" / "tiny_ladder.toml"
SEED = ROOT / "sweeps" / "seed_ladder.toml"


KEEP_PROGRAMS = True  # the rungs share their compiled programs (tests/runtime/conftest.py)


@pytest.fixture(scope="module")
def ladder(tmp_path_factory):
    """The tiny ladder run once: its [synth] writes the checkpoint into the test's folder."""
    root = tmp_path_factory.mktemp("ladder")
    ckpt, out = root / "ck", root / "out"
    rc = main(["sweep", str(TINY), "--checkpoint", str(ckpt), "--out", str(out)])
    return rc, ckpt, out


def test_the_tiny_ladder_writes_a_row_per_rung_a_table_and_a_plot(ladder):
    rc, ckpt, out = ladder
    assert rc == 0
    sweep = load_sweep(TINY, checkpoint=str(ckpt))
    names = [r.name for r in sweep.rungs]
    rows = [json.loads(line) for line in (out / "sweep.jsonl").read_text().splitlines()]
    assert [r["rung"] for r in rows] == names
    for row in rows:
        assert "error" not in row, row.get("traceback")
        assert row["tok_s"]["lo"] <= row["tok_s"]["median"] <= row["tok_s"]["hi"]
        assert row["bound"]["binds"] in row["bound"]["seconds"]
        assert row["bound"]["bound_tok_s"] > 0 and row["predicted"]["tok_s"] > 0
        assert row["checkpoint"] == str(ckpt) and "fingerprint" in row
        assert len(row["repeat_rows"]) == row["settings"]["repeats"]
    by = {r["rung"]: r["config"] for r in rows}
    assert by["naive B=1"]["batch_capacity"] == 1 and by["naive B=1"]["policy"] == "static"
    hot = by["hot cache"]  # from = "prefetch", from = "batching B=8", from = "naive B=1"
    assert (hot["batch_capacity"], hot["predictor"], hot["policy"]) == (8, "next-gate", "lfru")
    assert rows[-1]["config"]["rebalance_every"] == 4
    assert sum(r["disk_loads"] for r in rows) > 0  # tier 1 holds half of the experts
    # each rung's ceilings are measured right before it (timed rates: no two alike), the
    # checkpoint's disk rates once for the sweep
    assert len({r["ceilings"]["hbm_read_gbps"] for r in rows}) == len(rows)
    disk = [r["ceilings"]["disk_read_gbps"][str(ckpt)] for r in rows if r["disk_loads"]]
    assert disk and all(d == disk[0] for d in disk)
    table = (out / "sweep.md").read_text()
    lines = [ln for ln in table.splitlines() if ln.startswith("| ")]
    assert len(lines) == 1 + len(names)  # the header and a line per rung
    assert all(f"| {n} |" in table for n in names)
    assert "1.00x" in lines[1]
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_rungs_log_line_holds_its_prediction_against_measured_and_its_kernel_rates(ladder):
    """The log is what comes back of a run cut short: each rung's line names its figures."""
    _, _, out = ladder
    for row in map(json.loads, (out / "sweep.jsonl").read_text().splitlines()):
        line, p = _progress(row), row["predicted"]
        measured = row[p["compare_with"]]
        assert (f"decode {measured:.4g} tok/s, predicted {p['tok_s']:.4g} ({p['binding']}, "
                f"{prediction_error(row):+.0%})") in line
        assert f"experts {row['expert_read_gbps']:.4g} GB/s" in line
        assert f"dense {row['dense_read_gbps']:.4g} GB/s" in line
        assert "not measured" not in line
    broken = {**row, "kernel_rate_errors": {"dense_read_gbps": "XlaRuntimeError: OOM"}}
    assert "(not measured: dense_read_gbps)" in _progress(broken)


def test_resume_keeps_the_rows_and_runs_nothing_more(ladder, capsys):
    rc, ckpt, out = ladder
    before = (out / "sweep.jsonl").read_text()
    assert main(["sweep", str(TINY), "--checkpoint", str(ckpt), "--out", str(out)]) == 2
    assert "--resume" in capsys.readouterr().err  # not overwritten by accident
    assert main(["sweep", str(TINY), "--checkpoint", str(ckpt), "--out", str(out),
                 "--resume"]) == 0
    assert (out / "sweep.jsonl").read_text() == before
    assert "nothing to run" in capsys.readouterr().err


def test_resume_runs_again_a_rung_whose_keys_changed(ladder, tmp_path, capsys):
    _, ckpt, _ = ladder
    out = tmp_path / "out"
    text = BASE.format(ckpt=ckpt) + 'repeats = 1\n[[rung]]\nname = "a"\n[[rung]]\nname = "b"\n'
    assert main(["sweep", str(write(tmp_path, text)), "--out", str(out)]) == 0
    changed = text.replace('name = "b"\n', 'name = "b"\nnew = 3\n')
    assert main(["sweep", str(write(tmp_path, changed)), "--out", str(out), "--resume"]) == 0
    assert "b: its keys changed" in capsys.readouterr().err
    rows = [json.loads(line) for line in (out / "sweep.jsonl").read_text().splitlines()]
    assert [(r["rung"], r["settings"]["new"]) for r in rows] == [("a", 4), ("b", 4), ("b", 3)]


def test_named_rungs_run_alone_and_the_rest_resume_later(ladder, tmp_path, capsys):
    _, ckpt, _ = ladder
    out = tmp_path / "out"
    sweep = write(tmp_path, BASE.format(ckpt=ckpt) + 'repeats = 1\n[[rung]]\nname = "a"\n'
                  '[[rung]]\nname = "b"\nfrom = "a"\nnew = 3\n')
    assert main(["sweep", str(sweep), "--out", str(out), "--rung", "zz"]) == 2
    assert "no rung named ['zz']" in capsys.readouterr().err
    assert main(["sweep", str(sweep), "--out", str(out), "--rung", "b"]) == 0
    assert main(["sweep", str(sweep), "--out", str(out), "--resume"]) == 0
    rows = [json.loads(line) for line in (out / "sweep.jsonl").read_text().splitlines()]
    assert [(r["rung"], r["settings"]["new"]) for r in rows] == [("b", 3), ("a", 4)]
    assert "[2/2] b: kept" in capsys.readouterr().err
    table = (out / "sweep.md").read_text()
    assert table.index("| a |") < table.index("| b |")  # the file's order


def test_rows_of_several_runs_are_named_in_the_table():
    def row(name, commit, gpu, date, dirty=False):
        return {"rung": name, "tok_s": {"median": 1.0},
                "fingerprint": {"gpu": gpu, "date": date,
                                "git": {"commit": commit, "dirty": dirty}}}
    same = [row("a", "c0ffee" * 4, "H200", "2026-12-05T07:28:30"),
            row("b", "c0ffee" * 4, "H200", "2026-12-05T07:28:59")]
    assert _provenance(same) == []
    mixed = [*same, row("c", "beef" * 6, "H100", "2026-12-05T15:15:00", dirty=True),
             {"rung": "d", "error": "x"}]
    (line, blank) = _provenance(mixed)
    assert blank == "" and "d:" not in line
    assert "a: c0ffeec0ffee on H200, 2026-12-05T07:28" in line
    assert "c: beefbeefbeef (dirty) on H100, 2026-12-05T15:15" in line


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "s.toml"
    path.write_text(text)
    return path


BASE = '[base]\ncheckpoint = "{ckpt}"\nmax_len = 32\nprompt_len = 4\nnew = 4\n'


@pytest.mark.parametrize(("rung", "named"), [
    ('predicter = "none"', ["'predicter'", "rung 'second'", "did you mean 'predictor'"]),
    ('policy = "lruu"', ["rung 'second'", "lruu"]),
    ('batch_capacity = "8"', ["rung 'second'", "batch_capacity", "expected int"]),
    ('hbm_budget = "8 parsecs"', ["rung 'second'", "hbm_budget"]),
    ('from = "later"', ["rung 'second'", "'later'"]),
])
def test_a_bad_key_is_named_with_its_rung_before_anything_runs(tmp_path, capsys, rung, named):
    path = write(tmp_path, BASE.format(ckpt=tmp_path / "none") + '[[rung]]\nname = "first"\n'
                 f'[[rung]]\nname = "second"\n{rung}\n')
    out = tmp_path / "out"
    assert main(["sweep", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    for text in named:
        assert text in err
    assert not out.exists()  # nothing ran, nothing was written
    with pytest.raises(SweepError):
        load_sweep(path)


def test_the_grid_is_the_product_and_a_dry_run_runs_nothing(tmp_path, capsys):
    path = write(tmp_path, BASE.format(ckpt=tmp_path / "ck")
                 + '[synth]\npath = "{}"\nshape = "tiny"\n'.format(tmp_path / "ck")
                 + '[grid]\nbatch_capacity = [1, 2]\npolicy = ["static", "lru", "lfu"]\n')
    sweep = load_sweep(path)
    got = [(r.name, r.config.batch_capacity, r.config.policy) for r in sweep.rungs]
    assert got == [(f"batch_capacity={b},policy={p}", b, p)
                   for b in (1, 2) for p in ("static", "lru", "lfu")]
    out = tmp_path / "out"
    assert main(["sweep", str(path), "--out", str(out), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("    engine: ") == 6 and "(not there yet)" in printed
    assert '"policy": "lfu"' in printed and '"max_len": 32' in printed
    assert not out.exists() and not (tmp_path / "ck").exists()  # no run, no synth


def test_a_failed_rung_leaves_a_row_and_the_others_run(tmp_path, capsys):
    path = write(tmp_path, BASE.format(ckpt=tmp_path / "none")
                 + '[[rung]]\nname = "a"\n[[rung]]\nname = "b"\nbatch_capacity = 2\n')
    out = tmp_path / "out"
    assert main(["sweep", str(path), "--out", str(out)]) == 1
    rows = [json.loads(line) for line in (out / "sweep.jsonl").read_text().splitlines()]
    assert [r["rung"] for r in rows] == ["a", "b"]
    assert all("no checkpoint" in r["error"] for r in rows)
    assert "no checkpoint" in (out / "sweep.md").read_text()


def test_the_shipped_ladders_resolve():
    seed = load_sweep(SEED)
    names = [r.name for r in seed.rungs]
    assert names[0].startswith("naive") and len(names) >= 7
    naive = seed.rungs[0].config
    assert (naive.batch_capacity, naive.policy, naive.cache_fraction, naive.predictor) == (
        1, "static", 0.0, "none")
    assert any(r.config.rebalance_every for r in seed.rungs)
    assert any(r.config.predictor == "next-gate" for r in seed.rungs)
    assert seed.synth is not None and seed.synth["path"] == seed.rungs[0].checkpoint


def _split_row(ms_engine: float, disk_ms: float) -> dict:
    return {"per_step": {"ms_engine": ms_engine, "ms_disk_stall": disk_ms, "h2d_GB": 2.0,
                         "hbm_GB": 5.0},
            "sizes": {"dense_bytes": 2.5e9, "kv_bytes": 0.5e9},
            "ceilings": {"pinned_h2d_gbps": 40.0, "host_read_gbps": 80.0,
                         "hbm_read_gbps": 2000.0},
            "expert_read_gbps": 1000.0, "dense_read_gbps": 1500.0}


def test_the_time_split_estimates_each_part_from_its_own_rate_and_caps_them():
    """Copies at the link (the slower of the pinned copy and the host read), the routed
    experts (HBM bytes beyond the dense and KV bytes) at the expert kernel's rate, the dense
    and KV bytes at the rate of the step without experts; the rest is what the measured time
    leaves, and no estimate outgrows the measured time."""
    split = time_split(_split_row(ms_engine=100.0, disk_ms=30.0))
    assert split["disk"] == 30.0
    assert split["copies"] == pytest.approx(1e3 * 2.0 / 40.0)  # 50 ms
    assert split["experts"] == pytest.approx(1e3 * 2.0 / 1000.0)  # 2 ms
    assert split["dense"] == pytest.approx(1e3 * 3.0 / 1500.0)  # 2 ms
    assert split["rest"] == pytest.approx(100.0 - 30 - 50 - 2 - 2)
    short = time_split(_split_row(ms_engine=60.0, disk_ms=30.0))  # copies alone would be 50
    assert (short["copies"], short["experts"], short["dense"], short["rest"]) == (30.0, 0, 0, 0)
    old = {**_split_row(100.0, 0.0), "dense_read_gbps": None}  # a row from before the rate
    assert time_split(old)["dense"] == pytest.approx(1e3 * 3.0 / 2000.0)
