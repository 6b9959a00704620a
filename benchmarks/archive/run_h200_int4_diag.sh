#!/usr/bin/env bash
# One device call: the gate/up diag kernels (MODES, see exploration/int4_diag.py) with each
# kernel's registers from ptxas, then Nsight Compute on the library's two int4 kernels.
source "$(dirname "$0")/device_env.sh"
MODES=${MODES:-perm:64:2:2,perm0:64:2:2,permh:64:2:2,perm0_magic:64:2:2,perm0:64:3:2,twstream:64:2:2}
rm -rf /tmp/mdump && mkdir -p /tmp/mdump
MOSAIC_GPU_DUMP_TO=/tmp/mdump MOSAIC_GPU_DUMP_PTXAS=1 timeout "${DIAG_LIMIT:-200}" \
  python3 benchmarks/exploration/int4_diag.py "$MODES" 2>&1 | grep -v "^W0" | tee "$OUT/diag_log.txt"
grep -H "Used" /tmp/mdump/*.ptxas | sed 's|/tmp/mdump/||' | tee "$OUT/diag_registers.txt"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${NCU_LIMIT:-60}" ncu --clock-control none \
  -k regex:int4_ --launch-count 2 --section SpeedOfLight --section Occupancy \
  --section LaunchStats --section WarpStateStats --section SchedulerStats \
  --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section InstructionStats \
  python3 benchmarks/exploration/int4_ncu.py > "$OUT/int4_ncu.txt" 2>&1
grep -E "int4_.*Context|Duration|DRAM Throughput|Registers Per|Issue Slots Busy|Theoretical Occ" \
  "$OUT/int4_ncu.txt"
