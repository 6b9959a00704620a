"""The compiled host expert kernel (`host_kernel`) against a float64 numpy reference: every
code path this CPU can run (AVX-512 with vdpbf16ps, AVX-512 without, portable C), float and
packed int4 weights, odd sizes, one and two threads, and the build's clear errors."""

import os
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from strata_jax.formats import quant
from strata_jax.ops import host_kernel
from strata_jax.ops.pool import tile_major

BF16 = np.dtype(ml_dtypes.bfloat16)
# Relative to the reference's largest output. The reference rounds silu(gate) * up to x's
# dtype as the kernel does; what is left is float32 accumulation order (and, once in a while,
# an activation on the other side of a rounding tie).
TOL = {np.dtype(np.float32): 1e-5, BF16: 4e-3, np.dtype(np.float16): 2e-3}
# int4: the weights are q * s, exact in float32, or rounded to bf16 as the device's
# dequantization does them (the vdpbf16ps path, with more than a few rows).
INT4_TOL = 2e-2
# 16, 20, 40, 64: whole and partial blocks of 16 rows, one or two at a time, for AMX tiles
ROWS = (1, 3, 16, 20, 40, 64)


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _marches() -> list[str]:
    """-march values whose code paths this CPU runs: native, and beside an AVX-512 build the
    other paths (vdpbf16ps without AMX tiles, AVX-512 without vdpbf16ps, the portable C)."""
    flags = _cpu_flags()
    if "avx512f" not in flags:
        return ["native"]  # native is the portable C already
    out = ["native"]
    if "avx512_bf16" in flags and {"avx512bw", "avx512vl", "avx512cd", "avx512dq"} <= flags:
        if "amx_bf16" in flags:
            out.append("cooperlake")
        out.append("skylake-avx512")
    out.append("x86-64-v3" if {"avx2", "fma", "bmi2", "f16c", "movbe"} <= flags else "x86-64")
    return out


MARCHES = _marches()


def _round(a: np.ndarray, dtype) -> np.ndarray:
    return a.astype(np.float32).astype(dtype).astype(np.float64)


def _reference(w1, w3, w2, x):
    w1, w3, w2, xf = (np.asarray(a, np.float64) for a in (w1, w3, w2, x))
    gate, up = xf @ w1, xf @ w3
    return _round(gate / (1 + np.exp(-gate)) * up, x.dtype) @ w2


def _err(y, ref):
    assert y.dtype == np.float32 and np.isfinite(y).all()
    return np.abs(y - ref).max() / np.abs(ref).max()


def test_the_native_build_names_its_path():
    assert host_kernel.isa() in ("avx512bf16-amx", "avx512bf16", "avx512", "portable")
    if {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= _cpu_flags():
        assert host_kernel.isa().startswith("avx512bf16")


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float32)], ids=["bf16", "f32"])
@pytest.mark.parametrize(("d", "f"), [(64, 96), (160, 224), (77, 133), (130, 45)])
def test_float_experts_match_float64(march, dtype, d, f):
    rng = np.random.default_rng(d * f)
    w1, w3 = (rng.normal(0, 0.2, (d, f)).astype(dtype) for _ in range(2))
    w2 = rng.normal(0, 0.2, (f, d)).astype(dtype)
    for rows in ROWS:
        x = rng.normal(0, 1, (rows, d)).astype(dtype)
        ref = _reference(w1, w3, w2, x)
        for threads in (1, 2):
            out = np.full((rows, d), np.nan, np.float32)  # every element must be written
            y = host_kernel.swiglu(w1, w3, w2, x, out=out, threads=threads, march=march)
            assert y is out
            err = _err(y, ref)
            assert err < TOL[dtype], (rows, threads, err)


@pytest.mark.parametrize("march", MARCHES)
def test_float16_and_mixed_activations(march):
    """float16 experts; bf16 weights with float32 rows (the weights taken exactly)."""
    rng = np.random.default_rng(3)
    d, f = 48, 80
    w = [rng.normal(0, 0.2, s) for s in ((d, f), (d, f), (f, d))]
    for wdt, xdt in ((np.float16, np.float16), (BF16, np.float32)):
        ws = [a.astype(wdt) for a in w]
        x = rng.normal(0, 1, (5, d)).astype(xdt)
        err = _err(host_kernel.swiglu(*ws, x, threads=2, march=march), _reference(*ws, x))
        assert err < TOL[np.dtype(xdt)], (wdt, xdt, err)


def _int4_expert(rng, d, f, group):
    ws = {}
    for name, shape in (("w1", (d, f)), ("w3", (d, f)), ("w2", (f, d))):
        ws[name] = quant.quantize_int4_rtn(rng.normal(0, 0.2, shape).astype(np.float32), group)
    return ws


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize(("d", "f", "group", "tile"),
                         [(128, 256, 128, None), (96, 160, 32, None), (256, 128, 128, (8, 128))])
def test_int4_experts_match_float64(march, d, f, group, tile):
    """Packed int4 (row-major and tile-major) against the float64 product of the exactly
    dequantized weights."""
    rng = np.random.default_rng(d + f)
    ws = _int4_expert(rng, d, f, group)
    packed = {k: np.ascontiguousarray(w.packed if tile is None else tile_major(w.packed, *tile))
              for k, w in ws.items()}
    dense = {k: quant.dequantize_int4(w) for k, w in ws.items()}
    args = [a for k in ("w1", "w3", "w2") for a in (packed[k], ws[k].scales)]
    for rows in ROWS:
        x = rng.normal(0, 1, (rows, d)).astype(BF16)
        ref = _reference(dense["w1"], dense["w3"], dense["w2"], x)
        for threads in (1, 2):
            y = host_kernel.swiglu_int4(*args, x, threads=threads, march=march)
            err = _err(y, ref)
            assert err < INT4_TOL, (rows, threads, err)


def test_bad_shapes_are_refused():
    rng = np.random.default_rng(0)
    w = rng.normal(0, 1, (8, 16)).astype(np.float32)
    with pytest.raises(ValueError, match="w2 must be C-contiguous"):
        host_kernel.swiglu(w, w, w, np.ones((1, 8), np.float32))
    with pytest.raises(ValueError, match="x must be"):
        host_kernel.swiglu(w, w, w.T.copy(), np.ones((1, 9), np.float32))
    with pytest.raises(ValueError, match="float32"):
        host_kernel.swiglu(w.astype(np.int32), w, w.T.copy(), np.ones((1, 8), np.float32))
    ws = _int4_expert(rng, 128, 48, 16)
    args = [np.ascontiguousarray(a) for k in ("w1", "w3", "w2")
            for a in (ws[k].packed, ws[k].scales)]
    with pytest.raises(ValueError, match="multiples of 32"):
        host_kernel.swiglu_int4(*args, np.ones((1, 128), BF16))


def test_a_failing_compiler_is_named_with_its_stderr(tmp_path, monkeypatch):
    cc = tmp_path / "broken-cc"
    cc.write_text("#!/bin/sh\necho 'no such luck' >&2\nexit 3\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("STRATA_KERNEL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(host_kernel.KernelBuildError, match="broken-cc -O3") as err:
        host_kernel.build()
    assert "no such luck" in str(err.value) and "exit 3" in str(err.value)
    assert not any((tmp_path / "cache").iterdir())  # no temporary file left behind


def test_no_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(host_kernel.shutil, "which", lambda name: None)
    with pytest.raises(host_kernel.KernelBuildError, match="install gcc"):
        host_kernel.compiler()


def test_builds_are_cached_by_source_compiler_and_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_KERNEL_CACHE", str(tmp_path))
    path = host_kernel.build()
    assert path.parent == tmp_path and path.exists()
    mtime = os.stat(path).st_mtime_ns
    assert host_kernel.build() == path and os.stat(path).st_mtime_ns == mtime
    assert host_kernel.library_path(march="x86-64") != path
    assert host_kernel.library_path(march="native+AMX_KB=64") != path


def test_a_build_takes_tuning_constants():
    """`native+NAME=VALUE` defines a constant of host_kernel.c: AMX tiles switched off by the
    row threshold give the same products as the default build, both near float64."""
    rng = np.random.default_rng(7)
    d, f = 96, 160
    ws = [rng.normal(0, 0.2, s).astype(BF16) for s in ((d, f), (d, f), (f, d))]
    x = rng.normal(0, 1, (24, d)).astype(BF16)
    assert host_kernel.flags("native+AMX_ROWS=1000")[1:3] == ["-march=native", "-DAMX_ROWS=1000"]
    ref = _reference(*ws, x)
    for build in ("native", "native+AMX_ROWS=1000"):
        assert _err(host_kernel.swiglu(*ws, x, threads=2, march=build), ref) < TOL[BF16]
