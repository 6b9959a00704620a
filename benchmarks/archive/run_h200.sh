#!/usr/bin/env bash
# One device call: GPU kernel tests, synth write rate, resident decode, int4 kernels.
source "$(dirname "$0")/device_env.sh"
df -h /tmp /dev/shm | tee "$OUT/disk.txt"
python3 -m pytest -q tests/ops/test_expert_kernels.py 2>&1 | tail -5 | tee "$OUT/gpu_tests.txt"
if [[ "${SKIP_DISK:-0}" != 1 ]]; then
  python3 -m strata_runtime.cli synth --shape mixtral-8x7b --layers 8 /tmp/disk8 2>&1 | tail -1 \
    | tee "$OUT/synth_disk.txt"
  rm -rf /tmp/disk8
fi
python3 benchmarks/resident_decode.py --ckpt /dev/shm/m8 --out "$OUT" 2>&1 | grep -v "^W0" | tail -15
rm -rf /dev/shm/m8
python3 benchmarks/int4_experts.py --out "$OUT" 2>&1 | grep -v "^W0" | tail -30
