"""Routing traces: the file format round trip, atomic writes, clear errors on bad files, the
synthetic traces' determinism and skew, and the statistics."""

import json
import zipfile

import numpy as np
import pytest

from strata_runtime.engine import trace as trace_mod
from strata_runtime.engine.trace import (
    TraceError,
    TraceWriter,
    load_trace,
    reuse_distances,
    save_trace,
    synthetic_trace,
    trace_stats,
)

L, E, K = 3, 8, 2


def _steps(seed=0, n=5, width=4):
    """Random steps: picks [L, width, K] (distinct per token), a live mask, request ids."""
    rng = np.random.default_rng(seed)
    out = []
    for s in range(n):
        picks = np.stack([[rng.choice(E, K, replace=False) for _ in range(width)]
                          for _ in range(L)]).astype(np.int32)
        live = rng.random(width) < 0.7
        live[s % width] = True
        requests = [int(100 + r) if on else None for r, on in enumerate(live)]
        out.append((picks, live, requests))
    return out


def test_round_trip_keeps_live_rows_requests_and_metadata(tmp_path):
    steps = _steps()
    path = tmp_path / "run.npz"
    with TraceWriter(path, num_layers=L, num_experts=E, top_k=K, seed=7,
                     extra={"checkpoint": "tiny", "knobs": {"policy": "lru"}}) as w:
        for i, (picks, live, requests) in enumerate(steps):
            w.add(picks, live, requests, prefill=i == 0)
    t = load_trace(path)
    assert (t.num_layers, t.num_experts, t.top_k, t.seed) == (L, E, K, 7)
    assert t.extra == {"checkpoint": "tiny", "knobs": {"policy": "lru"}}
    assert t.num_steps == len(steps) and t.prefill.tolist() == [True] + [False] * 4
    for s, (picks, live, requests) in enumerate(steps):
        np.testing.assert_array_equal(t.step_experts(s), picks[:, live, :])
        lo, hi = t.offsets[s], t.offsets[s + 1]
        assert t.rows[lo:hi].tolist() == np.flatnonzero(live).tolist()
        assert t.requests[lo:hi].tolist() == [r for r in requests if r is not None]
        assert t.widths[s] == len(live)
        want = sorted({layer * E + int(e) for layer in range(L)
                       for e in picks[layer, live].ravel()})
        assert t.step_keys(s).tolist() == want
    assert t.counts().sum() == t.live_rows().sum() * L * K


def test_an_empty_trace_round_trips(tmp_path):
    TraceWriter(tmp_path / "e.npz", num_layers=L, num_experts=E, top_k=K).close()
    t = load_trace(tmp_path / "e.npz")
    assert t.num_steps == 0 and t.experts.shape == (0, L, K) and t.seed is None


def test_a_failed_block_or_write_leaves_no_file_and_no_partial(tmp_path, monkeypatch):
    path = tmp_path / "run.npz"
    with pytest.raises(RuntimeError), TraceWriter(path, num_layers=L, num_experts=E,
                                                  top_k=K) as w:
        w.add(*_steps()[0])
        raise RuntimeError("the engine failed mid-run")
    assert list(tmp_path.iterdir()) == []

    save_trace(path, synthetic_trace(L, E, K, 4, 2, 1.0, seed=1))
    before = path.read_bytes()

    def half_written(f, **arrays):
        f.write(b"PK\x03\x04 half an archive")
        raise OSError("disk full")

    monkeypatch.setattr(trace_mod.np, "savez_compressed", half_written)
    with pytest.raises(OSError, match="disk full"):
        save_trace(path, synthetic_trace(L, E, K, 4, 2, 1.0, seed=2))
    assert path.read_bytes() == before  # the old trace is intact
    assert [p.name for p in tmp_path.iterdir()] == ["run.npz"]


def _rewrite(path, **changes):
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(str(arrays.pop("meta")[()]))
    meta.update(changes.pop("meta", {}))
    arrays.update(changes)
    np.savez_compressed(path, meta=np.array(json.dumps(meta)), **arrays)


@pytest.mark.parametrize("damage, message", [
    ("text", "not an .npz archive"),
    ("other_npz", "is not a routing trace"),
    ("format", "no 'strata-trace' format"),
    ("version", "of version 99; this version reads version 1"),
    ("offsets", "do not fit together"),
    ("ids", "expert ids outside"),
])
def test_bad_files_fail_naming_the_path(tmp_path, damage, message):
    path = tmp_path / f"{damage}.npz"
    save_trace(path, synthetic_trace(L, E, K, 4, 2, 1.0, seed=1))
    if damage == "text":
        path.write_text("not a trace\n")
    elif damage == "other_npz":
        np.savez(path, a=np.arange(3))
    elif damage == "format":
        _rewrite(path, meta={"format": "strata-heat-v1"})
    elif damage == "version":
        _rewrite(path, meta={"version": 99})
    elif damage == "offsets":
        _rewrite(path, offsets=np.array([0, 2, 1, 6, 8]))
    else:
        _rewrite(path, experts=np.full((8, L, K), E, np.int16))
    assert zipfile.is_zipfile(path) == (damage != "text")
    with pytest.raises(TraceError, match=message) as err:
        load_trace(path)
    assert str(path) in str(err.value)
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "missing.npz")


def test_add_checks_shapes_and_ids(tmp_path):
    w = TraceWriter(tmp_path / "t.npz", num_layers=L, num_experts=E, top_k=K)
    picks, live, requests = _steps()[0]
    with pytest.raises(ValueError, match="expected"):
        w.add(picks[:, :, :1], live, requests)
    with pytest.raises(ValueError, match="expected"):
        w.add(picks, live, requests[:-1])
    with pytest.raises(ValueError, match=r"expert ids must be in \[0, 8\)"):
        w.add(picks + E, live, requests)
    with pytest.raises(TypeError):
        TraceWriter(tmp_path / "x.npz", num_layers=L, num_experts=E, top_k=K,
                    extra={"bad": object()})
    w.close()
    with pytest.raises(ValueError, match="already closed"):
        w.add(picks, live, requests)


def test_synthetic_traces_are_deterministic_in_the_seed():
    a, b = (synthetic_trace(4, 16, 2, 30, 5, 1.0, seed=3, drift_at=15) for _ in range(2))
    c = synthetic_trace(4, 16, 2, 30, 5, 1.0, seed=4, drift_at=15)
    np.testing.assert_array_equal(a.experts, b.experts)
    assert not np.array_equal(a.experts, c.experts)
    assert a.experts.max() > 0
    picks = a.experts.astype(int)
    assert all(len(set(row)) == 2 for row in picks.reshape(-1, 2).tolist())  # distinct top-k


def test_skew_concentrates_popularity_and_drift_moves_it():
    flat = trace_stats(synthetic_trace(2, 32, 2, 200, 8, 0.0, seed=0))
    steep = trace_stats(synthetic_trace(2, 32, 2, 200, 8, 1.5, seed=0))
    assert (flat.entropy_bits > 4.9).all() and (flat.top8_share < 0.35).all()  # log2 32 = 5
    assert (steep.entropy_bits < flat.entropy_bits - 0.5).all()
    assert (steep.top8_share > 0.6).all()
    t = synthetic_trace(2, 32, 2, 200, 8, 1.5, seed=0, drift_at=100)
    early = np.bincount(t.experts[: 800, 0].ravel(), minlength=32)
    late = np.bincount(t.experts[800:, 0].ravel(), minlength=32)
    assert set(np.argsort(-early)[:4]) != set(np.argsort(-late)[:4])


def test_reuse_distances_match_a_brute_force_count():
    rng = np.random.default_rng(5)
    keys = rng.integers(0, 7, 60)
    want = []
    for i, k in enumerate(keys.tolist()):
        prev = [j for j in range(i) if keys[j] == k]
        want.append(len(set(keys[prev[-1] + 1 : i].tolist())) if prev else -1)
    assert reuse_distances(keys).tolist() == want


def test_trace_stats_per_layer_and_histogram():
    t = synthetic_trace(3, 16, 2, 50, 4, 1.0, seed=2)
    s = trace_stats(t)
    counts = t.counts()
    assert s.distinct.tolist() == (counts > 0).sum(axis=1).tolist()
    assert s.accesses == sum(len(t.step_keys(i)) for i in range(t.num_steps))
    assert s.cold + s.reuse_hist.sum() == s.accesses and s.cold == (counts > 0).sum()
    np.testing.assert_allclose(s.top8_share, np.sort(counts, 1)[:, -8:].sum(1) / counts.sum(1))
    text = s.render()
    assert "| layer | distinct experts | entropy (bits) | top-8 share |" in text
    assert "| reuse distance | re-accesses |" in text
