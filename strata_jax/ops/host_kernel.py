"""The compiled host expert kernel (`host_kernel.c`) and its ctypes binding.

The C source is compiled on first use with the system C compiler (`$CC`, else `cc` or `gcc`)
for this machine's own CPU (`-march=native`, OpenMP) into a per-user cache folder
(`$STRATA_KERNEL_CACHE`, else `$XDG_CACHE_HOME/strata-jax/host_kernel`, else
`~/.cache/strata-jax/host_kernel`), under a name keyed by a hash of the source, the compiler
command and the CPU, so that a changed source, compiler or machine builds anew and concurrent
processes never load a half-written library (each writes a temporary file and renames it).

Arrays are numpy: float weights [in, out] in bfloat16 (ml_dtypes, or its uint16 bits),
float16 or float32; packed int4 weights as `strata_jax.formats.quant` and `ExpertPool` hold them
(uint8 [out, in/2] or tile-major [out/r, in/b, r, b/2], bf16 scales [in/group, out]). The
calls release the GIL (ctypes does), so a worker thread computes while Python goes on.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np

SOURCE = Path(__file__).with_name("host_kernel.c")
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
MARCH = "native"
"""The CPU the kernel is built for; tests also build other code paths (`-march` values). A
build may add tuning constants of host_kernel.c after the CPU, `native+AMX_KB=64+AMX_PD=4`
(`#define`d before the source's own, for benchmarks that time variants in one run)."""
DTYPES = {"float32": 0, "bfloat16": 1, "float16": 2}
BF16 = np.dtype(ml_dtypes.bfloat16)


class KernelBuildError(RuntimeError):
    """The host kernel could not be compiled (no compiler, or the compiler failed)."""


def compiler() -> str:
    """The C compiler the kernel is built with: `$CC`, else `cc`, else `gcc`."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise KernelBuildError("the host expert kernel (strata_jax/ops/host_kernel.c) is compiled "
                               "with the system C compiler, and none was found: install gcc, "
                               "or name one in $CC")
    return cc


def cache_dir() -> Path:
    if os.environ.get("STRATA_KERNEL_CACHE"):
        return Path(os.environ["STRATA_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "strata-jax" / "host_kernel"


def _cpu() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    keep = ("model name", "flags", "Features", "CPU implementer", "CPU part")
    lines = []
    for line in text.splitlines():
        if not line.strip():
            break  # the first processor's block is enough
        if line.split(":")[0].strip() in keep:
            lines.append(line)
    return platform.machine() + "\n" + "\n".join(lines)


def _compiler_id(cc: str) -> str:
    path = shutil.which(cc) or cc
    try:
        stat = os.stat(os.path.realpath(path))
        return f"{os.path.realpath(path)} {stat.st_size} {stat.st_mtime_ns}"
    except OSError:
        return path


def flags(march: str = MARCH) -> list[str]:
    cpu, *defines = march.split("+")
    return [FLAGS[0], f"-march={cpu}", *(f"-D{d}" for d in defines), *FLAGS[1:]]


def library_path(cc: str | None = None, march: str = MARCH) -> Path:
    """Where the kernel for this source, compiler and CPU lives (built or not)."""
    cc = cc or compiler()
    key = hashlib.sha256("\0".join([SOURCE.read_text(), _compiler_id(cc), " ".join(flags(march)),
                                    _cpu()]).encode()).hexdigest()[:20]
    return cache_dir() / f"host_kernel-{key}.so"


def build(march: str = MARCH) -> Path:
    """Compile the kernel unless the cache holds it; its path."""
    cc = compiler()
    path = library_path(cc, march)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    cmd = [cc, *flags(march), "-o", tmp, str(SOURCE)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise KernelBuildError(f"compiling the host expert kernel failed ({' '.join(cmd)}, "
                                   f"exit {done.returncode}):\n{done.stderr.strip()}")
        os.replace(tmp, path)
    except OSError as err:
        raise KernelBuildError(f"compiling the host expert kernel failed ({' '.join(cmd)}): "
                               f"{err}") from err
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_long


@functools.cache
def library(march: str = MARCH) -> ctypes.CDLL:
    """The compiled kernel (built on first use)."""
    lib = ctypes.CDLL(str(build(march)))
    lib.strata_isa.restype = ctypes.c_char_p
    lib.strata_isa.argtypes = []
    lib.strata_openmp.restype = _I
    lib.strata_swiglu.restype = _I
    lib.strata_swiglu.argtypes = [_P, _P, _P, _I, _P, _I, _I, _L, _L, _P, _I]
    lib.strata_swiglu_int4.restype = _I
    lib.strata_swiglu_int4.argtypes = [_P] * 6 + [_L] * 5 + [_P, _I, _I, _L, _L, _P, _I]
    return lib


def isa(march: str = MARCH) -> str:
    """The code path the kernel was built with: 'avx512bf16', 'avx512' or 'portable'."""
    return library(march).strata_isa().decode()


def default_threads() -> int:
    """All cores but a quarter (at least one left out): the thread that drives the device and
    the runtime's own threads keep theirs, since a kernel thread descheduled by them holds up
    every other at the kernel's barriers (docs/design.md, "Host compute of misses")."""
    cores = os.cpu_count() or 2
    return max(1, cores - max(1, cores // 4))


_THREADS = [default_threads()]


def set_threads(threads: int | None) -> int:
    """Threads each call runs on (None: `default_threads()`); returns the count set."""
    _THREADS[0] = int(threads or default_threads())
    return _THREADS[0]


def threads() -> int:
    return _THREADS[0]


_BUILD = [MARCH]


def set_build(build: str | None) -> str:
    """The build later calls use by default (None: `MARCH`), e.g. `native+AMX_ROWS=1000` to
    run an engine on a variant; compiled now. Returns the build set."""
    _BUILD[0] = build or MARCH
    library(_BUILD[0])
    return _BUILD[0]


def dtype_name(dtype) -> str:
    """'bfloat16', 'float16' or 'float32' (uint16 storage counts as bfloat16)."""
    name = np.dtype(dtype).name
    name = "bfloat16" if name == "uint16" else name
    if name not in DTYPES:
        raise ValueError(f"the host kernel takes bfloat16, float16 or float32, not {name}")
    return name


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def _rows(x: np.ndarray, d: int) -> np.ndarray:
    if x.ndim != 2 or x.shape[1] != d:
        raise ValueError(f"x must be [rows, {d}], got {x.shape}")
    return np.ascontiguousarray(x)


def _check(a: np.ndarray, shape: tuple[int, ...], name: str) -> None:
    if a.shape != shape or not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous {shape}, got {a.shape}"
                         f"{'' if a.flags.c_contiguous else ' (not contiguous)'}")


def _out(out: np.ndarray | None, rows: int, d: int) -> np.ndarray:
    if out is None:
        return np.empty((rows, d), np.float32)
    if out.dtype != np.float32:
        raise ValueError(f"out must be float32, got {out.dtype}")
    _check(out, (rows, d), "out")
    return out


def swiglu(w1: np.ndarray, w3: np.ndarray, w2: np.ndarray, x: np.ndarray,
           out: np.ndarray | None = None, threads: int | None = None,
           march: str | None = None) -> np.ndarray:
    """(silu(x @ w1) * (x @ w3)) @ w2 -> float32 [r, D] for float weights w1, w3 [D, F], w2
    [F, D] (one dtype) and x [r, D]: gate and up in float32, silu(gate) * up rounded to x's
    dtype, the down projection accumulated in float32."""
    d, f = w1.shape
    wdt = dtype_name(w1.dtype)
    for name, w, shape in (("w1", w1, (d, f)), ("w3", w3, (d, f)), ("w2", w2, (f, d))):
        _check(w, shape, name)
        if dtype_name(w.dtype) != wdt:
            raise ValueError(f"{name} is {w.dtype}, w1 is {w1.dtype}")
    x = _rows(x, d)
    out = _out(out, x.shape[0], d)
    lib = library(march or _BUILD[0])
    rc = lib.strata_swiglu(_ptr(w1), _ptr(w3), _ptr(w2), DTYPES[wdt], _ptr(x),
                           DTYPES[dtype_name(x.dtype)], x.shape[0], d, f, _ptr(out),
                           threads or _THREADS[0])
    if rc:
        raise MemoryError("the host kernel could not allocate its scratch buffers")
    return out


def int4_layout(shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """(outputs, inputs, tile rows, tile inputs) of a packed weight's shape: [out, in/2], or
    tile-major [out/r, in/b, r, b/2]."""
    if len(shape) == 2:
        n, half = shape
        return n, 2 * half, 1, 2 * half
    if len(shape) == 4:
        blocks, steps, r, half = shape
        return blocks * r, steps * 2 * half, r, 2 * half
    raise ValueError(f"packed int4 weights are [out, in/2] or [out/r, in/b, r, b/2], got "
                     f"{tuple(shape)}")


def swiglu_int4(w1: np.ndarray, s1: np.ndarray, w3: np.ndarray, s3: np.ndarray,
                w2: np.ndarray, s2: np.ndarray, x: np.ndarray, out: np.ndarray | None = None,
                threads: int | None = None, march: str | None = None) -> np.ndarray:
    """`swiglu` for packed int4 weights (`quant.Int4Weight` packing, output-major, row-major or
    tile-major as `ExpertPool` holds them) with bf16 group scales: w1, w3 [F, D/2] with scales
    [D/group, F], w2 [D, F/2] with scales [F/group, D]; the weights are q * s, exact in float32
    with few rows, rounded to bf16 (as the device dequantizes) where bf16 rows take vdpbf16ps.
    The inputs D and F, the group and the tile's inputs must be multiples of 32."""
    f, d, tr1, tb1 = int4_layout(w1.shape)
    d2, f2, tr2, tb2 = int4_layout(w2.shape)
    if (d2, f2) != (d, f) or int4_layout(w3.shape) != (f, d, tr1, tb1):
        raise ValueError(f"int4 expert shapes do not agree: w1 {w1.shape}, w3 {w3.shape}, "
                         f"w2 {w2.shape}")
    groups = s1.shape[0]
    if not groups or d % groups:
        raise ValueError(f"scales {s1.shape} do not split D={d} into groups")
    group = d // groups
    for name, s, shape in (("s1", s1, (groups, f)), ("s3", s3, (groups, f)),
                           ("s2", s2, (f // group, d))):
        _check(s, shape, name)
        if dtype_name(s.dtype) != "bfloat16":
            raise ValueError(f"{name} must be bfloat16, got {s.dtype}")
    for name, w in (("w1", w1), ("w3", w3), ("w2", w2)):
        if w.dtype != np.uint8 or not w.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous uint8, got {w.dtype}")
    if any(v % 32 for v in (d, f, group, tb1, tb2)):
        raise ValueError(f"the int4 host kernel needs D={d}, F={f}, the group {group} and the "
                         f"tile's inputs ({tb1}, {tb2}) to be multiples of 32")
    x = _rows(x, d)
    out = _out(out, x.shape[0], d)
    lib = library(march or _BUILD[0])
    rc = lib.strata_swiglu_int4(_ptr(w1), _ptr(s1), _ptr(w3), _ptr(s3), _ptr(w2), _ptr(s2),
                                tr1, tb1, tr2, tb2, group, _ptr(x),
                                DTYPES[dtype_name(x.dtype)], x.shape[0], d, f, _ptr(out),
                                threads or _THREADS[0])
    if rc == -1:
        raise MemoryError("the host kernel could not allocate its scratch buffers")
    if rc:
        raise ValueError("the int4 host kernel refused these shapes")
    return out
