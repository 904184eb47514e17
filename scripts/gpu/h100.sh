#!/usr/bin/env bash
# One device call on 1x H100 (<= 10 min): the single-GPU runs under "Not measured yet" in docs/perf_archive.md.
#   run(kind="nvidia-h100-x1", carry=[".whl"], command="bash scripts/gpu/h100.sh")
# .whl: MINIMAL=1 BENCH=1 bash scripts/offline_wheels.sh .whl  (here, before the call)
# Writes at most 8 files to $OUT (the device tool's limit); each step has its own timeout.
set -uo pipefail
source "$(dirname "$0")/setup.sh"   # wheels, PYTHONPATH, env, $OUT
{ nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } | tee "$OUT/env.txt"
# 1. the RMSNorm table: Inductor defaults and the timed split-size pick (--compile.rmsnorm.tune) next to torch.compile
timeout 200 python3 scripts/bench_rmsnorm.py --variants eager,make_fx,regional,torch.compile \
    --shapes 32768x4096,16384x8192,65536x2048 --inductor-configs default='{}' --inductor-configs guarded \
    --json "$OUT/rmsnorm.json" > "$OUT/rmsnorm.md" 2>&1
echo "rmsnorm rc=$?"; cat "$OUT/rmsnorm.md"
# 2. 1B RMSNorm pass off vs on with the timed pick, 3 alternating repeats
CONFIG_FILE=train_configs/llama3_1b.toml timeout 340 python3 scripts/compare_mfu.py --a-flags "" \
    --b-flags "--compile.numerics_changing_optim" --a-label "pass off" --b-label "RMSNorm pass on" \
    --repeats 3 --steps 15 --warmup 3 --run-timeout 70 --out /tmp/cmp1b > "$OUT/cmp1b.log" 2>&1
echo "cmp1b rc=$?"; cp /tmp/cmp1b/comparison.json /tmp/cmp1b/tps_per_step.png "$OUT/" 2>/dev/null
grep -h "ok in\|FAILED\|^|" "$OUT/cmp1b.log"
