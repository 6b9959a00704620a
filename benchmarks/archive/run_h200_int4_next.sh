#!/usr/bin/env bash
# One device call (~4 min on a fresh machine): the Mosaic kernel tests of the default and the
# stream-K tiles (the dedicated test forces cut tiles in both kernels and checks them against
# float64 and the whole-tile kernel), then the int4 benchmark with its tile sweep and read floor.
# The whole GPU suite (`PART=tests bash benchmarks/run_h200_int4.sh`) takes two more calls.
source "$(dirname "$0")/device_env.sh"
timeout "${TEST_LIMIT:-150}" python3 -m pytest -q -p no:warnings -rfE tests/ops/test_expert_kernels.py \
  -k "on_gpu and (tiles0- or tiles14 or tiles15 or stream_k)" 2>&1 | grep -v "^W0" | tail -12 \
  | cut -c1-400 | tee "$OUT/gpu_tests_kernels.txt"
PART=bench BENCH_LIMIT="${BENCH_LIMIT:-420}" bash "$(dirname "$0")/run_h200_int4.sh"
