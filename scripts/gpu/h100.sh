#!/usr/bin/env bash
# One device call on 1x H100 (<= 10 min): the single-GPU measurements of docs/perf.md.
#   run(kind="nvidia-h100-x1", carry=[".whl"], command="bash scripts/gpu/h100.sh")
# .whl: MINIMAL=1 BENCH=1 bash scripts/offline_wheels.sh .whl  (here, before the call)
# Writes at most 8 files to $OUT (the device tool's limit); each step has its own timeout.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
{ nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } | tee "$OUT/env.txt"
# 1. RMSNorm microbenchmark: Inductor defaults vs coordinate descent (compile cost in setup s), two shapes
timeout 220 python3 scripts/bench_rmsnorm.py --variants eager,make_fx,regional,torch.compile,quack \
    --shapes 32768x4096,16384x8192 --inductor-configs default='{}' \
    --inductor-configs cdt='{"coordinate_descent_tuning":true,"coordinate_descent_check_all_directions":true}' \
    --json "$OUT/bench_rmsnorm.json" > "$OUT/bench_rmsnorm.md" 2>/tmp/bench.log
rc=$?; echo "bench rc=$rc"; grep -h "ms,\|bandwidth" /tmp/bench.log; [ $rc = 0 ] || tail -20 /tmp/bench.log; cat "$OUT/bench_rmsnorm.md"
# 2. 1B, RMSNorm pass off vs on, alternating, 2 repeats (the fusion report ran 2026-11-22: docs/perf.md)
CONFIG_FILE=train_configs/llama3_1b.toml timeout 300 python3 scripts/compare_mfu.py --a-flags "" \
    --b-flags "--compile.numerics_changing_optim" --a-label "pass off" --b-label "RMSNorm pass on" \
    --repeats 2 --steps 20 --warmup 3 --run-timeout 100 --out /tmp/cmp1b > "$OUT/compare_1b.log" 2>&1
echo "compare rc=$?"; grep -h "ok in\|FAILED" "$OUT/compare_1b.log"; tail -15 "$OUT/compare_1b.log"; cp /tmp/cmp1b/*.png "$OUT/" 2>/dev/null
