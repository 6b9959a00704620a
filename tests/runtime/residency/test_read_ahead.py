"""Tier 2 -> tier 1 ahead of need: the hottest disk-only experts replace colder tier-1 ones, in
the background, with their disk bytes; never an expert HBM holds, nor one within hysteresis."""

import threading
import time

import jax
import numpy as np
import pytest

from strata_runtime.residency.read_ahead import ReadAhead
from strata_runtime.residency.tiers import Residency

L, E = 2, 4


@pytest.fixture()
def disk():
    rng = np.random.default_rng(3)
    return {(layer, e): {n: rng.standard_normal((4, 8)).astype(np.float32)
                         for n in ("w1", "w3", "w2")}
            for layer in range(L) for e in range(E)}


def _residency(disk) -> Residency:
    # (0, 0) and (1, 0) in HBM; tier 1 holds (0, 1), (0, 2), (1, 1); the other three on disk
    return Residency(L, E, jax.devices()[0], disk.__getitem__, [(0, 0), (1, 0)], 2, 1,
                     [(0, 1), (0, 2), (1, 1)], 3)


def _settle(ahead: ReadAhead, res: Residency, heat: np.ndarray, want: int,
            seconds: float = 30) -> int:
    """Step boundaries until `want` reads were written or `seconds` passed (each boundary
    also plans more)."""
    written = 0
    deadline = time.monotonic() + seconds
    while written < want and time.monotonic() < deadline:
        written += ahead.between_steps(res, heat)
        time.sleep(0.005)
    return written


def _host_arrays(res: Residency, key) -> dict[str, np.ndarray]:
    slot = int(res.host_page[key])
    return {n: np.asarray(a)[slot] for n, a in res.host._asdict().items() if a is not None}


def test_hot_disk_experts_replace_the_coldest_tier1_ones_with_their_disk_bytes(disk):
    res = _residency(disk)
    heat = np.zeros((L, E))
    heat[0] = [9.0, 1.0, 0.5, 3.0]  # (0, 0) hottest but in HBM; (0, 3) on disk, hot
    heat[1] = [8.0, 2.0, 0.0, 0.1]  # (1, 3) on disk, barely warm
    ahead = ReadAhead(4, 0.1, disk.__getitem__)
    try:
        assert _settle(ahead, res, heat, 1) == 1
        # (0, 3) took the coldest tier-1 expert's slot, (0, 2); (1, 3) is colder than every
        # tier-1 expert left, and (1, 2) has no heat: neither is read
        assert res.on_host((0, 3)) and not res.on_host((0, 2))
        assert not res.on_host((1, 3)) and not res.on_host((1, 2))
        assert res.slot_of((0, 0)) == 0 and not res.on_host((0, 0))  # HBM's: never read
        for name, a in _host_arrays(res, (0, 3)).items():
            np.testing.assert_array_equal(a, disk[(0, 3)][name])
        assert ahead.between_steps(res, heat) == 0  # nothing left that is hotter enough
    finally:
        ahead.close()


def test_hysteresis_other_devices_limit_and_unreadable_chunks(disk):
    res = _residency(disk)
    heat = np.zeros((L, E))
    heat[0] = [0.0, 1.0, 1.0, 1.05]  # (0, 3) hotter than the coldest, but within 10 %
    heat[1] = [0.0, 2.0, 5.0, 6.0]
    heat[1, 3] = -np.inf  # another device's expert
    gate = threading.Event()

    def slow(key):
        gate.wait(10)
        return "expert 2 of layer 1: checksum mismatch" if key == (1, 2) else disk[key]

    ahead = ReadAhead(1, 0.1, slow)
    try:
        assert ahead.between_steps(res, heat) == 0  # (1, 2) starts reading: the limit is 1
        gate.set()
        assert _settle(ahead, res, heat, 1, seconds=0.5) == 0  # it fails: nothing written,
        assert ahead.unreadable == {(1, 2)}  # and it is not read again (a stall reports it)
        assert not res.on_host((1, 2)) and not res.on_host((1, 3)) and not res.on_host((0, 3))
    finally:
        ahead.close()
    with pytest.raises(ValueError, match="limit >= 0"):
        ReadAhead(-1, 0.1, slow)
    assert ReadAhead(0, 0.1, slow).between_steps(res, heat) == 0
