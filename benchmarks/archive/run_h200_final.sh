#!/usr/bin/env bash
# Short device call: GPU kernel tests, synth write rates, int4 kernel sweep.
source "$(dirname "$0")/device_env.sh"
python3 -m pytest -q tests/ops/test_expert_kernels.py 2>&1 | tail -2 | tee "$OUT/gpu_tests.txt"
python3 -m strata_runtime.cli synth --shape mixtral-8x7b --layers 8 /tmp/disk8 2>&1 | tail -1 \
  | tee "$OUT/synth_disk.txt"
rm -rf /tmp/disk8
python3 -m strata_runtime.cli synth --shape mixtral-8x7b --layers 8 /dev/shm/m8 2>&1 | tail -1 \
  | tee "$OUT/synth_shm.txt"
rm -rf /dev/shm/m8
python3 benchmarks/int4_experts.py --out "$OUT" 2>&1 | grep -v "^W0" | grep -E "^\||us/layer|total" | tail -30
