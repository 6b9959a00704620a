"""How should a device ceiling be timed? `bench._device_read_gbps` and `bench._matmul_tflops`
as one call (`chain` 1: one launch and one wait for the host in every timed call) and as
`bench.CHAIN` calls chained in one program, each with and without `bench.GPU_WARM_S` of
warm-up, after 5 s of idle (as between a sweep's rungs or calls). GPU only in practice.

    python -m benchmarks.ceiling_warmup_probe
"""

import json
import time

import jax
import jax.numpy as jnp

from strata_runtime.lab import bench


def main() -> None:
    dev = jax.devices()[0]
    for chain in (1, bench.CHAIN):
        for warm in (0.0, bench.GPU_WARM_S):
            time.sleep(5)
            print(json.dumps({
                "device": dev.device_kind, "warm_s": warm, "chain": chain,
                "hbm_read_gbps": bench._device_read_gbps(dev, 2 << 30, 10, warm, chain),
                "matmul_tflops": bench._matmul_tflops(dev, 8192, jnp.bfloat16, 10, warm,
                                                      chain)}), flush=True)


if __name__ == "__main__":
    main()
