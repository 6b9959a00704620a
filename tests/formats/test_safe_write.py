"""Safe writes: refusals before any work, write aside and swap, crash leftovers cleaned.

The first half drives `safe_write` directly with a marker-file rule for what may be replaced;
the second half runs the real `CheckpointWriter` on tiny checkpoints.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import strata_jax
from strata_jax.formats.checkpoint import CheckpointReader, CheckpointWriter
from strata_jax.formats.safe_write import DestinationError, SafeWrite, prepare_destination
from tests.helpers import random_arrays, tiny_config, write_checkpoint

MARK = "ours.txt"


def ours(path: Path) -> str | None:
    """The replaceable rule of these tests: a folder holding MARK."""
    return None if (path / MARK).is_file() else f"no {MARK}"


def make(path: Path, text: str, *, mark: bool = True) -> Path:
    path.mkdir(parents=True)
    (path / "data.txt").write_text(text)
    if mark:
        (path / MARK).write_text("")
    return path


def write(dst: Path, text: str, **kw) -> Path:
    with SafeWrite(dst, replaceable=ours, **kw) as w:
        (w.tmp / "data.txt").write_text(text)
        (w.tmp / MARK).write_text("")
        return w.commit()


def dead_pid() -> int:
    """The pid of a process that has exited."""
    out = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                         capture_output=True, text=True, check=True)  # fmt: skip
    return int(out.stdout)


def siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir())


# ------------------------------------------------------------------------------- safe_write


def test_relative_destination_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    got = write(Path("sub") / ".." / "rel", "new", overwrite=False)
    assert got == tmp_path / "rel" and got.is_absolute()
    assert (tmp_path / "rel" / "data.txt").read_text() == "new"


def test_overwrite_swaps_in_the_new_folder_and_removes_the_old(tmp_path):
    dst = make(tmp_path / "dst", "old")
    write(dst, "new", overwrite=True)
    assert (dst / "data.txt").read_text() == "new"
    assert siblings(dst) == ["dst"]


def test_failure_mid_write_keeps_the_old_folder_and_removes_the_partial(tmp_path):
    dst = make(tmp_path / "dst", "old")
    with pytest.raises(RuntimeError, match="boom"):
        with SafeWrite(dst, overwrite=True, replaceable=ours) as w:
            (w.tmp / "data.txt").write_text("half")
            raise RuntimeError("boom")
    assert (dst / "data.txt").read_text() == "old"
    assert siblings(dst) == ["dst"]


def test_the_old_folder_stays_until_the_swap(tmp_path):
    dst = make(tmp_path / "dst", "old")
    with SafeWrite(dst, overwrite=True, replaceable=ours) as w:
        (w.tmp / "data.txt").write_text("new")
        (w.tmp / MARK).write_text("")
        assert (dst / "data.txt").read_text() == "old"
        assert w.tmp.parent == dst.parent and w.tmp.name == f"dst.partial-{os.getpid()}"
        w.commit()
    assert (dst / "data.txt").read_text() == "new"


def test_existing_destination_needs_overwrite(tmp_path):
    dst = make(tmp_path / "dst", "old")
    with pytest.raises(FileExistsError, match=rf"{dst} already exists; pass --overwrite"):
        SafeWrite(dst, overwrite=False, replaceable=ours)
    assert siblings(dst) == ["dst"]


def test_overwrite_refuses_a_folder_that_is_not_ours(tmp_path):
    dst = make(tmp_path / "photos", "precious", mark=False)
    with pytest.raises(DestinationError, match=rf"refusing to overwrite {dst}.*no {MARK}"):
        SafeWrite(dst, overwrite=True, replaceable=ours)
    assert (dst / "data.txt").read_text() == "precious"
    assert siblings(dst) == ["photos"]


def test_overwrite_takes_an_empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    write(tmp_path / "empty", "new", overwrite=True)
    assert (tmp_path / "empty" / "data.txt").read_text() == "new"


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_file_destination_is_refused(tmp_path, overwrite):
    dst = tmp_path / "file.bin"
    dst.write_bytes(b"keep")
    with pytest.raises(DestinationError, match=rf"{dst} is a file, not a folder"):
        SafeWrite(dst, overwrite=overwrite, replaceable=ours)
    assert dst.read_bytes() == b"keep" and siblings(dst) == ["file.bin"]


def test_a_destination_under_a_file_is_refused(tmp_path):
    (tmp_path / "file.bin").write_bytes(b"keep")
    with pytest.raises(DestinationError, match=r"file\.bin is a file, not a folder"):
        SafeWrite(tmp_path / "file.bin" / "sub" / "dst", overwrite=False, replaceable=ours)


@pytest.mark.parametrize("where, why", [
    (".", "is the source itself"),
    ("inner/dst", "lies inside the source"),
    ("..", "contains the source"),
])  # fmt: skip
def test_a_destination_overlapping_the_source_is_refused(tmp_path, where, why):
    src = make(tmp_path / "outer" / "src", "source")
    for overwrite in (False, True):
        with pytest.raises(DestinationError, match=why):
            prepare_destination(src / where, overwrite=overwrite, replaceable=ours,
                                sources=[src])  # fmt: skip
    assert sorted(p.name for p in src.iterdir()) == sorted(["data.txt", MARK])
    assert siblings(src) == ["src"]


def test_sources_are_compared_resolved(tmp_path, monkeypatch):
    src = make(tmp_path / "src", "source")
    (tmp_path / "link").symlink_to(src)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DestinationError, match="is the source itself"):
        prepare_destination("link", overwrite=True, replaceable=ours, sources=["./src"])


def test_stale_partial_of_a_dead_writer_is_cleaned_and_a_live_ones_kept(tmp_path):
    dst = tmp_path / "dst"
    stale = make(tmp_path / f"dst.partial-{dead_pid()}", "half")
    live = make(tmp_path / f"dst.partial-{os.getppid()}", "someone else's")
    other = make(tmp_path / "dstx.partial-1", "another destination's")
    write(dst, "new", overwrite=False)
    assert not stale.exists() and live.exists() and other.exists()
    assert (dst / "data.txt").read_text() == "new"


def test_old_folder_of_an_interrupted_swap_is_restored(tmp_path):
    """Killed between its two renames, a writer leaves DST missing and the old one aside."""
    pid = dead_pid()
    aside = make(tmp_path / f"dst.old-{pid}", "old")
    make(tmp_path / f"dst.partial-{pid}", "new, complete")
    got = prepare_destination(tmp_path / "dst", overwrite=True, replaceable=ours)
    assert (got / "data.txt").read_text() == "old"
    assert not aside.exists() and siblings(got) == ["dst"]


def test_old_folder_left_after_a_completed_swap_is_deleted(tmp_path):
    dst = make(tmp_path / "dst", "new")
    make(tmp_path / f"dst.old-{dead_pid()}", "old")
    prepare_destination(dst, overwrite=True, replaceable=ours)
    assert (dst / "data.txt").read_text() == "new" and siblings(dst) == ["dst"]


def test_what_appears_at_the_destination_during_the_write_is_not_replaced(tmp_path):
    dst = tmp_path / "dst"
    with SafeWrite(dst, overwrite=True, replaceable=ours) as w:
        (w.tmp / "data.txt").write_text("new")
        make(dst, "written meanwhile by someone else", mark=False)
        with pytest.raises(DestinationError, match="refusing to overwrite"):
            w.commit()
    assert (dst / "data.txt").read_text() == "written meanwhile by someone else"
    assert siblings(dst) == ["dst"]


# ------------------------------------------------------------------------ CheckpointWriter


def _expert(path: Path, kind: str = "w1") -> np.ndarray:
    return CheckpointReader(path).read_expert(1, 3, kind)


def test_writer_overwrites_a_checkpoint_with_a_relative_path(tmp_path, monkeypatch):
    cfg = tiny_config()
    monkeypatch.chdir(tmp_path)
    write_checkpoint(cfg, "ck", seed=0)
    _, _, experts = write_checkpoint(cfg, Path("ck"), seed=1, overwrite=True)
    np.testing.assert_array_equal(_expert(tmp_path / "ck"), experts["w1"][1, 3])
    assert siblings(tmp_path / "ck") == ["ck"]


def test_writer_refuses_to_overwrite_a_folder_that_is_not_a_checkpoint(tmp_path):
    cfg = tiny_config()
    dst = tmp_path / "notes"
    dst.mkdir()
    (dst / "config.json").write_text("{}")  # a config alone is not a checkpoint
    with pytest.raises(DestinationError, match=r"refusing to overwrite .*no manifest\.json"):
        CheckpointWriter(dst, cfg, overwrite=True)
    (dst / "manifest.json").write_text("{}")
    with pytest.raises(DestinationError, match=r"format None, not 'strata'"):
        CheckpointWriter(dst, cfg, overwrite=True)
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "manifest.json"]
    assert siblings(dst) == ["notes"]


def test_failed_overwrite_leaves_the_old_checkpoint_loadable(tmp_path):
    cfg = tiny_config()
    _, _, old = write_checkpoint(cfg, tmp_path / "ck", seed=0)
    g, layers, _ = random_arrays(cfg, seed=1)
    with pytest.raises(RuntimeError, match="incomplete"):
        with CheckpointWriter(tmp_path / "ck", cfg, overwrite=True) as w:
            w.write_globals(g)
            w.write_layer_dense(0, {k: v[0] for k, v in layers.items()})
            w.commit()
    np.testing.assert_array_equal(_expert(tmp_path / "ck"), old["w1"][1, 3])
    assert siblings(tmp_path / "ck") == ["ck"]


_CRASH = """
import os, sys
from tests.helpers import random_arrays, tiny_config
from strata_jax.formats.checkpoint import CheckpointWriter
cfg = tiny_config()
g, layers, experts = random_arrays(cfg, seed=1)
w = CheckpointWriter(sys.argv[1], cfg, overwrite=True)
w.write_globals(g)
w.write_layer_dense(0, {k: v[0] for k, v in layers.items()})
w.write_expert(0, 0, "w1", experts["w1"][0, 0]).result()
os._exit(9)  # dies like a killed process: no cleanup runs
"""


def test_crashed_overwrite_keeps_the_old_checkpoint_and_the_next_write_cleans_up(tmp_path):
    cfg = tiny_config()
    _, _, old = write_checkpoint(cfg, tmp_path / "ck", seed=0)
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-c", _CRASH, str(tmp_path / "ck")], cwd=root,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 9, err
    assert siblings(tmp_path / "ck") == ["ck", f"ck.partial-{proc.pid}"]
    np.testing.assert_array_equal(_expert(tmp_path / "ck"), old["w1"][1, 3])
    assert strata_jax.load(tmp_path / "ck").config == cfg
    _, _, new = write_checkpoint(cfg, tmp_path / "ck", seed=2, overwrite=True)
    np.testing.assert_array_equal(_expert(tmp_path / "ck"), new["w1"][1, 3])
    assert siblings(tmp_path / "ck") == ["ck"]


def test_failed_write_removes_the_parent_folders_it_created(tmp_path):
    (tmp_path / "a").mkdir()
    with pytest.raises(RuntimeError, match="boom"):
        with SafeWrite(tmp_path / "a" / "b" / "c" / "dst", overwrite=False, replaceable=ours):
            raise RuntimeError("boom")
    assert [p.name for p in tmp_path.iterdir()] == ["a"] and not any((tmp_path / "a").iterdir())
