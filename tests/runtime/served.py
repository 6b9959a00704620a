"""`python -m strata_runtime.cli.serve` started for a test, on a free local port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import httpx2
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(ckpt: Path, flags: list[str], log: IO[str], env: dict[str, str] | None = None
                 ) -> tuple[subprocess.Popen, str]:
    """The server of `ckpt` with `flags` (its output into `log`), once /health answers:
    (the process, its base URL). The test fails with the log if it does not start."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "strata_runtime.cli.serve", str(ckpt), "--port", str(port),
         "--no-warmup", "--log-level", "warning", *flags],
        stdout=log, stderr=subprocess.STDOUT,
        env=dict(os.environ, JAX_PLATFORMS="cpu", **(env or {})))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx2.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        except httpx2.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            log.seek(0)
            pytest.fail(f"the server did not start:\n{log.read()}")
        time.sleep(0.2)
