#!/usr/bin/env bash
# One device call on 2x H200 (<= 10 min): Llama3 8B FSDP2, seq 8192, selective AC (issues 3, 7).
#   run(kind="nvidia-h200-x2", carry=[".whl"], command="bash scripts/gpu/h200x2.sh")
set -uo pipefail
source "$(dirname "$0")/setup.sh"   # wheels, PYTHONPATH, env, $OUT
export NGPU=2 CONFIG_FILE=train_configs/llama3_8b.toml
run() {  # name, timeout, flags...  (RUNS="name:timeout:flags;..." overrides the list below)
    local name=$1 t=$2 rc; shift 2
    timeout "$t" ./run_train.sh --training.steps ${STEPS:-12} --job.dump_folder "/tmp/r_$name" "$@" > "/tmp/$name.log" 2>&1
    rc=$?; [ $rc = 0 ] || { echo "### $name rc=$rc"; grep -v "^\[rank1\]" "/tmp/$name.log" | grep -m1 -A45 "Traceback";
        echo "--- last lines"; grep -v "^\[rank1\]" "/tmp/$name.log" | tail -12; } >> "$OUT/failed_tails.txt"  # the message
    { echo "### $name"; cat "/tmp/r_$name/metrics.jsonl" 2>/dev/null; } >> "$OUT/metrics_all.txt"
    for k in /tmp/r_$name/profile_traces/iteration_*/rank0_kernels.md; do  # --profiling.enable_profiling
        [ -f "$k" ] && { echo "### $name ($k)"; cat "$k"; } >> "$OUT/kernels_all.md"
    done
    echo "== $name rc=$rc $(grep -h '"summary"' /tmp/r_$name/metrics.jsonl 2>/dev/null | python3 -c '
import json,sys
for l in sys.stdin:
    s=json.loads(l)["summary"]; print("tps %.0f mfu %s mem %.1f GiB loss %.4f trace %.0fs compile %.0fs" % (s["tps"], s["mfu"], s["max_memory_gib"], s["final_loss"], s.get("trace_time_s") or 0, s.get("compile_time_s") or 0))')" | tee -a "$OUT/summary.txt"
}
if [ -n "${RUNS:-}" ]; then  # e.g. RUNS="traced_rms:120:--compile.numerics_changing_optim;jit2:130:--compile.mode jit"
    IFS=';' read -ra items <<< "$RUNS"
    for it in "${items[@]}"; do IFS=':' read -r n t f <<< "$it"; run "$n" "$t" $f; done
    exit 0
fi
# pending (docs/perf.md, "Not measured yet"), one call:
# (issue 6, another call) NGPU=2 CONFIG_FILE=train_configs/llama3_8b.toml timeout 560 python3 scripts/compare_mfu.py \
#     --a-flags "" --b-flags "--compile.numerics_changing_optim" --repeats 2 --steps 12 --run-timeout 130 --out $OUT/cmp8b
# RUNS="traced:100:;full:200:--compile.inductor_compilation full;pointwise:140:--compile.numerics_changing_optim --compile.pointwise_regions;jit:130:--compile.mode jit" bash scripts/gpu/h200x2.sh
# (2026-11-23, docs/perf.md: traced under op SAC is 0.96x jit, full-graph Inductor 0.957x; measured
#  with: traced, jit, traced_no_sac, traced_save_mm, eager; then sac_full, save_mm_full, save_mm_rms, fullac.)
# (2026-11-23, profiled: jit, traced, save_mm_full -> full-graph Inductor ran every collective
#  exposed, 176 ms/step: Inductor's reorder_for_peak_memory / reorder_for_locality undo the
#  overlap schedule.) pending: the same with the schedule pinned (--compile.pin_collectives),
#  and Inductor's own overlap scheduler instead.
# (calls 2-4, docs/perf.md: pinned full-graph Inductor + sac_save_matmuls 1.058-1.073x jit at
#  80.8 GiB; without reshard_after_forward 1.101x at 92.9 GiB; without AC 1.099x at 93.0 GiB.)
# pending (docs/perf.md "Not measured yet"): per-block bucketing of the FSDP collectives, and
# resharding only the first 8 blocks (73 parameters: the embedding + 9 per block) to buy the
# 2 GiB back. Predictions: bucketing +1-4 % tps, +1-2 GiB; first-8-blocks reshard with
# bucketing 1.09-1.11x jit at 89.5-91 GiB.
# (2026-11-23 third session, call 1, docs/perf.md: bucketed 1.094x jit at 82.0 GiB; bucketed +
#  first-8-blocks reshard 1.106x but 99.5 GiB, 8.6 GiB above the dry-run estimate.)
# call 2 predictions: bucketed again 1.07-1.11x at 82.0 GiB; profiled step 10: exposed
# communication < 40 ms (pinned, unbucketed: 67), matmul kernels <= 520 ms (unbucketed 544);
# bucket 18 (two blocks per collective): within +-1 % of bucket 9, +0.4-1 GiB.
# (call 2, docs/perf.md: bucketed 1.079x at 82.0 GiB, exposed communication 17.7 ms, matmuls
#  552 ms; bucket 18 1.091x at 84.9 GiB.) Then found on CPU: Inductor inlined the bucket copy-out
#  of pointwise-read members into their backward users, keeping each bucket alive next to the
#  copies (kept blocks cost 2x); fixed with the opaque unbucket_all_gather op.
# call 3 predictions (peak = measured bucketed peak + dry-run difference of the kept blocks):
#  bucket 18, last 12 blocks kept (reshard_first_params 181): 1.09-1.11x jit at <= 89.8 GiB;
#  bucket 9, last 18 blocks kept (reshard_first_params 127): 1.08-1.10x jit at <= 89.4 GiB.
# (call 3, docs/perf.md: bucket 18 + 12 kept blocks 1.105x jit at 86.8 GiB; bucket 9 + 18 kept
#  1.102x at 88.3 GiB: the target, once.)
# call 4 predictions: bucket 18 + 12 kept again 1.08-1.12x at 86.8 GiB; 16 kept
#  (reshard_first_params 145) at 86.8 + 4 x 0.41 = 88.4 GiB, tps within +-1 % of 12 kept.
# (call 4, docs/perf.md: 12 kept again 1.104x at 86.8 GiB; 16 kept 1.106x at 88.4 GiB.)
F="--compile.inductor_compilation full --compile.sac_save_matmuls"
run jit 110 --compile.mode jit
run b18_keep12 170 $F --compile.bucket_collectives 18 --compile.reshard_first_params 181
run b18_keep16 170 $F --compile.bucket_collectives 18 --compile.reshard_first_params 145
