#!/usr/bin/env bash
# The async_tp pass on 2x H200, Llama3 8B TP2 (seq 8192, selective AC), one device call per
# mode (each <= 10 min):
#   run(kind="nvidia-h200-x2", carry=[".whl"], command="bash scripts/gpu/h200x2_async_tp.sh smoke")
#   run(kind="nvidia-h200-x2", carry=[".whl"], command="bash scripts/gpu/h200x2_async_tp.sh mfu")
#   run(kind="nvidia-h200-x2", carry=[".whl"], command="bash scripts/gpu/h200x2_async_tp.sh mfu_full")
#   run(kind="nvidia-h200-x2", carry=[".whl"], command="bash scripts/gpu/h200x2_async_tp.sh loss")
#   run(kind="nvidia-h200-x2", carry=[".whl"], command="bash scripts/gpu/h200x2_async_tp.sh idle")
# smoke:    8 steps with the pass, regional and full Inductor: the pass's log line (what it
#           fused, symmetric memory, multicast) and the run summary.
# mfu:      compare_mfu without vs with --compile.passes async_tp (regional Inductor), 2
#           repeats of 20 steps, step 10 profiled (kernel time by category, timeline).
# mfu_full: the same under --compile.inductor_compilation full (1 repeat).
# loss:     loss_compare, 20 steps, without vs with the pass, --debug.deterministic on both:
#           bitwise or not, then the per-step relative loss difference (--rtol 1e-3).
# idle:     where TP2's idle time comes from: compare_mfu real TP2 vs TP2 + cudagraph (does the
#           capture take NCCL collectives?), then the same pair as one rank alone
#           (COMM_MODE=fake_collectives, GPU 0): the difference is communication and waiting.
# setup.sh exports NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1.
set -uo pipefail
source "$(dirname "$0")/setup.sh"   # wheels, PYTHONPATH, env, $OUT
export NGPU=2 CONFIG_FILE=train_configs/llama3_8b.toml
TP="--parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 2"
case "${1:-}" in
smoke)
    for r in "regional:150:" "full:230:--compile.inductor_compilation full"; do
        IFS=':' read -r n t f <<< "$r"
        timeout "$t" ./run_train.sh --training.steps 8 --job.dump_folder "/tmp/r_$n" $TP --compile.passes async_tp $f \
            > "/tmp/$n.log" 2>&1
        echo "$n rc=$?"; grep -h "graph pass async_tp\|graph pass overlap_collectives" "/tmp/$n.log" | head -2 | cut -c1-700
        grep -h summary "/tmp/r_$n/metrics.jsonl" 2>/dev/null | cut -c1-400 \
            || grep -v "^\[rank1\]" "/tmp/$n.log" | grep -m1 -A40 Traceback
        cp "/tmp/$n.log" "$OUT/smoke_$n.log"
    done
    ;;
mfu)
    timeout 560 python3 scripts/compare_mfu.py --a-flags "$TP" --b-flags "$TP --compile.passes async_tp" \
        --a-label "TP2" --b-label "TP2 async_tp" --repeats 2 --steps 20 --warmup 3 --profile-step 10 \
        --run-timeout 130 --out /tmp/cmp_atp > "$OUT/cmp_atp.log" 2>&1
    echo "cmp_atp rc=$?"; cp /tmp/cmp_atp/comparison.json /tmp/cmp_atp/*.png "$OUT/" 2>/dev/null
    grep -h "ok in\|FAILED\|^|" "$OUT/cmp_atp.log"
    ;;
mfu_full)
    F="--compile.inductor_compilation full"
    timeout 560 python3 scripts/compare_mfu.py --a-flags "$TP $F" --b-flags "$TP $F --compile.passes async_tp" \
        --a-label "TP2 full" --b-label "TP2 full async_tp" --repeats 1 --steps 20 --warmup 3 \
        --run-timeout 240 --out /tmp/cmp_atp_full > "$OUT/cmp_atp_full.log" 2>&1
    echo "cmp_atp_full rc=$?"; cp /tmp/cmp_atp_full/comparison.json "$OUT/comparison_full.json" 2>/dev/null
    grep -h "ok in\|FAILED\|^|" "$OUT/cmp_atp_full.log"
    ;;
loss)
    D="--debug.deterministic"
    timeout 560 python3 scripts/loss_compare.py --steps 20 --a-flags "$TP $D" --b-flags "$TP $D --compile.passes async_tp" \
        --a-label "TP2" --b-label "TP2 async_tp" --rtol 1e-3 --run-timeout 250 --out /tmp/loss_atp \
        > "$OUT/loss_atp.log" 2>&1
    echo "loss_atp rc=$?"; tail -40 "$OUT/loss_atp.log"
    ;;
idle)
    for cm in default fake_collectives; do
        COMM_MODE=$cm timeout 280 python3 scripts/compare_mfu.py --a-flags "$TP --compile.disable_passes cudagraph" --b-flags "$TP --compile.passes cudagraph" \
            --a-label "TP2 $cm" --b-label "TP2 $cm cudagraph" --repeats 1 --steps 12 --warmup 3 --profile-step 8 \
            --run-timeout 135 --out "/tmp/cmp_idle_$cm" > "$OUT/cmp_idle_$cm.log" 2>&1
        echo "cmp_idle_$cm rc=$?"; cp "/tmp/cmp_idle_$cm/comparison.json" "$OUT/comparison_idle_$cm.json" 2>/dev/null
        cp "/tmp/cmp_idle_$cm/timeline_a_vs_b.png" "$OUT/timeline_idle_$cm.png" 2>/dev/null
        grep -h "ok in\|FAILED\|^|" "$OUT/cmp_idle_$cm.log"
    done
    ;;
*) echo "usage: $0 smoke|mfu|mfu_full|loss|idle" >&2; exit 2 ;;
esac
