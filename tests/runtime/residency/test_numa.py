"""NUMA planning over a fake sysfs tree on disk, and a real thread-affinity bind."""

import logging
import os
import threading
from types import SimpleNamespace

import jax
import pytest

from strata_runtime.residency.numa import (
    NumaPlan,
    bind_current_thread,
    format_cpulist,
    gpu_numa_node,
    gpu_pci_bus_id,
    node_cpus,
    normalize_bus_id,
    online_nodes,
    parse_cpulist,
    pci_gpus,
    plan_binding,
)

GPU = "0000:1a:00.0"


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def fake_sysfs(root, nodes, gpu_node=None, gpu=GPU, vendor="0x10de", cls="0x030200"):
    """nodes: {node: cpulist text}; gpu_node: text of the GPU's numa_node file (None: absent)."""
    node_dir = root / "devices" / "system" / "node"
    _write(node_dir / "online", format_cpulist(nodes) + "\n")
    for node, cpulist in nodes.items():
        _write(node_dir / f"node{node}" / "cpulist", cpulist + "\n")
    dev = root / "bus" / "pci" / "devices" / gpu
    _write(dev / "vendor", vendor + "\n")
    _write(dev / "class", cls + "\n")
    if gpu_node is not None:
        _write(dev / "numa_node", gpu_node + "\n")
    return root


def test_two_nodes_binds_to_the_gpus_node(tmp_path, caplog):
    sysfs = fake_sysfs(tmp_path, {0: "0-3,8-11", 1: "4-7,12-15"}, gpu_node="1")
    assert online_nodes(sysfs) == [0, 1]
    assert gpu_numa_node(GPU, sysfs) == 1
    with caplog.at_level(logging.INFO, logger="strata_runtime.residency.numa"):
        plan = plan_binding("00000000:1A:00.0", sysfs)
    assert plan == NumaPlan(1, (4, 5, 6, 7, 12, 13, 14, 15), plan.reason)
    assert plan.binds and "node 1" in plan.reason and "4-7,12-15" in plan.reason
    assert [r.name for r in caplog.records] == ["strata_runtime.residency.numa"]


def test_single_node_is_a_noop_with_one_log_line(tmp_path, caplog):
    sysfs = fake_sysfs(tmp_path, {0: "0-15"}, gpu_node="0")
    with caplog.at_level(logging.INFO, logger="strata_runtime.residency.numa"):
        plan = plan_binding(GPU, sysfs)
    assert not plan.binds and plan.cpus == () and plan.node == 0
    assert "single NUMA node" in plan.reason
    assert len(caplog.records) == 1 and "single NUMA node" in caplog.records[0].getMessage()
    assert bind_current_thread(plan) is False


def test_no_node_information_at_all_means_single_node(tmp_path):
    assert online_nodes(tmp_path) == [0]
    assert "single NUMA node" in plan_binding(GPU, tmp_path).reason


@pytest.mark.parametrize("gpu_node", [None, "-1"])
def test_unknown_gpu_node_is_a_noop(tmp_path, gpu_node):
    sysfs = fake_sysfs(tmp_path, {0: "0-3", 1: "4-7"}, gpu_node=gpu_node)
    assert gpu_numa_node(GPU, sysfs) is None
    plan = plan_binding(GPU, sysfs)
    assert not plan.binds and plan.node is None and "no node for GPU" in plan.reason


def test_unknown_bus_id_and_cpuless_node_are_noops(tmp_path):
    sysfs = fake_sysfs(tmp_path, {0: "0-3", 1: ""}, gpu_node="1")
    assert "bus id is unknown" in plan_binding(None, sysfs).reason
    assert node_cpus(1, sysfs) == []
    plan = plan_binding(GPU, sysfs)
    assert not plan.binds and plan.node == 1 and "no CPUs" in plan.reason


def test_garbage_in_sysfs_is_a_clear_error(tmp_path):
    sysfs = fake_sysfs(tmp_path, {0: "0-3", 1: "4-x"}, gpu_node="one")
    with pytest.raises(ValueError, match="numa_node.*integer"):
        gpu_numa_node(GPU, sysfs)
    with pytest.raises(ValueError, match="node1/cpulist.*'4-x'"):
        node_cpus(1, sysfs)
    with pytest.raises(ValueError, match="NUMA node 7: cannot read"):
        node_cpus(7, sysfs)


@pytest.mark.parametrize(
    "text, cpus",
    [
        ("0-3,8-11", [0, 1, 2, 3, 8, 9, 10, 11]),
        ("5", [5]),
        ("0,2,4", [0, 2, 4]),
        ("  0-1 , 3\n", [0, 1, 3]),
        ("7-7", [7]),
        ("3,1-2,2", [1, 2, 3]),
        ("126-127", [126, 127]),
    ],
)
def test_parse_cpulist(text, cpus):
    assert parse_cpulist(text) == cpus
    assert parse_cpulist(format_cpulist(cpus)) == cpus


@pytest.mark.parametrize("text", ["", " \n", "0-", "-3", "a", "0-3,,4", "3-1", "0:2", "1.5", "²"])
def test_parse_cpulist_rejects_garbage(text):
    with pytest.raises(ValueError, match="cpu list"):
        parse_cpulist(text)


@pytest.mark.parametrize(
    "raw, norm",
    [
        ("00000000:1A:00.0", "0000:1a:00.0"),
        ("0000:1a:00.0", "0000:1a:00.0"),
        ("1A:00.1", "0000:1a:00.1"),
        (" 0001:C3:1F.7\n", "0001:c3:1f.7"),
    ],
)
def test_normalize_bus_id(raw, norm):
    assert normalize_bus_id(raw) == norm


@pytest.mark.parametrize("raw", ["", "gpu0", "0000:1a:00", "1a:00.8", "100000000:1a:00.0"])
def test_normalize_bus_id_rejects_garbage(raw):
    with pytest.raises(ValueError):
        normalize_bus_id(raw)


def test_gpu_pci_bus_id(tmp_path):
    assert gpu_pci_bus_id(jax.devices("cpu")[0], tmp_path) is None
    gpu = SimpleNamespace(platform="gpu", pci_bus_id="00000000:1A:00.0")
    assert gpu_pci_bus_id(gpu, tmp_path) == GPU
    bare = SimpleNamespace(platform="gpu")
    assert gpu_pci_bus_id(bare, tmp_path) is None  # no sysfs GPUs listed
    fake_sysfs(tmp_path, {0: "0-3"})
    fake_sysfs(tmp_path, {0: "0-3"}, gpu="0000:00:02.0", vendor="0x8086")  # an Intel iGPU
    fake_sysfs(tmp_path, {0: "0-3"}, gpu="0000:00:1f.3", cls="0x040300")  # not a GPU class
    assert pci_gpus(tmp_path) == [GPU]
    assert gpu_pci_bus_id(bare, tmp_path) == GPU  # the only GPU in the machine
    fake_sysfs(tmp_path, {0: "0-3"}, gpu="0000:3b:00.0")
    assert gpu_pci_bus_id(bare, tmp_path) is None  # two GPUs: ambiguous


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs Linux affinity calls")
def test_bind_current_thread_binds_only_that_thread():
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("needs at least 2 usable CPUs")
    target = (min(allowed),)
    seen: dict[str, object] = {}

    def work():
        before = os.sched_getaffinity(0)
        try:
            seen["bound"] = bind_current_thread(NumaPlan(0, target, "test"))
            seen["inside"] = os.sched_getaffinity(0)
        finally:
            os.sched_setaffinity(0, before)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert seen == {"bound": True, "inside": set(target)}
    assert os.sched_getaffinity(0) == allowed  # the main thread is untouched


def test_bind_outside_the_allowed_cpus_returns_false(caplog):
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("needs Linux affinity calls")
    before = os.sched_getaffinity(0)
    with caplog.at_level(logging.WARNING, logger="strata_runtime.residency.numa"):
        assert bind_current_thread(NumaPlan(0, (100_000,), "no such cpu")) is False
    assert os.sched_getaffinity(0) == before
    assert "could not bind" in caplog.text
