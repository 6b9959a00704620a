#!/usr/bin/env bash
# One device call (session 10): Nsight Compute with per-instruction stall sampling (SASS) on one
# Qwen3 and one Mixtral layer of the int4 kernels (tuned tiles, stream-K for Qwen3): where the
# compute warps wait. Reports and the SASS tables come back under $OUT.
source "$(dirname "$0")/device_env.sh"
for shape in "qwen3 stream_k=1 ctas_per_sm=3 up_splits=1" "mixtral"; do
  name=${shape%% *}
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${NCU_LIMIT:-150}" ncu --clock-control none \
    -k regex:int4_ --launch-count 2 --section SpeedOfLight --section WarpStateStats \
    --section SourceCounters --section Occupancy --section SchedulerStats -o "$OUT/ncu_$name" \
    python3 benchmarks/exploration/int4_ncu.py $shape > "$OUT/ncu_${name}_log.txt" 2>&1
  ncu -i "$OUT/ncu_$name.ncu-rep" --page details > "$OUT/ncu_${name}_details.txt" 2>&1
  ncu -i "$OUT/ncu_$name.ncu-rep" --page source --print-source sass --csv \
    > "$OUT/ncu_${name}_sass.csv" 2>&1
  grep -E "int4_.*Context|Duration|DRAM Throughput|SM Active|Registers Per|Achieved Occ" \
    "$OUT/ncu_${name}_details.txt"
  wc -c "$OUT/ncu_${name}_sass.csv"
done
