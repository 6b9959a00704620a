"""Write the locks: requirements.txt (every run and test dependency of the package and its build
backend, setuptools, for Python 3.11 on a CPU) and requirements-cuda12.txt (what the GPU install
adds: jax's CUDA 12 plugin and the NVIDIA wheels, resolved against requirements.txt's pins).
`make lock` runs it with the venv's pinned pip. pip resolves the newest releases of the day in
dry runs (`--report`) and installs nothing: review the diff, then `make test`.

    python tools/lock.py [--out DIR]    # default: the repository root
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


def _name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def resolve(*args: str) -> list[tuple[str, str]]:
    """(name, version) of everything `pip install ARGS` would install into an empty venv."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--dry-run",
                        "--ignore-installed", "--report", str(report), *args],
                       cwd=ROOT, check=True)
        items = [i["metadata"] for i in json.loads(report.read_text())["install"]]
    return sorted(((m["name"], m["version"]) for m in items if _name(m["name"]) != PROJECT),
                  key=lambda nv: _name(nv[0]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT)
    out = ap.parse_args().out
    today = datetime.date.today()
    cpu = resolve("setuptools", "-e", ".[test]")
    (out / "requirements.txt").write_text(
        "# The lock: every run and test dependency and the build backend (setuptools) as a\n"
        f"# fresh resolution gave it on {today} (Python 3.11, CPU). Regenerate: make lock.\n"
        + "".join(f"{n}=={v}\n" for n, v in cpu))
    locked = {_name(n) for n, _ in cpu}
    gpu = resolve("-c", str(out / "requirements.txt"), "jax[cuda12]")
    (out / "requirements-cuda12.txt").write_text(
        "# The GPU install's lock: what jax[cuda12] adds to requirements.txt, resolved against\n"
        f"# its pins on {today} (Linux x86_64). Regenerate: make lock.\n"
        + "".join(f"{n}=={v}\n" for n, v in gpu if _name(n) not in locked))


if __name__ == "__main__":
    main()
