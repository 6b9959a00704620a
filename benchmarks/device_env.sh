# Sourced by the run_h200*.sh scripts: strict mode, unbuffered output, $OUT, and the import
# path (the runtime package is installed as `strata_runtime`; a device call runs from the tree).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mkdir -p /tmp/sp && ln -sfn "$PWD/runtime" /tmp/sp/strata_runtime
export PYTHONPATH="$PWD:/tmp/sp"
