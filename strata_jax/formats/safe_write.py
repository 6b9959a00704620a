"""Safe folder writes: refuse unsafe destinations up front, write aside, swap at the end.

Every checkpoint writer goes through this module (via `checkpoint.check_destination` before
any work and `checkpoint.CheckpointWriter` for the write itself):

    DST.partial-<pid>/   the new folder while it is being written (removed on any failure)
    DST.old-<pid>/       the replaced folder, only between the two renames of the swap

`commit` renames DST aside, renames the complete partial folder to DST, then deletes the old
one, so DST is always either the old folder or the complete new one. What a killed process
leaves behind (its pid is no longer alive) is cleaned at the start of the next write to DST.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

PARTIAL, ASIDE = ".partial-", ".old-"

# why `path` (an existing, non-empty folder) may not be replaced; None if it may be
Replaceable = Callable[[Path], str | None]
PathLike = str | os.PathLike


class DestinationError(ValueError):
    """A destination that must not be written: a file, a source, a folder that is not ours."""


def absolute(path: PathLike) -> Path:
    """`path` made absolute, `~`, `..` and symlinks resolved (orbax needs absolute paths)."""
    return Path(path).expanduser().resolve()


def prepare_destination(
    dst: PathLike,
    *,
    overwrite: bool,
    replaceable: Replaceable,
    sources: Iterable[PathLike] = (),
) -> Path:
    """The absolute destination, once stale leftovers are cleaned and it is known to be safe.

    Refuses (DestinationError) a destination that is, contains or lies inside one of `sources`,
    that is not a folder, or that `replaceable` rejects; without `overwrite` an existing
    destination raises FileExistsError.
    """
    dst = absolute(dst)
    _check_sources(dst, sources)
    _check_parent(dst)
    recover(dst)
    check_target(dst, overwrite, replaceable)
    return dst


def _check_sources(dst: Path, sources: Iterable[PathLike]) -> None:
    for src in map(absolute, sources):
        if dst == src:
            why = "is the source itself"
        elif dst.is_relative_to(src):
            why = f"lies inside the source {src}"
        elif src.is_relative_to(dst):
            why = f"contains the source {src}"
        else:
            continue
        raise DestinationError(f"destination {dst} {why}; write to a path outside the source")


def _check_parent(dst: Path) -> None:
    """The nearest existing ancestor must be a folder we may write in."""
    parent = dst.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise DestinationError(f"destination {dst}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise DestinationError(f"destination {dst}: no permission to write in {parent}")


def check_target(dst: Path, overwrite: bool, replaceable: Replaceable) -> None:
    """Refuse an existing `dst` unless `overwrite` and it is empty or `replaceable` accepts it."""
    if not dst.exists():
        return
    if not dst.is_dir():
        raise DestinationError(
            f"destination {dst} is a file, not a folder; remove it or choose another path")
    if not overwrite:
        raise FileExistsError(f"{dst} already exists; pass --overwrite to replace it")
    if not any(dst.iterdir()):
        return
    why = replaceable(dst)
    if why is not None:
        raise DestinationError(
            f"refusing to overwrite {dst}: --overwrite replaces only a Strata checkpoint or an "
            f"empty folder, and this is neither ({why}); remove it yourself or choose another path"
        )


def _leftovers(dst: Path) -> Iterator[tuple[Path, str]]:
    """(path, PARTIAL or ASIDE) of the folders beside `dst` left by processes now dead."""
    if not dst.parent.is_dir():
        return
    for path in dst.parent.iterdir():
        for mark in (PARTIAL, ASIDE):
            prefix = dst.name + mark
            pid = path.name[len(prefix):]
            if path.name.startswith(prefix) and pid.isdigit() and not _pid_alive(int(pid)):
                yield path, mark


def recover(dst: Path) -> None:
    """Clean what crashed writers of `dst` left: partial folders are deleted; an old folder
    moved aside is put back if the swap never completed (DST missing), else deleted."""
    for path, mark in sorted(_leftovers(dst)):
        if mark == ASIDE and not dst.exists():
            os.rename(path, dst)
        else:
            shutil.rmtree(path, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def _fsync_dir(path: Path) -> None:
    """Make renames in `path` durable (best effort: not every filesystem allows it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class SafeWrite:
    """A folder written in `tmp` (beside `dst`) and swapped into `dst` by `commit`.

    Use as a context manager: leaving the block by an exception removes `tmp` and leaves `dst`
    as it was.
    """

    def __init__(
        self,
        dst: PathLike,
        *,
        overwrite: bool,
        replaceable: Replaceable,
        sources: Iterable[PathLike] = (),
    ) -> None:
        self.dst = prepare_destination(
            dst, overwrite=overwrite, replaceable=replaceable, sources=sources)
        self._overwrite, self._replaceable = overwrite, replaceable
        self.tmp = self.dst.with_name(f"{self.dst.name}{PARTIAL}{os.getpid()}")
        shutil.rmtree(self.tmp, ignore_errors=True)  # this process's own earlier failure
        self._made = [p for p in self.tmp.parents if not p.exists()]  # folders we create
        self.tmp.mkdir(parents=True)

    def __enter__(self) -> SafeWrite:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()

    def abort(self) -> None:
        """Remove `tmp` and the parent folders created for it (if still empty)."""
        shutil.rmtree(self.tmp, ignore_errors=True)
        for folder in self._made:
            try:
                folder.rmdir()
            except OSError:  # no longer empty (or already gone): keep it
                break

    def commit(self) -> Path:
        """Swap the complete `tmp` into `dst`; on failure `tmp` is removed, `dst` kept."""
        try:
            # whatever appeared at dst during the write is checked again before it is replaced
            check_target(self.dst, self._overwrite, self._replaceable)
            self._swap()
        except BaseException:
            self.abort()
            raise
        return self.dst

    def _swap(self) -> None:
        aside = None
        if self.dst.exists():
            aside = self.dst.with_name(f"{self.dst.name}{ASIDE}{os.getpid()}")
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(self.dst, aside)
        try:
            os.rename(self.tmp, self.dst)
        except BaseException:
            if aside is not None:
                os.rename(aside, self.dst)
            raise
        _fsync_dir(self.dst.parent)
        if aside is not None:
            # should this fail, it is a leftover that the next write to dst cleans
            shutil.rmtree(aside, ignore_errors=True)
