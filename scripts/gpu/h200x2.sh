#!/usr/bin/env bash
# One device call on 2x H200 (<= 10 min): Llama3 8B FSDP2 (seq 8192, selective AC), one
# run_train.sh run per entry of RUNS, each with its own timeout.
#   run(kind="nvidia-h200-x2", carry=[".whl"], command="bash scripts/gpu/h200x2.sh")
#   run(kind="nvidia-h200-x2", carry=[".whl"], command='RUNS="jit:110:--compile.mode jit;full:200:--compile.inductor_compilation full" bash scripts/gpu/h200x2.sh')
# RUNS="name:timeout_s:flags;..." (flags without ';' or ':'); STEPS (default 12) steps per run;
# NGPU / CONFIG_FILE override the 8B FSDP2 default. Run from another tree (an older version of
# the project unpacked beside this one): cd OTHER && bash THIS/scripts/gpu/h200x2.sh.
# Writes to $OUT: summary.txt (one line per run), metrics_all.txt, failed_tails.txt,
# kernels_all.md (runs with --profiling.enable_profiling). With COMM_MODE=fake_collectives every
# run is rank 0 of NGPU ranks in one process on one GPU (any one-GPU kind), e.g. the 70B:
#   COMM_MODE=fake_collectives NGPU=64 STEPS=8 RUNS="r70b:560:--model.flavor 70B
#     --parallelism.data_parallel_shard_degree 8 --parallelism.tensor_parallel_degree 8" bash scripts/gpu/h200x2.sh
set -uo pipefail
source "$(dirname "$0")/setup.sh"   # wheels, PYTHONPATH, env, $OUT
export NGPU=${NGPU:-2} CONFIG_FILE=${CONFIG_FILE:-train_configs/llama3_8b.toml}
run() {  # name, timeout, flags...
    local name=$1 t=$2 rc; shift 2
    timeout "$t" ./run_train.sh --training.steps ${STEPS:-12} --job.dump_folder "/tmp/r_$name" "$@" > "/tmp/$name.log" 2>&1
    rc=$?; [ $rc = 0 ] || { echo "### $name rc=$rc"; grep -v "^\[rank1\]" "/tmp/$name.log" | grep -m1 -A45 "Traceback";
        echo "--- last lines"; grep -v "^\[rank1\]" "/tmp/$name.log" | tail -12; } >> "$OUT/failed_tails.txt"
    { echo "### $name"; cat "/tmp/r_$name/metrics.jsonl" 2>/dev/null; } >> "$OUT/metrics_all.txt"
    for k in /tmp/r_$name/profile_traces/iteration_*/rank0_kernels.md; do
        [ -f "$k" ] && { echo "### $name ($k)"; cat "$k"; } >> "$OUT/kernels_all.md"
    done
    echo "== $name rc=$rc $(grep -h '"summary"' /tmp/r_$name/metrics.jsonl 2>/dev/null | python3 -c '
import json,sys
for l in sys.stdin:
    s=json.loads(l)["summary"]; print("tps %.0f mfu %s mem %.1f GiB (alloc %s, predicted %s) loss %.4f trace %.0fs compile %.0fs %s" % (s["tps"], s["mfu"], s["max_memory_gib"], s.get("max_memory_allocated_gib"), s.get("predicted_peak_gib"), s["final_loss"], s.get("trace_time_s") or 0, s.get("compile_time_s") or 0, s.get("memory_policy", "")))')" | tee -a "$OUT/summary.txt"
}
# default: the jit baseline, the plain command, the one-flag fastest setting, and the plain
# command within jit's memory
RUNS=${RUNS:-"jit:110:--compile.mode jit;default:120:;full:180:--compile.inductor_compilation full;budget90:110:--compile.memory_budget_gib 90"}
IFS=';' read -ra items <<< "$RUNS"
for it in "${items[@]}"; do IFS=':' read -r n t f <<< "$it"; run "$n" "$t" $f; done
