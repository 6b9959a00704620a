"""Write requirements-cuda12.txt: the wheels the GPU install adds to the lock (jax's CUDA 12
plugin and the NVIDIA libraries it needs), each at the version pip resolves against the lock's
pins. `make lock` runs it after writing requirements.txt.

    pip install --dry-run --ignore-installed --report REPORT -c requirements.txt 'jax[cuda12]'
    python tools/lock_cuda12.py REPORT > requirements-cuda12.txt
"""

from __future__ import annotations

import datetime
import json
import re
import sys


def _name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def main() -> None:
    with open("requirements.txt") as f:
        locked = {_name(line.split("==")[0]) for line in f if "==" in line}
    with open(sys.argv[1]) as f:
        wanted = [i["metadata"] for i in json.load(f)["install"]]
    print("# The GPU install's lock: what jax[cuda12] adds to requirements.txt, resolved against")
    print(f"# its pins on {datetime.date.today()} (Linux x86_64). Regenerate: make lock.")
    for m in sorted(wanted, key=lambda m: _name(m["name"])):
        if _name(m["name"]) not in locked:
            print(f"{m['name']}=={m['version']}")


if __name__ == "__main__":
    main()
