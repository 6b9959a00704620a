#!/usr/bin/env bash
# One device call (prepared in session 8): the Mosaic kernel tests (incl. the warp-specialized
# `compute_wgs` tiles), the fused-kernel building blocks, then the one-launch prototype against
# the XLA path and the two-kernel path. Each part has its own time limit: the fused kernel waits
# on semaphores, so a mistake there hangs rather than fails.
source "$(dirname "$0")/device_env.sh"
timeout "${TEST_LIMIT:-200}" python3 -m pytest -q -x -p no:warnings tests/test_expert_kernels.py \
  tests/test_int4_kernel.py 2>&1 | tail -8 | tee "$OUT/gpu_tests_kernels.txt"
timeout "${PROBE_LIMIT:-60}" python3 benchmarks/exploration/fused_probe.py sem mnb 2>&1 \
  | grep -v "^W0" | tail -5 | tee "$OUT/fused_probe.txt"
timeout "${FUSED_LIMIT:-200}" python3 benchmarks/exploration/int4_fused.py 2>&1 \
  | grep -v "^W0" | tail -12 | tee "$OUT/int4_fused.txt"
