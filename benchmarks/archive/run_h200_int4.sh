#!/usr/bin/env bash
# The int4 GPU tests (kernel, row chunks, the engine's exactness matrix on the Mosaic path, the
# dequant knob), then the int4 expert benchmark and its tile sweep. Together they take longer
# than one 600 s device call (tests ~520 s, benchmark ~200 s): PART=tests or PART=bench runs one
# of them; TESTS narrows the tests. The tests fit two calls: TESTS=tests/ops/test_expert_kernels.py
# (~240 s), then the other four files (~280 s).
source "$(dirname "$0")/device_env.sh"
PART=${PART:-all}
TESTS=${TESTS:-tests/ops/test_expert_kernels.py tests/ops/test_int4_kernel.py tests/model/test_moe.py \
  tests/runtime/engine/test_exactness_matrix.py tests/runtime/engine/test_dequant_knob.py}
if [[ $PART != bench ]]; then
  # shellcheck disable=SC2086
  timeout "${TEST_LIMIT:-450}" python3 -m pytest -q -x -p no:warnings $TESTS 2>&1 | tail -15 \
    | tee "$OUT/gpu_tests_int4.txt"
fi
if [[ $PART != tests ]]; then
  # shellcheck disable=SC2086
  timeout "${BENCH_LIMIT:-300}" python3 -m benchmarks.int4_experts --out "$OUT" ${BENCH_ARGS:-} 2>&1 \
    | grep -v "^W0" > "$OUT/int4_experts_log.txt"
  grep -A18 "^| shape | variant" "$OUT/int4_experts.md"
  grep -A28 "Tile sweep" "$OUT/int4_experts.md"
fi
