#!/usr/bin/env bash
# One device call on 1x H200 (<= 5 min): the 1B plain command against jit (a validation row of
# the scale projection on a second device kind).
#   run(kind="nvidia-h200", carry=[".whl"], command="bash scripts/gpu/h200_1b.sh")
set -uo pipefail
source "$(dirname "$0")/setup.sh"   # wheels, PYTHONPATH, env, $OUT
{ nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } | tee "$OUT/env.txt"
CONFIG_FILE=train_configs/llama3_1b.toml timeout 330 python3 scripts/compare_mfu.py --a-flags "--compile.mode jit" \
    --b-flags "" --a-label "jit" --b-label "traced, plain command" \
    --repeats 2 --steps 12 --warmup 3 --run-timeout 75 --out /tmp/cmp1b > "$OUT/cmp1b.log" 2>&1
echo "cmp1b rc=$?"; cp /tmp/cmp1b/comparison.json "$OUT/" 2>/dev/null
grep -h "ok in\|FAILED\|^|" "$OUT/cmp1b.log"
