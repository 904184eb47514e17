#!/usr/bin/env bash
# One device call on 1x H100 (<= 10 min): the pending single-GPU measurements of docs/perf.md.
#   run(kind="nvidia-h100-x1", carry=[".whl"], command="bash scripts/gpu/h100.sh")
# .whl: MINIMAL=1 BENCH=1 bash scripts/offline_wheels.sh .whl  (here, before the call)
# Writes at most 8 files to $OUT (the device tool's limit); each step has its own timeout.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
{ nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } | tee "$OUT/env.txt"
# 1. RMSNorm microbenchmark: Inductor defaults vs the guarded default vs coordinate descent
timeout 200 python3 scripts/bench_rmsnorm.py --variants eager,make_fx,regional,torch.compile,liger,quack \
    --inductor-configs default='{}' --inductor-configs guarded \
    --inductor-configs cdt='{"coordinate_descent_tuning":true,"coordinate_descent_check_all_directions":true}' \
    --json "$OUT/bench_rmsnorm.json" > "$OUT/bench_rmsnorm.md" 2>/tmp/bench.log; echo "bench rc=$?"; cat "$OUT/bench_rmsnorm.md"
# 2. fusion report of the 1B step (2 layers): full vs regional+rmsnorm vs none (+ mix_order_reduction off)
timeout 150 python3 scripts/fusion_report.py --config-file train_configs/llama3_1b.toml --layers 2 --steps 5 \
    --json "$OUT/fusion_report.json" > "$OUT/fusion_report.md" 2>/tmp/fusion.log; echo "fusion rc=$?"; cat "$OUT/fusion_report.md"
# 3. 1B, RMSNorm pass off vs on, alternating, 3 repeats
CONFIG_FILE=train_configs/llama3_1b.toml timeout 230 python3 scripts/compare_mfu.py --a-flags "" \
    --b-flags "--compile.numerics_changing_optim" --a-label "pass off" --b-label "RMSNorm pass on" \
    --repeats 3 --steps 20 --warmup 3 --run-timeout 70 --out /tmp/cmp1b > "$OUT/compare_1b.log" 2>&1
echo "compare rc=$?"; tail -25 "$OUT/compare_1b.log"; cp /tmp/cmp1b/*.png "$OUT/" 2>/dev/null
