"""`strata generate` over two `jax.distributed` processes on localhost
(runtime/engine/processes.py):
two CLI processes of two CPU devices each run one offload engine over the 4 devices, half the
experts on disk. Process 0 prints and writes the tokens of the one-process resident run;
process 1 prints none; each writes its own timeline. Bad process flags are refused by name."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from strata_runtime.cli.main import main
from tests.ep_worker import xla_flags
from tests.helpers import tiny_config, write_checkpoint

ROOT = Path(__file__).resolve().parents[3]
PROMPTS = ["5,6,7", "1,2,3,4,5,6,7,8", "42"]
COMMON = ["--max-new-tokens", "6", "--batch-capacity", "4", "--max-len", "32", "--no-warmup",
          "--no-compile-cache", *[a for p in PROMPTS for a in ("--prompt-ids", p)]]
OFFLOAD = ["--hbm", "200KiB", "--host-mem", "100KiB", "--workspace", "64KiB", "--expert-devices",
           "4", "--cache-fraction", "0.5"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _strata(args: list[str], devices: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]), "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": xla_flags(devices)}
    return subprocess.Popen([sys.executable, "-m", "strata_runtime.cli", "generate", *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _done(proc: subprocess.Popen) -> tuple[str, str]:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return out, err


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli_processes")
    ckpt = tmp / "ck"
    write_checkpoint(tiny_config("qwen2_moe", num_experts=16), ckpt, seed=5)
    port = str(_free_port())
    flags = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
    procs = [_strata([str(ckpt), *COMMON, *OFFLOAD, *flags, "--process-id", str(pid),
                      "--json", str(tmp / "out.json"),
                      "--export-timeline", str(tmp / "timeline.json")], devices=2)
             for pid in (0, 1)]
    reference = _strata([str(ckpt), *COMMON, "--json", str(tmp / "resident.json")], devices=1)
    outputs = [_done(p) for p in procs]
    _done(reference)
    return tmp, outputs


def test_two_processes_give_the_resident_tokens_printed_once(runs):
    tmp, ((out0, _), (out1, err1)) = runs
    doc = json.loads((tmp / "out.json").read_text())
    resident = json.loads((tmp / "resident.json").read_text())
    assert [r["new_ids"] for r in doc["requests"]] == [r["new_ids"] for r in
                                                      resident["requests"]]
    assert all(len(r["new_ids"]) == 6 for r in doc["requests"])
    assert doc["engine"]["processes"] == 2 and doc["engine"]["expert_devices"] == 4
    assert doc["engine"]["disk_loads"] > 0  # half of the experts were on disk only
    # (Gloo itself prints its connections to stdout on every process)
    assert "->" in out0 and "->" not in out1 and "timing:" not in err1


def test_each_process_writes_its_own_timeline(runs):
    tmp, _ = runs
    assert not (tmp / "timeline.json").exists()
    for pid in (0, 1):
        events = json.loads((tmp / f"timeline.p{pid}.json").read_text())["traceEvents"]
        assert {e["pid"] for e in events} == {pid}
        names = {e["name"] for e in events}
        assert "decode" in names and any(re.fullmatch(r"prefill\d+x\d+", n) for n in names)


@pytest.mark.parametrize(("flags", "message"), [
    (["--num-processes", "2", "--process-id", "0"], "--coordinator: --coordinator, "),
    (["--coordinator", "127.0.0.1:9", "--num-processes", "2", "--process-id", "2"],
     "--process-id 2: outside [0, 2)"),
    (["--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"],
     "--coordinator 'localhost': expected HOST:PORT"),
    (["--coordinator", "127.0.0.1:9", "--num-processes", "0", "--process-id", "0"],
     "--num-processes 0: at least 1"),
])
def test_bad_process_flags_are_refused_by_name(flags, message, capsys, tmp_path):
    assert main(["generate", str(tmp_path), "--prompt-ids", "1", *flags]) == 2
    assert message in capsys.readouterr().err
