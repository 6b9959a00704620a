#!/usr/bin/env bash
# One device call: host int4 -> bf16 dequantization GB/s on 1, 8 and 16 threads.
source benchmarks/device_env.sh
timeout 80 python3 -c "
import json, os
from benchmarks.int4_experts import host_dequant
rows = [host_dequant(t) for t in (1, 8, 16)]
print(json.dumps(rows))
json.dump(rows, open(os.environ['OUT'] + '/host_dequant.json', 'w'), indent=1)
" 2>&1 | grep -v "^W0" | tail -3
