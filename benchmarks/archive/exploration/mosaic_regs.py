"""Exploration (session 7): registers per thread of the int4 Mosaic GPU kernels, on a machine
without a GPU.

Nsight Compute showed the gate/up kernel held to 3 CTAs per SM by its 154 registers per thread.
This compiles the kernels' Mosaic modules with the CUDA PJRT plugin's own pipeline (its exported
`MosaicGpuCompile`, as `jax.experimental.mosaic.gpu` does for PyTorch) down to ptxas, which
reports registers, spills and shared memory. No GPU is needed: a stub `libcuda` answers the
compute-capability query (9.0) and refuses the module load that follows ptxas, and the LLVM
NVPTX target, which XLA registers when it starts on a GPU, is registered by hand. Counts match
the H200 within a few registers (158 here vs 154 there for gate/up: JAX 0.10.2 + ptxas 13.0
here, JAX 0.11.2 there), so compare variants here, time them there.

Set-up (once): the plugin wheels matching the installed jaxlib, unpacked into one folder, and a
CUDA toolkit's `ptxas` on the PATH:

    pip download --no-deps jax-cuda12-pjrt==0.10.2 jax-cuda12-plugin==0.10.2 -d /tmp/whl
    for w in /tmp/whl/*.whl; do unzip -oq "$w" -d /tmp/plugins; done
    python3 benchmarks/exploration/mosaic_regs.py --plugins /tmp/plugins \\
        lib:64:2:2 diag:perm:64:2:2 diag:perm0:64:2:2

A config is `lib:rows:stages:groups[:field=value...]` (the library's kernels at Mixtral shapes,
8 entries x 16 rows, other `Int4Tiles` fields as given) or `diag:mode:rows:stages:groups`
(`int4_diag.py`'s gate/up kernel) or `probe:name` (`fused_probe.py`) or `script:module` (an
exploration script's `lower()`, e.g. `script:int4_fused_ws`); `--ptx DIR` keeps the PTX.
"""
import argparse
import ctypes
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile

STUB = r"""
#include <string.h>
static const char* msg = "stub libcuda: no GPU";
int cuInit(unsigned f) { return 0; }
int cuCtxGetDevice(int* d) { *d = 0; return 0; }
int cuDeviceGetAttribute(int* v, int attr, int dev) { *v = attr == 75 ? 9 : 0; return 0; }
int cuGetErrorString(int e, const char** s) { *s = msg; return 0; }
int cuGetErrorName(int e, const char** s) { *s = msg; return 0; }
int cuModuleLoadData(void** m, const void* image) { return 999; }
"""
NVPTX_INIT = ("LLVMInitializeNVPTXTargetInfo", "LLVMInitializeNVPTXTarget",
              "LLVMInitializeNVPTXTargetMC", "LLVMInitializeNVPTXAsmPrinter")
D, F, ENTRIES, ROWS = 4096, 14336, 8, 16


def modules(config: str) -> list[tuple[str, bytes]]:
    """(kernel name, serialized Mosaic module) of one config, lowered for CUDA on this host."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.mosaic.gpu import core

    sys.path.insert(0, os.getcwd())
    kind, *rest = config.split(":")
    core.KNOWN_KERNELS.clear()
    bf16 = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)  # noqa: E731
    if kind == "lib":
        from strata_jax.ops import int4_kernel
        from strata_jax.ops.pool import ExpertPool

        rows, stages, groups = map(int, rest[:3])
        knobs = {key: int(value) for key, value in (kv.split("=") for kv in rest[3:])}
        u8 = lambda *s: jax.ShapeDtypeStruct(s, jnp.uint8)  # noqa: E731
        pool = ExpertPool(u8(ENTRIES, F, D // 2), u8(ENTRIES, F, D // 2), u8(ENTRIES, D, F // 2),
                          bf16(ENTRIES, D // 128, F), bf16(ENTRIES, D // 128, F),
                          bf16(ENTRIES, F // 128, D))
        tiles = int4_kernel.Int4Tiles(rows, stages, groups, **knobs)
        int4_kernel.grouped_swiglu_int4.trace(
            bf16(ENTRIES, ROWS, D), jax.ShapeDtypeStruct((ENTRIES,), jnp.int32), pool, None,
            tiles=tiles).lower(lowering_platforms=("cuda",))
    elif kind == "script":  # an exploration script's own `lower()`
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        importlib.import_module(rest[0]).lower()
    elif kind == "probe":  # fused_probe.py's building blocks
        path = os.path.join(os.path.dirname(__file__), "fused_probe.py")
        spec = importlib.util.spec_from_file_location("fused_probe", path)
        probe = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(probe)
        probe.lower(rest[0])
    else:
        path = os.path.join(os.path.dirname(__file__), "int4_diag.py")
        spec = importlib.util.spec_from_file_location("int4_diag", path)
        diag = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(diag)
        mode, rows, stages, groups = rest[0], *map(int, rest[1:])
        w = jax.ShapeDtypeStruct((ENTRIES, F, D), jnp.int4)
        s = bf16(ENTRIES, D // 128, F)
        fn = jax.jit(lambda *a: diag.gate_up(*a[:6], rows=rows, stages=stages, groups=groups,
                                             mode=mode, xs=a[6]))
        fn.trace(bf16(ENTRIES, ROWS, D), jax.ShapeDtypeStruct((ENTRIES,), jnp.int32), w, s, w, s,
                 jax.ShapeDtypeStruct((ENTRIES, D // 128, ROWS), jnp.float32)).lower(
            lowering_platforms=("cuda",))
    return [(f"kernel{i}", m) for i, m in enumerate(core.KNOWN_KERNELS.values())]


def compile_one(plugin: str, module: bytes) -> None:
    """In a child process: registers NVPTX, runs MosaicGpuCompile (dumps ptxas's report)."""
    dll = ctypes.CDLL(plugin)
    symbols = {}
    for line in subprocess.run(["nm", plugin], capture_output=True, text=True).stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[2] in (*NVPTX_INIT, "MosaicGpuCompile"):
            symbols[parts[2]] = int(parts[0], 16)
    base = ctypes.cast(dll.MosaicGpuCompile, ctypes.c_void_p).value - symbols["MosaicGpuCompile"]
    for name in NVPTX_INIT:
        ctypes.CFUNCTYPE(None)(base + symbols[name])()
    compile_fn = dll.MosaicGpuCompile
    compile_fn.argtypes = [ctypes.c_char_p, ctypes.c_int]
    compile_fn.restype = ctypes.c_void_p
    compile_fn(module, len(module))  # fails at the module load, after ptxas


def cuda_root() -> str:
    """The CUDA toolkit that holds the `ptxas` on the PATH."""
    ptxas = subprocess.run(["which", "ptxas"], capture_output=True, text=True).stdout.strip()
    return os.path.dirname(os.path.dirname(os.path.realpath(ptxas)))


def report(config: str, plugins: str, stub_dir: str, keep: str | None) -> list[str]:
    plugin = glob.glob(os.path.join(plugins, "jax_plugins", "xla_cuda*", "xla_cuda_plugin.so"))[0]
    runtime = glob.glob(os.path.join(plugins, "jax_cuda*_plugin", "libmosaic_gpu_runtime.so"))[0]
    lines = []
    for name, module in modules(config):
        with tempfile.TemporaryDirectory() as dump:
            blob = os.path.join(dump, "module.mlirbc")
            with open(blob, "wb") as f:
                f.write(module)
            env = dict(os.environ, LD_LIBRARY_PATH=stub_dir, MOSAIC_GPU_DUMP_TO=dump,
                       MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_RUNTIME_LIB_PATH=runtime,
                       MOSAIC_GPU_CUDA_ROOT=cuda_root())
            # the plugin looks for libdevice under ./cuda_sdk_lib (XLA's default data dir)
            os.symlink(cuda_root(), os.path.join(dump, "cuda_sdk_lib"))
            subprocess.run([sys.executable, os.path.abspath(__file__), "--compile", plugin, blob],
                           env=env, cwd=dump, capture_output=True, timeout=600)
            text = "".join(open(p).read() for p in glob.glob(os.path.join(dump, "*.ptxas")))
            for ptx in glob.glob(os.path.join(dump, "*.ptx")) if keep else ():
                shutil.copy(ptx, os.path.join(keep, config.replace(":", "_") + "." +
                                              os.path.basename(ptx)))
        found = re.findall(r"entry function '(\w+)'.*?(\d+) bytes spill stores.*?Used (\d+) "
                           r"registers", text, re.S)
        for kernel, spills, regs in found or [(name, "?", "?")]:
            lines.append(f"| {config} | {kernel} | {regs} | {spills} |")
    return lines


def main() -> None:
    if sys.argv[1:2] == ["--compile"]:
        compile_one(sys.argv[2], open(sys.argv[3], "rb").read())
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plugins", required=True, help="folder with the unpacked plugin wheels")
    parser.add_argument("--ptx", help="keep each kernel's PTX in this folder")
    parser.add_argument("configs", nargs="+")
    args = parser.parse_args()
    stub_dir = tempfile.mkdtemp()
    source = os.path.join(stub_dir, "stub.c")
    with open(source, "w") as f:
        f.write(STUB)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", os.path.join(stub_dir, "libcuda.so.1"),
                    source], check=True)
    print("| config | kernel | registers/thread | spill bytes |\n|---|---|---|---|")
    for config in args.configs:
        print("\n".join(report(config, args.plugins, stub_dir, args.ptx)), flush=True)


if __name__ == "__main__":
    main()
