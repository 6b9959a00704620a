#!/usr/bin/env bash
# One device call (~8 min): issue 17's H200 benchmark of the one-program decode step
# (benchmarks/step_decode.py) on the synthetic Mixtral-8x7B shape, 8 layers, random weights
# generated on the GPU (no checkpoint). Bandwidths are measured first, in this call; then one
# process per row, most important first, each under `timeout` and all within BUDGET_S, so one
# slow row cannot eat the call. Rows append to $OUT/step_decode.jsonl as they finish; the last
# step renders $OUT/step_decode.md. Log: $OUT/step_log.txt.
#   BUDGET_S=470      seconds for the whole script (the device call allows 600)
#   STEP_ARGS=...     extra arguments for every row (default: at most 64 timed steps, ~5 s/pass)
#   JAX_CACHE=0       no persistent compilation cache (shared by the row processes)
source "$(dirname "$0")/device_env.sh"
BUDGET_S=${BUDGET_S:-470}
STEP_ARGS=${STEP_ARGS:-"--steps 64 --seconds-per-pass 5"}
if [[ ${JAX_CACHE:-1} != 0 ]]; then
  export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/strata_step_jax_cache}
fi
exec > >(tee -a "$OUT/step_log.txt") 2>&1
echo "step_decode $(git rev-parse --short HEAD 2>/dev/null || echo '(no git)') $(date -Is)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null

bench() {  # LIMIT_S ARGS...: one row process, cut at LIMIT_S or what is left of BUDGET_S
  local want=$1; shift
  local left=$((BUDGET_S - SECONDS - 20))
  local limit=$((want < left ? want : left))
  if ((limit < 30)); then echo "== skipped, out of time (t=${SECONDS}s): $*"; return; fi
  echo "== t=${SECONDS}s, timeout ${limit}s: $*"
  timeout -k 10 "$limit" python3 -m benchmarks.step_decode --out "$OUT" \
    --bandwidth "$OUT/step_bandwidth.json" $STEP_ARGS "$@" 2>&1 | grep -v "^[WI]0"
  local rc=${PIPESTATUS[0]}
  ((rc == 124 || rc == 137)) && echo "   timed out after ${limit}s (rows above it were kept)"
  ((rc != 0 && rc != 124 && rc != 137)) && echo "   exit status $rc"
  return 0
}

echo "== t=${SECONDS}s: bandwidths"
timeout 90 python3 -m benchmarks.step_decode --measure --out "$OUT" 2>&1 | grep -v "^[WI]0"
bench 90 --rows resident-bf16 --batch 1,16
bench 75 --rows int4-8g --batch 1,16      # int4 fits 8 GiB whole: the resident int4 program
bench 60 --rows int4-3g --batch 1         # int4 rows are checked bit for bit against resident
bench 60 --rows int4-3g --batch 16
bench 75 --rows bf16-8g --batch 1
bench 75 --rows bf16-8g --batch 16
bench 60 --rows int4-1.5g --batch 16
# ablations, if time is left: 2 staging slots leave HBM to tier-0 experts at B=16
bench 50 --rows bf16-8g --batch 16 --staging 2 --predictors none
bench 50 --rows int4-3g --batch 16 --staging 2 --predictors none
python3 -m benchmarks.step_decode --report --out "$OUT" 2>&1 | grep -v "^[WI]0"
echo "done at t=${SECONDS}s"
