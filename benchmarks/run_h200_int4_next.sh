#!/usr/bin/env bash
# One device call (session 10): the Mosaic kernel tests of the stream-K settings (equal runs
# of steps per persistent CTA, tiles cut between CTAs and joined after; the dedicated test
# forces cuts in both kernels), then the int4 benchmark, whose sweep times stream-K against the
# tuned whole-tile kernels on the engine's path. Then, in a second call,
# `PART=tests bash benchmarks/run_h200_int4.sh`: the exactness matrix with the tuned tiles.
source "$(dirname "$0")/device_env.sh"
timeout "${TEST_LIMIT:-150}" python3 -m pytest -q -p no:warnings -rfE tests/test_expert_kernels.py \
  -k "on_gpu and (tiles0- or tiles14 or tiles15 or stream_k)" 2>&1 | grep -v "^W0" | tail -12 \
  | cut -c1-400 | tee "$OUT/gpu_tests_kernels.txt"
PART=bench BENCH_LIMIT="${BENCH_LIMIT:-380}" bash "$(dirname "$0")/run_h200_int4.sh"
