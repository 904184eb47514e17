#!/usr/bin/env bash
# One device call on 1x H100 (<= 10 min): the single-GPU measurements still pending in docs/perf.md.
#   run(kind="nvidia-h100-x1", carry=[".whl"], command="bash scripts/gpu/h100.sh")
# .whl: MINIMAL=1 BENCH=1 bash scripts/offline_wheels.sh .whl  (here, before the call)
# Writes at most 8 files to $OUT (the device tool's limit); each step has its own timeout.
# (The RMSNorm benchmark, fusion report and 1B pass off/on ran 2026-11-22: docs/perf.md.)
set -uo pipefail
source "$(dirname "$0")/setup.sh"   # wheels, PYTHONPATH, env, $OUT
{ nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } | tee "$OUT/env.txt"
# (Determinism, its cost and the Inductor ablation ran 2026-11-22 night: docs/perf.md. The 1B
#  determinism pytest needs ~260 s, mostly two 18 GB checkpoint saves: scripts/gpu/h200x2_checks.sh det.)
# (2026-11-23, docs/perf.md: the split-size candidates, the timed pick twice, 1B pass off/on x3.)
# 1. the full RMSNorm table with the shipped default (timed split-size pick) next to torch.compile
timeout 200 python3 scripts/bench_rmsnorm.py --variants eager,make_fx,regional,torch.compile \
    --shapes 32768x4096,16384x8192,65536x2048 --inductor-configs default='{}' --inductor-configs guarded \
    --json "$OUT/rmsnorm.json" > "$OUT/rmsnorm.md" 2>&1
echo "rmsnorm rc=$?"; cat "$OUT/rmsnorm.md"
# 2. 1B RMSNorm pass off vs on with the timed pick (expected neutral: the guard keeps the defaults at M=8192)
CONFIG_FILE=train_configs/llama3_1b.toml timeout 340 python3 scripts/compare_mfu.py --a-flags "" \
    --b-flags "--compile.numerics_changing_optim" --a-label "pass off" --b-label "RMSNorm pass on" \
    --repeats 3 --steps 15 --warmup 3 --run-timeout 70 --out /tmp/cmp1b > "$OUT/cmp1b.log" 2>&1
echo "cmp1b rc=$?"; cp /tmp/cmp1b/comparison.json /tmp/cmp1b/tps_per_step.png "$OUT/" 2>/dev/null
grep -h "ok in\|FAILED\|^|" "$OUT/cmp1b.log"
