#!/usr/bin/env bash
# Two device calls on 2x H200 (each <= 10 min), the checks that are not throughput runs:
#   run(kind="nvidia-h200-x2", carry=[".whl"], command="bash scripts/gpu/h200x2_checks.sh det")
#   run(kind="nvidia-h200-x2", carry=[".whl"], command="bash scripts/gpu/h200x2_checks.sh cmp")
# det: 8B FSDP2 run-to-run bitwise (5 steps, --debug.deterministic, RMSNorm pass) and the
#      1B single-GPU determinism tests (pytest -k gpu_1b, on GPU 0 only).
# cmp: 8B FSDP2 RMSNorm pass off vs on (compare_mfu, 2 repeats, 20 steps, with plot); then
#      20-step eager FSDP2 (loss tracking against the traced runs) and TP2 in bf16.
set -uo pipefail
source "$(dirname "$0")/setup.sh"   # wheels, PYTHONPATH, env, $OUT
case "${1:-}" in
det)
    NGPU=2 CONFIG_FILE=train_configs/llama3_8b.toml timeout 300 python3 scripts/loss_compare.py --steps 5 \
        --a-flags "--debug.deterministic --compile.numerics_changing_optim" \
        --b-flags "--debug.deterministic --compile.numerics_changing_optim" \
        --a-label run1 --b-label run2 --assert-equal --run-timeout 145 --out /tmp/det8b > "$OUT/det8b.log" 2>&1
    echo "det8b rc=$?"; tail -25 "$OUT/det8b.log"
    CUDA_VISIBLE_DEVICES=0 timeout -s INT 270 python3 -m pytest -q -rA -x tests/test_determinism.py -k gpu_1b \
        > "$OUT/det1b.log" 2>&1
    echo "det1b rc=$?"; tail -5 "$OUT/det1b.log"
    ;;
cmp)
    NGPU=2 CONFIG_FILE=train_configs/llama3_8b.toml timeout 370 python3 scripts/compare_mfu.py --a-flags "" \
        --b-flags "--compile.numerics_changing_optim" --a-label "pass off" --b-label "RMSNorm pass on" \
        --repeats 2 --steps 20 --warmup 3 --run-timeout 100 --out /tmp/cmp8b > "$OUT/cmp8b.log" 2>&1
    echo "cmp8b rc=$?"; cp /tmp/cmp8b/comparison.json /tmp/cmp8b/tps_per_step.png "$OUT/"; grep -h "ok in\|FAILED\|^|" "$OUT/cmp8b.log"
    for r in "eager20:100:--compile.mode eager" "tp2:110:--parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 2"; do
        IFS=':' read -r n t f <<< "$r"
        NGPU=2 CONFIG_FILE=train_configs/llama3_8b.toml timeout "$t" ./run_train.sh --training.steps 20 \
            --job.dump_folder "/tmp/r_$n" $f > "/tmp/$n.log" 2>&1
        echo "$n rc=$?"; cp "/tmp/r_$n/metrics.jsonl" "$OUT/metrics_$n.jsonl" 2>/dev/null \
            || grep -v "^\[rank1\]" "/tmp/$n.log" | grep -m1 -A40 Traceback
        grep -h summary "/tmp/r_$n/metrics.jsonl" 2>/dev/null | cut -c1-400
    done
    ;;
*) echo "usage: $0 det|cmp" >&2; exit 2 ;;
esac
