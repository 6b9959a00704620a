"""Where a number was measured: the device, jax, the host's cores and NUMA nodes, the PCIe link,
the git commit (`hardware_fingerprint`), carried by every row `strata bench` and `strata sweep`
write."""

from __future__ import annotations

import datetime
import os
import platform
import shutil
import subprocess
from pathlib import Path

import jax
import jaxlib

from strata_runtime.residency.link import link_rate

REPO = Path(__file__).resolve().parents[2]


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=20,
                             check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def numa_nodes(root: Path = Path("/sys/devices/system/node")) -> int | None:
    """NUMA nodes the kernel lists (None: no /sys/devices/system/node)."""
    if not root.is_dir():
        return None
    return sum(1 for p in root.glob("node[0-9]*") if p.is_dir())


def nvidia_smi() -> list[dict[str, str]] | None:
    """Per GPU: name, driver, PCIe generation (current, max) and width; None: no nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    fields = ("name", "driver_version", "pcie.link.gen.current", "pcie.link.gen.max",
              "pcie.link.width.current", "memory.total")
    text = _run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"])
    if text is None:
        return None
    return [dict(zip(fields, (c.strip() for c in line.split(",")), strict=False))
            for line in text.splitlines() if line.strip()]


def git_commit(repo: Path = REPO) -> dict[str, object] | None:
    """The checkout's HEAD and whether tracked files differ from it; None: not a git checkout."""
    head = _run(["git", "rev-parse", "HEAD"], cwd=repo)
    if head is None:
        return None
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo)
    return {"commit": head, "dirty": bool(status) if status is not None else None}


def _usable_cores() -> int | None:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count()


def hardware_fingerprint(link_gbps: float | None = None) -> dict[str, object]:
    """Where a number was measured: device, jax / jaxlib, host cores and NUMA nodes, the
    pinned host -> device rate (GPU only; `link_gbps` if already measured, else
    `engine.link_rate`), nvidia-smi's PCIe generation, the git commit, python."""
    dev = jax.devices()[0]
    gpu = dev.platform == "gpu"
    if gpu and link_gbps is None:
        link_gbps = max(link_rate(dev) for _ in range(3))
    smi = nvidia_smi() if gpu else None
    return {
        "gpu": dev.device_kind if gpu else "cpu",
        "device_kind": dev.device_kind,
        "platform": dev.platform,
        "devices": jax.device_count(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "host_cores": os.cpu_count(),
        "usable_cores": _usable_cores(),
        "numa_nodes": numa_nodes(),
        "pinned_h2d_gbps": link_gbps if gpu else None,
        "pcie_gen": smi[0].get("pcie.link.gen.current") if smi else None,
        "pcie_gen_max": smi[0].get("pcie.link.gen.max") if smi else None,
        "pcie_width": smi[0].get("pcie.link.width.current") if smi else None,
        "nvidia_smi": smi,
        "git": git_commit(),
        "python": platform.python_version(),
        "os": platform.platform(),
        "host": platform.node(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
