#!/usr/bin/env bash
# The GPU run script: one device call, ~9 min (GPU tests ~4, step rows ~5). First the GPU tests
# of the step, the engine and the expert kernels (under a timeout, into $OUT/gpu_tests.txt);
# then issue 17's H200 benchmark of the one-program decode step (benchmarks/step_decode.py) on
# the synthetic Mixtral-8x7B shape, 8 layers, random weights generated on the GPU (no
# checkpoint). Bandwidths are measured first, in this call; then one process per row, most
# important first, each under `timeout` and all within BUDGET_S (counted from the start of the
# script, tests included), so one slow row cannot eat the call: the two ablation rows at the end
# are the first to go. Rows append to $OUT/step_decode.jsonl as they finish; the last step
# renders $OUT/step_decode.md. Log: $OUT/step_log.txt. The int4 kernel benchmark is not in this
# call (it takes 3-7 min alone): see benchmarks/README.md.
#   BUDGET_S=560      seconds for the whole script (the device call allows 600)
#   TEST_LIMIT=240    seconds for the GPU tests; TEST_LIMIT=0 skips them
#   TESTS_K=...       pytest -k filter. Default: every test of the four files except the Mosaic
#                     kernel's GPU sweep over 16 tile settings x 2 shapes, of which the default
#                     tiles (tiles0) and the two stream-K settings (tiles14, tiles15) run (the
#                     whole sweep takes ~4 min alone: TESTS_K= runs it, with a larger TEST_LIMIT)
#   STEP_ARGS=...     extra arguments for every row (default: at most 64 timed steps, ~5 s/pass)
#   JAX_CACHE=0       no persistent compilation cache (shared by the row processes)
#   PARTS="tests step disk"  which parts run: the GPU tests, the step rows, the disk-tier row
#                     (benchmarks/disk_tier.py: a synthetic checkpoint written to local disk,
#                     decoded through the engine with half of the experts in tier 1)
#   DISK_ARGS=...     extra arguments for the disk-tier row
#   "ladder" in PARTS  issue 20: `strata sweep sweeps/seed_ladder.toml` (its checkpoints written
#                     first, ~35 + 17 GB under /tmp) with --resume from the rows already in
#                     benchmarks/results/seed_ladder/, then the accelerate peer on the same
#                     shape and budget (benchmarks/peer_accelerate.py; PEER=0 skips it); LADDER_S
#                     caps the sweep (default: what is left of BUDGET_S); RUNGS="a|b" runs
#                     only those rungs; FRESH=1: none of the committed rows (every rung runs
#                     again: the machine keeps its own rows, so a later call resumes them).
#                     Rows and checkpoints
#                     stay under /tmp of a warm machine, so the next call resumes.
#                     "ladder-repeat" in PARTS: first the repeat check on the ladder's
#                     checkpoint (every expert in HBM, then the naive rung's budgets)
#   "repeat" in PARTS  benchmarks/repeat_check.py: same tokens on every repeat of one engine?
#                     (as is, then with --xla_gpu_deterministic_ops)
#   "processes" in PARTS  the same tokens in fresh processes? One engine on the ladder's int4
#                     checkpoint (PROC_CKPT), `strata bench` in PROC_RUNS (2) processes per
#                     XLA_FLAGS in PROC_FLAGS ('|'-separated; "none": as is; "cache": as is,
#                     sharing one new persistent compilation cache), each cut at PROC_S (150);
#                     each process's token hash into $OUT/processes.jsonl
#   "exact" in PARTS   the offloaded prefill against resident on the ladder's checkpoint, every
#                     step's logits, once per XLA_FLAGS in EXACT_FLAGS ('|'-separated; "none":
#                     as is; DUMP: also dump the prefill programs' optimized HLO), each run cut
#                     at EXACT_S (240) seconds; EXACT_ENGINES: repeat_check.py's engine names,
#                     EXACT_ARGS: more of its flags (--check-tiers)
#   "ledger-compile" in PARTS  benchmarks/ledger_compile.py on the checkpoint of "exact": the
#                     ledger's three compiles one after another against on threads (LEDGER_S)
#   "pinned" in PARTS  benchmarks/pinned_put_probe.py: programs over pinned host memory right
#                     after an unwaited device_put (PINNED_ARGS)
#   "flags" in PARTS  issue 17: the step rows FLAG_ROWS (int4-8g,resident-bf16) at FLAG_BATCH (1)
#                     once per XLA_FLAGS in STEP_FLAGS ('|'-separated; "none": as is), with no
#                     compilation cache; each row's machine.xla_flags says which (e.g. XLA's
#                     command buffers off, or with loops and conditionals in them)
#   "hybrid" in PARTS  issue 19: the host expert kernel against a plain read
#                     (benchmarks/host_kernels.py), then the bf16 8 GiB rows with every miss
#                     remedy (fetch / host / auto), B=1 checked against resident (HYBRID_ARGS;
#                     KERNEL_ARGS for host_kernels, MISS_B1 / MISS_B16 the remedies of each
#                     batch, MISS_INT4 adds the int4 3 GiB B=1 row with those remedies;
#                     MISS_RATES: the B=16 row once per split-rate setting, e.g. "at-once
#                     alone"; KERNEL_FORMATS: the host kernel's tier formats, e.g. "bf16 int4")
source "$(dirname "$0")/device_env.sh"
BUDGET_S=${BUDGET_S:-560}
TEST_LIMIT=${TEST_LIMIT:-240}
TESTS_K=${TESTS_K-"not mosaic_kernel_on_gpu or tiles0- or tiles14 or tiles15"}
STEP_ARGS=${STEP_ARGS:-"--steps 64 --seconds-per-pass 5"}
PARTS=${PARTS:-"tests step disk"}
DISK_ARGS=${DISK_ARGS:-"--batch 1,16 --check"}
HEAD="$(git rev-parse --short HEAD 2>/dev/null || echo '(no git)') $(date -Is)"
GPU=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null)

if ((TEST_LIMIT > 0)) && [[ $PARTS == *tests* ]]; then
  {
    echo "# GPU tests at $HEAD on $GPU (-k '$TESTS_K', limit ${TEST_LIMIT}s)"
    timeout -k 10 "$TEST_LIMIT" python3 -m pytest -q -p no:warnings -rfE ${TEST_FILES:-tests/step/test_step.py \
      tests/step/test_sampling.py tests/runtime/engine/test_engine.py tests/ops/test_expert_kernels.py tests/ops/test_int4_kernel.py} \
      ${TESTS_K:+-k "$TESTS_K"} 2>&1 | grep -v "^[WI]0" | tail -25 | cut -c1-400
    rc=${PIPESTATUS[0]}
    ((rc == 124 || rc == 137)) && echo "   tests timed out after ${TEST_LIMIT}s"
    echo "tests done at t=${SECONDS}s (exit status $rc)"
  } 2>&1 | tee "$OUT/gpu_tests.txt"
fi

if [[ ${JAX_CACHE:-1} != 0 ]]; then
  export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/strata_step_jax_cache}
fi
exec > >(tee -a "$OUT/step_log.txt") 2>&1
echo "step_decode $HEAD (t=${SECONDS}s)"
echo "$GPU"

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

if [[ $PARTS == *step* ]]; then
  echo "== t=${SECONDS}s: bandwidths"
  timeout 90 python3 -m benchmarks.step_decode --measure --out "$OUT" 2>&1 | grep -v "^[WI]0"
  bench 90 --rows resident-bf16 --batch 1,16
  bench 75 --rows int4-8g --batch 1,16      # int4 fits 8 GiB whole: the resident int4 program
  bench 60 --rows int4-3g --batch 1         # int4 rows are checked bit for bit against resident
  bench 60 --rows int4-3g --batch 16
  bench 75 --rows bf16-8g --batch 1
  bench 75 --rows bf16-8g --batch 16
  bench 60 --rows int4-1.5g --batch 16
  # ablations, if time is left: the sampler's cost (sort of the logits) on the fastest row, and
  # the offloaded unrolled program against the rolled resident one, bit for bit
  bench 60 --rows int4-8g --batch 1,16 --sample
  bench 60 --rows int4-3g --batch 16 --check-unroll off --predictors next-gate
  python3 -m benchmarks.step_decode --report --out "$OUT" 2>&1 | grep -v "^[WI]0"
fi
if [[ $PARTS == *flags* ]]; then
  IFS='|' read -ra variants <<< "${STEP_FLAGS:-none|--xla_gpu_enable_command_buffer=}"
  for v in "${variants[@]}"; do
    echo "== t=${SECONDS}s: XLA_FLAGS=${v//none/}"
    XLA_FLAGS="${v//none/}" JAX_COMPILATION_CACHE_DIR= bench 100 --rows "${FLAG_ROWS:-int4-8g,resident-bf16}" \
      --batch "${FLAG_BATCH:-1}" ${FLAG_ARGS:-}
  done
  python3 -m benchmarks.step_decode --report --out "$OUT" 2>&1 | grep -v "^[WI]0"
fi
if [[ $PARTS == *hybrid* ]]; then
  echo "== t=${SECONDS}s: host kernels"
  for fmt in ${KERNEL_FORMATS:-bf16}; do
    timeout -k 10 120 python3 -m benchmarks.host_kernels --out "$OUT" --format "$fmt" \
      ${KERNEL_ARGS:-} 2>&1 | grep -v "^[WI]0"
  done
  bench 200 --rows bf16-8g --batch 1 --predictors none --miss ${MISS_B1:-fetch,host,auto} \
    --check always ${HYBRID_ARGS:-}
  for rates in ${MISS_RATES:-at-once}; do  # the split's rates: at-once, alone or fixed
    bench 200 --rows bf16-8g --batch 16 --predictors none --miss ${MISS_B16:-fetch,host,auto} \
      --miss-rates "$rates" ${HYBRID_ARGS:-}
  done
  [[ -n ${MISS_INT4:-} ]] && bench 150 --rows int4-3g --batch 1 --predictors none \
    --miss "$MISS_INT4" ${HYBRID_ARGS:-}
  python3 -m benchmarks.step_decode --report --out "$OUT" 2>&1 | grep -v "^[WI]0"
fi
if [[ $PARTS == *ladder* ]]; then
  # The rows live on the device's disk beside the checkpoints, so the next call of a warm machine
  # resumes from them; a fresh machine starts from the rows committed in the repo.
  ROWS=/tmp/strata_ladder_rows; mkdir -p "$ROWS" "$OUT/seed_ladder"
  [[ ${FRESH:-0} == 1 && ! -f $ROWS/.fresh ]] && rm -f "$ROWS/sweep.jsonl" && touch "$ROWS/.fresh"
  [[ ! -f $ROWS/sweep.jsonl && ! -f $ROWS/.fresh && -f benchmarks/results/seed_ladder/sweep.jsonl ]] \
    && cp benchmarks/results/seed_ladder/sweep.jsonl "$ROWS/"
  if [[ $PARTS == *ladder-repeat* ]]; then  # the repeat check on the ladder's own checkpoint
    echo "== t=${SECONDS}s: ladder checkpoints, then the repeat check on them"
    python3 -m strata_runtime.cli sweep sweeps/seed_ladder.toml --prepare-only 2>&1 | tail -3
    timeout -k 10 240 python3 -m benchmarks.repeat_check --out "$OUT" \
      --checkpoint /tmp/strata_seed6_bf16 --prompts 2 --prompt-len 32 --new 16 --batch 1 \
      2>&1 | grep -v "^[WI]0"
  fi
  LADDER_RUNGS=(); IFS='|' read -ra names <<< "${RUNGS:-}"  # RUNGS="a|b": only these rungs
  for n in "${names[@]}"; do LADDER_RUNGS+=(--rung "$n"); done
  cap=$((BUDGET_S - SECONDS - 15)); cap=$((${LADDER_S:-$cap} < cap ? ${LADDER_S:-$cap} : cap))
  echo "== t=${SECONDS}s: seed ladder (cap ${cap}s)"
  timeout -k 10 "$cap" python3 -m strata_runtime.cli sweep sweeps/seed_ladder.toml \
    --out "$ROWS" --resume "${LADDER_RUNGS[@]}" 2>&1 | grep -v "^[WI]0" | tail -40
  cp -r "$ROWS/." "$OUT/seed_ladder/"
  left=$((BUDGET_S - SECONDS - 10))
  if ((left < 60)) || [[ ${PEER:-1} == 0 ]]; then echo "== skipped (t=${SECONDS}s, PEER=${PEER:-1}): accelerate peer"
  else
    echo "== t=${SECONDS}s, timeout ${left}s: accelerate peer"
    timeout -k 10 "$left" python3 -m benchmarks.peer_accelerate --shape seed-125b --layers 6 \
      --budget 24GB --batch 1,16 --out "$OUT" 2>&1 | grep -v "^[WI]0"
  fi
fi
if [[ $PARTS == *repeat* ]]; then  # do repeats of one engine give the same tokens on the GPU?
  echo "== t=${SECONDS}s: repeat check"
  timeout -k 10 150 python3 -m benchmarks.repeat_check --out "$OUT" 2>&1 | grep -v "^[WI]0"
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_deterministic_ops=true" timeout -k 10 150 \
    python3 -m benchmarks.repeat_check --out "$OUT" 2>&1 | grep -v "^[WI]0"
fi
if [[ $PARTS == *processes* ]]; then  # docs/design.md, "Disk stalls": across processes
  echo "== t=${SECONDS}s: one engine in fresh processes"
  [[ -z ${PROC_CKPT:-} ]] && python3 -m strata_runtime.cli sweep sweeps/seed_ladder.toml \
    --prepare-only 2>&1 | tail -3
  IFS='|' read -ra variants <<< "${PROC_FLAGS:-none|--xla_gpu_autotune_level=0|cache}"
  rm -rf /tmp/strata_proc_cache
  for v in "${variants[@]}"; do
    cache=(env -u JAX_COMPILATION_CACHE_DIR STRATA_COMPILE_CACHE=off)
    [[ $v == cache ]] && cache=(env -u JAX_COMPILATION_CACHE_DIR STRATA_COMPILE_CACHE=/tmp/strata_proc_cache)
    flags=${v//none/}; flags=${flags//cache/}
    for run in $(seq "${PROC_RUNS:-2}"); do
      echo "== t=${SECONDS}s: XLA_FLAGS='$flags' ($v), process $run"
      rm -f /tmp/strata_proc.jsonl
      XLA_FLAGS="$flags" timeout -k 5 "${PROC_S:-150}" "${cache[@]}" python3 -m strata_runtime.cli \
        bench "${PROC_CKPT:-/tmp/strata_seed6_int4}" --hbm 24GB --batch-capacity 16 --max-len 128 \
        --prompts 16 --prompt-len 32 --new 16 --warmup-new 4 --repeats 1 --seed 0 \
        --json-out /tmp/strata_proc.jsonl 2>&1 | grep -E "^cost model|tok/s \[" | cut -c1-200
      python3 -c "import json, sys; r = json.loads(open('/tmp/strata_proc.jsonl').read().splitlines()[-1])
print(json.dumps(dict(variant=sys.argv[1], run=int(sys.argv[2]), tokens_sha256=r['tokens_sha256'],
      decode_tok_s=r['decode_tok_s']['median'])))" "$v" "$run" | tee -a "$OUT/processes.jsonl"
    done
  done
fi
if [[ $PARTS == *exact* ]]; then  # the GPU prefill defect (docs/design.md, "Disk stalls")
  ckpt=/tmp/strata_seed6_bf16
  [[ -f $ckpt/config.json ]] || python3 -c "from strata_jax import synth; synth.synthesize(
    'seed-125b', '$ckpt', layers=6, skew=0.7, seed=0, dtype='bfloat16', progress=False)"
  A="--checkpoint $ckpt --prompts 2 --prompt-len 32 --new 4 --batch 2 --logits --repeats 1"
  A="$A --engines ${EXACT_ENGINES:-resident,ladder-no-disk} ${EXACT_ARGS:-}"
  EXACT_FLAGS=${EXACT_FLAGS:-"none|--xla_gpu_autotune_level=0"}
  IFS='|' read -ra variants <<< "$EXACT_FLAGS"
  for v in "${variants[@]}"; do  # XLA_FLAGS of each run ("none": as is; DUMP in it: HLO dump)
    flags=${v//none/}
    if [[ $flags == *DUMP* ]]; then mkdir -p /tmp/hlo && flags="${flags//DUMP/} --xla_dump_to=/tmp/hlo \
--xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*prefill.*"; fi
    echo "== t=${SECONDS}s: exactness of the offloaded prefill (XLA_FLAGS=$flags)"
    XLA_FLAGS="$flags" timeout -k 5 "${EXACT_S:-240}" python3 -m benchmarks.repeat_check --out "$OUT" $A \
      2>&1 | grep -v "^[WI]0" | cut -c1-900
  done
  if [[ -d /tmp/hlo ]]; then
    tar czf "$OUT/hlo_prefill.tgz" -C /tmp/hlo $(cd /tmp/hlo && ls | grep after_optimizations.txt)
  fi
fi
if [[ $PARTS == *ledger-compile* ]]; then
  # the ledger's compiles one after another against side by side, on the ladder's checkpoint
  echo "== t=${SECONDS}s: ledger compiles"
  timeout -k 5 "${LEDGER_S:-150}" python3 -m benchmarks.ledger_compile --out "$OUT" \
    --checkpoint /tmp/strata_seed6_bf16 --max-len 128 --batch 8 2>&1 | grep -v "^[WI]0"
fi
if [[ $PARTS == *pinned* ]]; then  # does a program see an unwaited put into pinned host memory?
  echo "== t=${SECONDS}s: pinned put probe"
  timeout -k 5 120 python3 -m benchmarks.pinned_put_probe --out "$OUT" ${PINNED_ARGS:-} 2>&1 \
    | grep -v "^[WI]0"
fi
if [[ $PARTS == *disk* ]]; then
  left=$((BUDGET_S - SECONDS - 10))
  echo "== t=${SECONDS}s, timeout ${left}s: disk tier $DISK_ARGS"
  timeout -k 10 "$left" python3 -m benchmarks.disk_tier --out "$OUT" $DISK_ARGS 2>&1 \
    | grep -v "^[WI]0"
fi
echo "done at t=${SECONDS}s"
