#!/usr/bin/env bash
# One device call: the issue-4 offload benchmark. Synthetic Mixtral-8x7B shape, 8 layers, in
# /dev/shm (tier 2 is not read during decode: the host budget holds every expert), 8 GiB HBM,
# B=1 / B=16, bf16 and int4 (RTN) experts, uniform and 80/20 routing.
source "$(dirname "$0")/device_env.sh"
ROUTINGS=${ROUTINGS:-"uniform skew"}
KINDS=${KINDS:-"bf16 int4"}
SKEW_KINDS=${SKEW_KINDS:-$KINDS}  # int4 fits the budget whole: its skew rows can be skipped
# 80/20 is not reachable with 8 experts top-2 (top 20 % = 1.6 experts); 0.75 is near the cap
SKEW=${SKEW:-0.75}
STAGINGS=${STAGINGS:-"0 0/static 8"}  # 0 = the default (2 for bf16 Mixtral experts)
bench() {  # ckpt label batch [extra args]
  echo "== $2 B=$3 ${4:-} (t=$SECONDS s)"
  timeout 200 python3 -m benchmarks.offload_decode --ckpt "$1" --label "$2" --batch "$3" ${4:-} \
    --steps "$([[ $3 == 1 ]] && echo 32 || echo 10)" --warmup 12 --out "$OUT" 2>&1 \
    | grep -v "^W0" | tail -3
}
exec > >(tee -a "$OUT/log.txt") 2>&1
python3 -m benchmarks.offload_decode --measure --out "$OUT" 2>&1 | grep -v "^W0" | tail -1
for routing in $ROUTINGS; do
  src=/dev/shm/$routing
  [[ -d $src ]] || python3 -m strata_runtime.cli synth --shape mixtral-8x7b --layers 8 \
    $([[ $routing == skew ]] && echo --skew "$SKEW") "$src" 2>&1 | tail -1
  kinds=$KINDS; [[ $routing == skew ]] && kinds=$SKEW_KINDS
  for kind in $kinds; do
    ck=$src
    if [[ $kind == int4 ]]; then
      ck=/dev/shm/$routing-int4; t0=$SECONDS
      [[ -d $ck ]] || python3 -m strata_runtime.cli quantize "$src" "$ck" --experts int4-rtn \
        --dense int8 2>&1 | tail -1
      echo "quantize $((SECONDS - t0)) s"
    fi
    [[ " ${B1_KINDS-$KINDS} " == *" $kind "* ]] && bench "$ck" "$kind-$routing" 1
    # B=16 bf16 is PCIe-bound: fewer staging slots leave HBM to pinned experts. Entries are
    # STAGING[/POLICY]; staging 0 = the default (what one layer can need)
    for s in $([[ $kind == bf16 ]] && echo "$STAGINGS" || echo 0); do
      n=${s%%/*}; policy=$([[ $s == */* ]] && echo "--policy ${s#*/}")
      bench "$ck" "$kind-$routing" 16 "$([[ $n == 0 ]] || echo "--staging $n") $policy"
    done
  done
done
# ablations (ABLATIONS=none for none): no prediction (misses copied when the routing is known); int4 dequantized on the
# host (the write-up's path: bf16 slots, so the model no longer fits and experts move as bf16)
for a in ${ABLATIONS:-predictor-none host-dequant}; do
  case $a in
    predictor-none) bench /dev/shm/uniform bf16-uniform 1 "--predictor none" ;;
    host-dequant) [[ -d /dev/shm/uniform-int4 ]] && bench /dev/shm/uniform-int4 int4-uniform 1 \
      "--dequant host --host-dequant-cache 32GiB" ;;
  esac
done
python3 -m benchmarks.offload_decode --report --out "$OUT" 2>&1 | grep -v "^W0"
