#!/usr/bin/env bash
# One device call (prepared in session 10): the Mosaic kernel tests of the `halves` settings
# (each group's wgmma in two of 64 inputs: lag-1 folding at 120 registers, a fourth CTA per SM)
# and of stream-K (the test that forces cut tiles), then the int4 benchmark: its sweep times
# them against the tuned tiles on the engine's path, and each row now has the read floor of the
# same bytes beside the HBM bound. Then, in a second call if time is left,
# `PART=tests bash benchmarks/run_h200_int4.sh` (all GPU tests).
source "$(dirname "$0")/device_env.sh"
timeout "${TEST_LIMIT:-150}" python3 -m pytest -q -p no:warnings -rfE tests/test_expert_kernels.py \
  -k "on_gpu and (tiles0- or tiles16 or tiles17 or stream_k)" 2>&1 | grep -v "^W0" | tail -12 \
  | cut -c1-400 | tee "$OUT/gpu_tests_kernels.txt"
PART=bench BENCH_LIMIT="${BENCH_LIMIT:-420}" bash "$(dirname "$0")/run_h200_int4.sh"
