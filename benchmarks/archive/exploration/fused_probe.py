"""Exploration (session 8): the building blocks a fused gate/up + down int4 kernel (one launch
per layer) would need, lowered for CUDA so that `mosaic_regs.py probe:NAME` compiles them on a
machine without a GPU (and `python3 fused_probe.py NAME` runs them on one).

- `sem`: per-entry global semaphores: each CTA signals its entry's count once its part is
  stored, and CTAs of the next phase wait (without decrementing) for the entry's full count.
- `mnb`: a wgmma whose B operand is an activation block stored [K, N] (N = 16 rows, 32-byte
  swizzle), as gate/up writes h^T, so that the down phase needs no transpose.
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

ENTRIES, PER_ENTRY = 8, 4  # CTAs per entry in each phase


def sem_kernel():
    """Phase 1: CTA p adds p + 1 to out[p] and signals entry p // PER_ENTRY; phase 2: CTA p
    waits for its entry's PER_ENTRY signals, then reads the entry's phase-1 values."""
    n = ENTRIES * PER_ENTRY

    def body(x_ref, out_ref):
        sems = pl.get_global(plgpu.SemaphoreType.REGULAR((ENTRIES,)))
        p = lax.axis_index("p")
        entry = lax.div(p, PER_ENTRY)
        out_ref[p] = x_ref[p] + (p + 1).astype(jnp.float32)
        pl.semaphore_signal(sems.at[entry], 1)
        pl.semaphore_wait(sems.at[entry], PER_ENTRY, decrement=False)
        first = entry * PER_ENTRY
        total = sum(out_ref[first + i] for i in range(PER_ENTRY))
        out_ref[n + p] = total

    kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((2 * n,), jnp.float32),
                          grid=(n,), grid_names=("p",), kernel_name="probe_sem")
    return jax.jit(kernel), (jax.ShapeDtypeStruct((n,), jnp.float32),)


def mnb_kernel():
    """out [64, 16] = a [64, 128] @ b [128, 16] with b loaded [K, N] (N-major) into smem."""
    def body(a_gmem, b_gmem, out_gmem, a_smem, b_smem, o_smem, barrier):
        plgpu.copy_gmem_to_smem(a_gmem, a_smem, barrier.at[0])
        plgpu.copy_gmem_to_smem(b_gmem, b_smem, barrier.at[0])
        plgpu.barrier_wait(barrier.at[0])

        def scope(acc):  # A from registers, as the int4 kernel feeds it
            a = plgpu.load(a_smem, (), layout=plgpu.Layout.WGMMA)
            plgpu.wgmma(acc, a, b_smem)
            plgpu.wgmma_wait(0)
            o_smem[...] = acc[...]
        pl.run_scoped(scope, plgpu.ACC((64, 16)))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_gmem)
        plgpu.wait_smem_to_gmem(0)

    def swizzled(minor_bytes):
        return (plgpu.TilingTransform((8, minor_bytes // 2)), plgpu.SwizzleTransform(minor_bytes))

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((64, 16), jnp.float32),
        scratch_types=[plgpu.SMEM((64, 128), jnp.float16, transforms=swizzled(128)),
                       plgpu.SMEM((128, 16), jnp.float16, transforms=swizzled(32)),
                       plgpu.SMEM((64, 16), jnp.float32),
                       plgpu.Barrier(num_arrivals=2)],
        kernel_name="probe_mnb")
    f16 = jax.ShapeDtypeStruct
    return jax.jit(kernel), (f16((64, 128), jnp.float16), f16((128, 16), jnp.float16))


def fused_kernel(d: int = 2048, f: int = 768, entries: int = 64, rows: int = 8):
    """int4_fused.py's one-launch layer at Qwen3-30B-A3B shapes (lowering only)."""
    import importlib.util
    import os

    from strata_jax.ops.pool import ExpertPool

    path = os.path.join(os.path.dirname(__file__), "int4_fused.py")
    spec = importlib.util.spec_from_file_location("int4_fused", path)
    fused = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fused)
    sds = jax.ShapeDtypeStruct
    u8, bf16 = jnp.uint8, jnp.bfloat16
    pool = ExpertPool(sds((entries, f, d // 2), u8), sds((entries, f, d // 2), u8),
                      sds((entries, d, f // 2), u8), sds((entries, d // 128, f), bf16),
                      sds((entries, d // 128, f), bf16), sds((entries, f // 128, d), bf16))
    fn = jax.jit(lambda x, s, p, v: fused.fused_swiglu_int4(x, s, p, v))
    return fn, (sds((rows, d), bf16), sds((entries,), jnp.int32), pool, sds((entries,), bool))


PROBES = {"sem": sem_kernel, "mnb": mnb_kernel, "fused": fused_kernel}


def lower(name: str) -> None:
    fn, args = PROBES[name]()
    fn.trace(*args).lower(lowering_platforms=("cuda",))


def run(name: str) -> None:
    """On a Hopper GPU: the probe against numpy, on fresh inputs three times (semaphores left
    counted by a previous call would let a wait pass early and read this call's data unwritten)."""
    fn, args = PROBES[name]()
    rng = np.random.default_rng(0)
    for _ in range(3):
        xs = [rng.normal(size=a.shape).astype(a.dtype) for a in args]
        got = np.asarray(fn(*xs))
        if name == "sem":
            n = ENTRIES * PER_ENTRY
            first = xs[0] + np.arange(1, n + 1)
            sums = first.reshape(ENTRIES, PER_ENTRY).sum(1).repeat(PER_ENTRY)
            want = np.concatenate([first, sums])
        else:
            want = xs[0].astype(np.float32) @ xs[1].astype(np.float32)
        print(name, "max error", float(np.abs(got - want).max()), flush=True)


if __name__ == "__main__":
    for probe in sys.argv[1:] or PROBES:
        run(probe)
