#!/usr/bin/env bash
# One device call (session 8): the read floor at the int4 kernels' sizes, then Nsight Compute on
# one Qwen3 and one Mixtral layer of the int4 kernels with the float16 conversion.
source "$(dirname "$0")/device_env.sh"
timeout "${FLOOR_LIMIT:-90}" python3 benchmarks/exploration/read_floor.py 2>&1 | grep -v "^W0" \
  | tee "$OUT/read_floor.txt"
for shape in "qwen3 f16=1" "mixtral f16=1 fold_lag=0"; do
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${NCU_LIMIT:-80}" ncu --clock-control none \
    -k regex:int4_ --launch-count 2 --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section WarpStateStats --section SchedulerStats \
    python3 benchmarks/exploration/int4_ncu.py $shape > "$OUT/ncu_${shape%% *}.txt" 2>&1
  grep -E "int4_.*Context|Duration|DRAM Throughput|Registers Per|Issue Slots Busy|Theoretical Occ|Achieved Occ|Waves|Eligible Warps|Stall" \
    "$OUT/ncu_${shape%% *}.txt"
done
