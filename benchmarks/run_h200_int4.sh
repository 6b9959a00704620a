#!/usr/bin/env bash
# One device call: the int4 GPU tests (kernel, row chunks, the engine's exactness matrix on the
# Mosaic path, the dequant knob), then the int4 expert benchmark and its tile sweep.
source "$(dirname "$0")/device_env.sh"
timeout "${TEST_LIMIT:-240}" python3 -m pytest -q -x tests/test_expert_kernels.py tests/test_int4_kernel.py tests/test_moe.py \
  tests/runtime/test_exactness_matrix.py tests/runtime/test_dequant_knob.py 2>&1 | tail -15 \
  | tee "$OUT/gpu_tests_int4.txt"
timeout "${BENCH_LIMIT:-300}" python3 -m benchmarks.int4_experts --out "$OUT" 2>&1 \
  | grep -v "^W0" > "$OUT/int4_experts_log.txt"
grep -A14 "^| shape | variant" "$OUT/int4_experts.md"
grep -A24 "Tile sweep" "$OUT/int4_experts.md"
