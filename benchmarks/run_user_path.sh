#!/usr/bin/env bash
# Issue 48's device call: the user's path, `strata synth` -> `strata quantize` -> `strata bench`,
# on the synthetic Mixtral-8x7B shape with 8 layers (skew 0.7), in the parts of PARTS, each
# within BUDGET_S (seconds from the start of the script). Checkpoints stay under /tmp of a warm
# machine, so a later call skips "prep". Every bench row appends its JSON lines to
# $OUT/user_path.jsonl (each row's label in its `label`), its printed summary to the log.
#   PARTS="prep kernels"    prep: the three checkpoints (bf16; int4-rtn experts + int8 dense;
#                           int4-rtn experts + bf16 dense), in the background while the rest
#                           runs; kernels: the GPU tests of the int8 kernel and the step, and
#                           benchmarks/int8_dense.py (a diagnostic)
#   PARTS="rows"            the resident and offloaded decode rows, B=1 and B=16, int8 and bf16
#                           dense, the int8 rows also with STRATA_INT8_KERNEL=0 (XLA's path);
#                           then the step benchmark's int4 8 GiB B=1 row (the engine's cost)
#   PARTS="overhead"        benchmarks/engine_overhead.py at one row, resident, both checkpoints
#   PARTS="xlaflags"        the same, int8 checkpoint, under XLA's command-buffer flags (off,
#                           the smallest graph 1, while loops and conditionals captured)
#   PARTS="prefill"         a 2,048-token prompt: int4 3 GiB and bf16 8 GiB, the ledger's chunk
#                           and 64-token chunks (the old default)
#   PARTS="bfprefill"       the 2,048-token prompt, int4 + bf16 dense, HBM_OFF (one row)
#   PARTS="gemmab"          the same with STRATA_TRITON_GEMM=0 then 1 (cuBLAS against XLA's
#                           Triton GEMM fusions), after "exact16"
#   PARTS="processes"       the int4 3 GiB B=16 row in PROC_RUNS fresh processes without a
#                           compilation cache, then once with STRATA_XLA_AUTOTUNE=1
#   PARTS="gputests"        the GPU tests of the expert paths and the MLA kernel (beside prep)
#   PARTS="exact16"         bf16 dense + int4, B=16, resident and at HBM_OFF, fresh processes
#                           (tokens only): offloading must not change them
#   PARTS="pprofile"        benchmarks/prefill_profile.py: a 2K prompt's kernels, int8 dense, HBM_OFF
#   PARTS="prefill8k"       an 8,192-token prompt: int4+int8 at HBM_OFF, bf16 dense + int4 resident
#   PARTS="deepseek"        `strata synth --shape deepseek-v3 --layers DS_LAYERS` (3 dense layers
#                           + DS_LAYERS MoE layers of 256 experts), its int4-rtn + int8 copy, and
#                           its rows resident and offloaded at DS_HBM, B=1 and B=16
#   PARTS="mla"             benchmarks/mla_decode.py (the latent cache's read rate, a diagnostic)
source "$(dirname "$0")/device_env.sh"
BUDGET_S=${BUDGET_S:-570}
PARTS=${PARTS:-"prep kernels"}
LAYERS=${LAYERS:-8}  # fewer: a shorter "prep" (the bound scales with them)
CK=${CK:-/tmp/strata_mx$LAYERS}
HBM_OFF=${HBM_OFF:-3GiB}  # the offloaded rows' budget (1.5GiB at 4 layers)
exec > >(tee -a "$OUT/user_path_log.txt") 2>&1
echo "user path $(git rev-parse --short HEAD 2>/dev/null) $(date -Is) on" \
  "$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader)"
strata() { python3 -m strata_runtime.cli "$@"; }

prep() {  # QUANT_ONLY=i8 or bf: that copy alone (a shorter preparation)
  [[ -f $CK/config.json ]] || strata synth --shape mixtral-8x7b --layers "$LAYERS" --skew 0.7 "$CK"
  [[ ${QUANT_ONLY:-} == bf || -f ${CK}_i8/config.json ]] || \
    strata quantize "$CK" "${CK}_i8" --experts int4-rtn --dense int8
  [[ ${QUANT_ONLY:-} == i8 || -f ${CK}_bf/config.json ]] || \
    strata quantize "$CK" "${CK}_bf" --experts int4-rtn --dense none
  echo "prep done at t=${SECONDS}s"; ls -d "$CK"*
}

row() {  # LABEL LIMIT_S CKPT ARGS...: one `strata bench` process
  local label=$1 want=$2 ckpt=$3; shift 3
  local left=$((BUDGET_S - SECONDS - 10)); local limit=$((want < left ? want : left))
  if ((limit < 40)); then echo "== skipped, out of time (t=${SECONDS}s): $label"; return; fi
  echo "== t=${SECONDS}s, timeout ${limit}s: $label: strata bench $ckpt $*"
  rm -f /tmp/row.jsonl
  timeout -k 5 "$limit" python3 -m strata_runtime.cli bench "$ckpt" --json-out /tmp/row.jsonl \
    "$@" 2>&1 | grep -v "^[WI]0" | grep -vE "^repeat |interval: percentile" | cut -c1-300
  [[ -f /tmp/row.jsonl ]] && python3 -c "import json, sys
rows = [json.loads(l) for l in open('/tmp/row.jsonl')]
for r in rows: r['label'] = sys.argv[1]
open(sys.argv[2], 'a').write(''.join(json.dumps(r) + chr(10) for r in rows[-1:]))" \
    "$label" "$OUT/user_path.jsonl"
}

B1="--prompts 1 --prompt-len 32 --new 64 --batch-capacity 1 --max-len 128 --repeats 3"
B16="--prompts 16 --prompt-len 32 --new 32 --batch-capacity 16 --max-len 128 --repeats 3"
P2K="--prompts 1 --prompt-len 2048 --new 8 --batch-capacity 1 --max-len 2112 --repeats 2"

if [[ $PARTS == *prep* ]]; then
  prep > "$OUT/prep_log.txt" 2>&1 &
  PREP=$!
fi
if [[ $PARTS == *kernels* ]]; then
  echo "== t=${SECONDS}s: GPU tests"
  timeout -k 10 200 python3 -m pytest -q -p no:warnings -rfE tests/ops/test_int8_kernel.py \
    ${GPU_TESTS:-tests/step/test_step.py} 2>&1 | grep -v "^[WI]0" | tail -15 | cut -c1-300
  echo "== t=${SECONDS}s: int8 dense diagnostic"
  timeout -k 10 "${INT8_S:-240}" python3 -m benchmarks.int8_dense --out "$OUT" 2>&1 \
    | grep -v "^[WI]0" | tail -60
fi
if [[ $PARTS == *gputests* ]]; then  # beside "prep" (no checkpoint needed)
  echo "== t=${SECONDS}s: GPU tests"
  timeout -k 10 "${TESTS_S:-240}" python3 -m pytest -q -p no:warnings -rfE tests/model/test_moe.py \
    tests/ops/test_expert_kernels.py tests/ops/test_mla_kernel.py ${MORE_TESTS:-} \
    2>&1 | grep -v "^[WI]0" | tail -15 | cut -c1-300
fi
if [[ -n ${PREP:-} ]]; then wait "$PREP"; cat "$OUT/prep_log.txt" | tail -5; fi
if [[ $PARTS == *overhead* ]]; then  # the engine against its own program at one row
  for ck in "${CK}_bf" "${CK}_i8"; do
    [[ -f $ck/config.json ]] || continue
    timeout -k 5 150 python3 -m benchmarks.engine_overhead "$ck" --out "$OUT" 2>&1 \
      | grep -v "^[WI]0" | head -75 | cut -c1-200
  done
fi
if [[ $PARTS == *xlaflags* ]]; then  # the engine at one row under XLA's command-buffer flags
  for flags in "" "--xla_gpu_enable_command_buffer=" "--xla_gpu_graph_min_graph_size=1" \
      "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"; do
    left=$((BUDGET_S - SECONDS - 10)); ((left < 50)) && break
    echo "== t=${SECONDS}s: XLA_FLAGS='$flags'"
    XLA_FLAGS="$flags" timeout -k 5 $((left < 120 ? left : 120)) python3 -m \
      benchmarks.engine_overhead "${CK}_i8" --new 64 --out "$OUT" 2>&1 \
      | grep -v "^[WI]0" | head -4 | cut -c1-200
  done
fi
if [[ $PARTS == *int8ab* || $PARTS == *rows* ]]; then
  row "int8+int4 resident B=1" 90 "${CK}_i8" $B1
  STRATA_INT8_KERNEL=0 row "int8+int4 resident B=1, XLA int8" 90 "${CK}_i8" $B1
fi
if [[ $PARTS == *short-prefill* ]]; then  # the int8 checkpoint only, offloaded and resident
  row "prefill 2K int4+int8 $HBM_OFF" 120 "${CK}_i8" $P2K --hbm "$HBM_OFF"
  row "prefill 2K int4+int8 resident" 120 "${CK}_i8" $P2K  # the same tokens as offloaded
fi
if [[ $PARTS == *bfprefill* ]]; then  # int4 + bf16 dense: the 2K prompt at HBM_OFF alone
  row "prefill 2K int4+bf16 $HBM_OFF" 120 "${CK}_bf" $P2K --hbm "$HBM_OFF"
fi
if [[ $PARTS == *short-processes* ]]; then
  for run in 1 2; do
    STRATA_COMPILE_CACHE=off row "int4+int8 $HBM_OFF B=16, fresh process $run" 120 "${CK}_i8" $B16 \
      --hbm "$HBM_OFF"
  done
fi
if [[ $PARTS == *rows* ]]; then
  row "bf16+int4 resident B=1" 90 "${CK}_bf" $B1
  row "int8+int4 resident B=16" 90 "${CK}_i8" $B16
  row "bf16+int4 resident B=16" 90 "${CK}_bf" $B16
  row "int8+int4 8GiB B=1" 90 "${CK}_i8" $B1 --hbm 8GiB
  if ((BUDGET_S - SECONDS > 150)); then  # the step benchmark beside the engine (a diagnostic)
    echo "== t=${SECONDS}s: step benchmark, int4 8 GiB B=1 (random bf16 dense, no engine)"
    timeout -k 5 60 python3 -m benchmarks.step_decode --measure --out "$OUT" 2>&1 | tail -2
    timeout -k 5 90 python3 -m benchmarks.step_decode --out "$OUT" --bandwidth \
      "$OUT/step_bandwidth.json" --steps 64 --seconds-per-pass 5 --rows int4-8g --batch 1 \
      2>&1 | grep -v "^[WI]0" | tail -4
  fi
fi
if [[ " $PARTS " == *" prefill "* ]]; then  # the word alone (not short-prefill)
  row "prefill 2K int4 $HBM_OFF" 120 "${CK}_bf" $P2K --hbm "$HBM_OFF"
  row "prefill 2K int4 $HBM_OFF chunk 64" 120 "${CK}_bf" $P2K --hbm "$HBM_OFF" --prefill-chunk 64
  row "prefill 2K bf16 8GiB" 150 "$CK" $P2K --hbm 8GiB
fi
if [[ " $PARTS " == *" processes "* ]]; then  # the word alone (not short-processes)
  for run in $(seq "${PROC_RUNS:-2}"); do
    STRATA_COMPILE_CACHE=off row "int4 $HBM_OFF B=16, fresh process $run" 150 "${CK}_bf" $B16 --hbm "$HBM_OFF"
  done
  STRATA_XLA_AUTOTUNE=1 STRATA_COMPILE_CACHE=off row "int4 $HBM_OFF B=16, autotuned" 150 "${CK}_bf" \
    $B16 --hbm "$HBM_OFF"
fi
if [[ $PARTS == *exact16* ]]; then
  STRATA_COMPILE_CACHE=off row "bf16+int4 resident B=16 (exact)" 120 "${CK}_bf" $B16 --repeats 1
  STRATA_COMPILE_CACHE=off row "bf16+int4 $HBM_OFF B=16 (exact)" 120 "${CK}_bf" $B16 --repeats 1 \
    --hbm "$HBM_OFF"
fi
if [[ $PARTS == *gemmab* ]]; then  # the 2K prompt, int4 + bf16 dense, XLA's Triton GEMMs or cuBLAS
  for tg in 0 1; do
    STRATA_TRITON_GEMM=$tg row "prefill 2K int4+bf16 $HBM_OFF, STRATA_TRITON_GEMM=$tg" 100 \
      "${CK}_bf" $P2K --hbm "$HBM_OFF"
  done
fi
if [[ $PARTS == *pprofile* ]]; then
  echo "== t=${SECONDS}s: prefill profile"
  left=$((BUDGET_S - SECONDS - 10))
  timeout -k 5 $((left < 150 ? left : 150)) python3 -m benchmarks.prefill_profile "${CK}_i8" --hbm "$HBM_OFF" --out "$OUT" \
    2>&1 | grep -v "^[WI]0" | tail -20 | cut -c1-200
fi
if [[ $PARTS == *prefill8k* ]]; then
  P8K="--prompts 1 --prompt-len 8192 --new 8 --batch-capacity 1 --max-len 8256 --repeats 2"
  row "prefill 8K int4+int8 $HBM_OFF" 150 "${CK}_i8" $P8K --hbm "$HBM_OFF"
  row "prefill 8K bf16+int4 resident" 150 "${CK}_bf" $P8K
fi
if [[ $PARTS == *deepseek* ]]; then
  DS=${DS:-/tmp/strata_ds${DS_LAYERS:-1}}
  [[ -f $DS/config.json ]] || strata synth --shape deepseek-v3 --layers "${DS_LAYERS:-1}" --skew 0.7 "$DS"
  [[ -f ${DS}_i8/config.json ]] || strata quantize "$DS" "${DS}_i8" --experts int4-rtn --dense int8
  echo "deepseek prep done at t=${SECONDS}s"; du -sh "$DS" "${DS}_i8"
  rm -rf "$DS"  # the bf16 copy: the disk holds one
  row "deepseek-v3 int4+int8 resident B=1" 120 "${DS}_i8" $B1
  row "deepseek-v3 int4+int8 ${DS_HBM:-8GiB} B=1" 120 "${DS}_i8" $B1 --hbm "${DS_HBM:-8GiB}"
  row "deepseek-v3 int4+int8 resident B=16" 120 "${DS}_i8" $B16
  STRATA_MLA_KERNEL=0 row "deepseek-v3 int4+int8 resident B=16, XLA MLA" 120 "${DS}_i8" $B16
  row "deepseek-v3 int4+int8 ${DS_HBM:-8GiB} B=16" 120 "${DS}_i8" $B16 --hbm "${DS_HBM:-8GiB}"
fi
if [[ $PARTS == *mla* ]]; then
  echo "== t=${SECONDS}s: MLA decode"
  timeout -k 5 "${MLA_S:-150}" python3 -m benchmarks.mla_decode --batch 1,16 --seq 4096,32768 --out "$OUT/mla_decode.jsonl" 2>&1 | grep -v "^[WI]0" | tail -30
fi
[[ -f $OUT/user_path.jsonl ]] && python3 -c "import json
for l in open('$OUT/user_path.jsonl'):
    r = json.loads(l); b = r['bound']
    print(f\"{r['label']:<40} tok/s {r['tok_s']['median']:8.1f}  decode {(r['decode_tok_s'] or {}).get('median', 0):8.1f}\"
          f\"  prefill {(r.get('prefill_tok_s') or {}).get('median', 0):8.1f}  bound {b['bound_tok_s']:8.1f}\"
          f\"  ratio {b['ratio']:.2f}  binds {b.get('binds')}  tokens {r['tokens_sha256'][:10]}\")"
echo "done at t=${SECONDS}s"
