#!/usr/bin/env bash
# Llama3 8B on 4x H200 (when `status` lends nvidia-h200-x4), one device call per mode, each <= 10 min:
#   run(kind="nvidia-h200-x4", carry=[".whl"], command="bash scripts/gpu/h200x4.sh runs")
#   run(kind="nvidia-h200-x4", carry=[".whl"], command="bash scripts/gpu/h200x4.sh cmp_tp")
#   run(kind="nvidia-h200-x4", carry=[".whl"], command="bash scripts/gpu/h200x4.sh cmp_fsdp")
#   run(kind="nvidia-h200-x4", carry=[".whl"], command="bash scripts/gpu/h200x4.sh det")
# runs:     the seed command with NGPU=4 (FSDP2 x TP2, 20 steps), torchtitan's torch.compile of the
#           same layout, then FSDP4 traced and torch.compile (12 steps each).
# cmp_tp:   RMSNorm pass off vs on, FSDP2 x TP2, compare_mfu 3 repeats (alternating), with plot.
# cmp_fsdp: the same for FSDP4.
# det:      run-to-run bitwise with the pass on (FSDP2 x TP2, --debug.deterministic, 5 steps).
# .whl: MINIMAL=1 BENCH=1 bash scripts/offline_wheels.sh .whl  (here, before the call)
set -uo pipefail
source "$(dirname "$0")/setup.sh"   # wheels, PYTHONPATH, env, $OUT
export NGPU=4 MODULE=graph_trainer.llama3 CONFIG=graph_trainer_llama3_8b
SEED=(--dataloader.dataset c4_test --metrics.no-enable_tensorboard --profiler.no-enable_profiling --comm.trace_buf_size=0)
TP=(--parallelism.data_parallel_shard_degree=2 --parallelism.tensor_parallel_degree=2)
FSDP=(--parallelism.data_parallel_shard_degree=4 --parallelism.tensor_parallel_degree=1)
one() {  # name timeout steps flags...
    local name=$1 t=$2 steps=$3 rc; shift 3
    timeout "$t" ./run_train.sh "${SEED[@]}" --training.steps "$steps" --job.dump_folder "/tmp/r_$name" "$@" \
        > "/tmp/$name.log" 2>&1
    rc=$?; echo "== $name rc=$rc" | tee -a "$OUT/summary.txt"
    grep -h '"summary"' "/tmp/r_$name/metrics.jsonl" 2>/dev/null | cut -c1-420 | tee -a "$OUT/summary.txt"
    [ $rc = 0 ] || grep -v "^\[rank[123]\]" "/tmp/$name.log" | grep -m1 -A40 Traceback >> "$OUT/failed_tails.txt"
    { echo "### $name"; cat "/tmp/r_$name/metrics.jsonl" 2>/dev/null; } >> "$OUT/metrics_all.txt"
}
cmp() {  # name layout-flags...
    local name=$1; shift
    timeout 560 python3 scripts/compare_mfu.py --a-flags "" --b-flags "--compile.numerics_changing_optim" \
        --a-label "pass off" --b-label "RMSNorm pass on" --repeats 3 --steps 12 --warmup 3 --run-timeout 90 \
        --out "/tmp/$name" -- "${SEED[@]}" "$@" > "$OUT/$name.log" 2>&1
    echo "$name rc=$?"; cp "/tmp/$name/comparison.json" "/tmp/$name/tps_per_step.png" "$OUT/" 2>/dev/null
    grep -h "ok in\|FAILED\|^|" "$OUT/$name.log"
}
case "${1:-}" in
runs)
    one seed_tp 150 20 --compile.mode aot_fx_trace "${TP[@]}"   # the seed command, NGPU=4
    one jit_tp 130 12 --compile.mode jit "${TP[@]}"
    one traced_fsdp4 110 12 "${FSDP[@]}"
    one jit_fsdp4 120 12 --compile.mode jit "${FSDP[@]}"
    ;;
cmp_tp) cmp cmp_tp "${TP[@]}" ;;
cmp_fsdp) cmp cmp_fsdp "${FSDP[@]}" ;;
det)
    timeout 400 python3 scripts/loss_compare.py --steps 5 --assert-equal --run-timeout 190 \
        --a-flags "--debug.deterministic --compile.numerics_changing_optim" \
        --b-flags "--debug.deterministic --compile.numerics_changing_optim" \
        --a-label run1 --b-label run2 --out /tmp/det -- "${SEED[@]}" "${TP[@]}" > "$OUT/det.log" 2>&1
    echo "det rc=$?"; tail -25 "$OUT/det.log"
    ;;
*) echo "usage: $0 runs|cmp_tp|cmp_fsdp|det" >&2; exit 2 ;;
esac
