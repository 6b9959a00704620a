"""Does a device ceiling need untimed work first? `bench._device_read_gbps` and
`bench._matmul_tflops` timed with and without `bench.GPU_WARM_S` of warm-up, each after 5 s
of idle (as between a sweep's rungs or calls), twice. GPU only in practice.

    python -m benchmarks.ceiling_warmup_probe
"""

import json
import time

import jax
import jax.numpy as jnp

from strata_runtime import bench


def main() -> None:
    dev = jax.devices()[0]
    for warm in (0.0, bench.GPU_WARM_S, 0.0, bench.GPU_WARM_S):
        time.sleep(5)
        print(json.dumps({"device": dev.device_kind, "warm_s": warm,
                          "hbm_read_gbps": bench._device_read_gbps(dev, 2 << 30, 10, warm),
                          "matmul_tflops": bench._matmul_tflops(dev, 8192, jnp.bfloat16, 10,
                                                                warm)}), flush=True)


if __name__ == "__main__":
    main()
