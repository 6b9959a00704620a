"""Write and check the locks, each resolved from the public Python package index alone:

- requirements.txt: what the package needs to run, and its build backend (setuptools), for
  Python 3.11 on a CPU; `make demo` installs this and nothing else.
- requirements-test.txt: what the test extras add to it (`make test` installs both).
- requirements-cuda12.txt: what the GPU install adds: jax's CUDA 12 plugin and the NVIDIA wheels,
  resolved against requirements.txt's pins.

pip runs `--isolated`, so that no local wheel folder, mirror or constraint file of the machine
that writes the lock can put a build in it that a user's fresh machine cannot get.

    python tools/lock.py [--out DIR]             # resolve at the newest releases (`make lock`)
    python tools/lock.py --keep [--out DIR]      # re-resolve, today's pins kept as constraints
    python tools/lock.py --check                 # every pin of every lock resolves (CI)

Resolving and checking are pip dry runs with `--report`: nothing is installed or downloaded
past the index's metadata. Review a new lock's diff, then `make test`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = "strata-jax"
LOCKS = ("requirements.txt", "requirements-test.txt", "requirements-cuda12.txt")


def _name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pip_dry_run(*args: str) -> list[dict]:
    """The `install` items of pip's report for `pip install ARGS` into an empty venv, public
    index only (`--isolated` ignores the machine's pip configuration and environment)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "--isolated", "--quiet",
                        "--dry-run", "--ignore-installed", "--report", str(report), *args],
                       cwd=ROOT, check=True)
        return json.loads(report.read_text())["install"]


def resolve(*args: str) -> list[tuple[str, str]]:
    """(name, version) of everything `pip install ARGS` would install, the project left out."""
    items = [i["metadata"] for i in _pip_dry_run(*args)]
    return sorted(((m["name"], m["version"]) for m in items if _name(m["name"]) != PROJECT),
                  key=lambda nv: _name(nv[0]))


def _write(path: Path, header: str, pins: list[tuple[str, str]]) -> None:
    path.write_text(header + "".join(f"{n}=={v}\n" for n, v in pins))


def write_locks(out: Path, keep: bool) -> None:
    today = datetime.date.today()
    constraints: list[str] = []
    if keep:  # today's pins as constraints, so that only what must move moves
        kept = Path(tempfile.mkstemp(suffix=".txt")[1])
        kept.write_text("".join((ROOT / f).read_text() for f in LOCKS[:2]))
        constraints = ["-c", str(kept)]
    run = resolve(*constraints, "setuptools", "-e", ".")
    _write(out / LOCKS[0],
           "# The run lock: what the package needs to run, and its build backend (setuptools),\n"
           f"# from the public index on {today} (Python 3.11, CPU). Regenerate: make lock.\n", run)
    locked = {_name(n) for n, _ in run}
    test = resolve(*constraints, "-c", str(out / LOCKS[0]), "setuptools", "-e", ".[test]")
    _write(out / LOCKS[1],
           "# The test lock: what the test extras add to requirements.txt, from the public index\n"
           f"# on {today} (Python 3.11, Linux x86_64). Regenerate: make lock.\n",
           [(n, v) for n, v in test if _name(n) not in locked])
    gpu = resolve("-c", str(out / LOCKS[0]), "jax[cuda12]")
    _write(out / LOCKS[2],
           "# The GPU install's lock: what jax[cuda12] adds to requirements.txt, resolved against\n"
           f"# its pins on {today} (Linux x86_64). Regenerate: make lock.\n",
           [(n, v) for n, v in gpu if _name(n) not in locked])


def check_locks(root: Path) -> None:
    """Each lock's pins, exactly as written, are found on the public index (no dependency
    resolution: `make demo` / `make test` install with --no-deps and then run `pip check`)."""
    for lock in LOCKS:
        pins = [line for line in (root / lock).read_text().splitlines()
                if line.strip() and not line.startswith("#")]
        found = _pip_dry_run("--no-deps", "-r", str(root / lock))
        if len(found) != len(pins):
            sys.exit(f"{lock}: {len(pins)} pins, but the public index serves {len(found)}")
        print(f"{lock}: all {len(pins)} pins on the public index")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT)
    ap.add_argument("--keep", action="store_true",
                    help="keep today's pins as constraints (move only what must move)")
    ap.add_argument("--check", action="store_true",
                    help="check that every lock resolves from the public index; write nothing")
    args = ap.parse_args()
    if args.check:
        check_locks(ROOT)
    else:
        write_locks(args.out, args.keep)


if __name__ == "__main__":
    main()
