#!/usr/bin/env bash
# Device calls on 2x H200 (each <= 10 min), Llama3 8B FSDP2 / TP2 with real NCCL:
#   run(kind="nvidia-h100-x2", needs_h200=true, carry=[".whl"], command="bash scripts/gpu/h200x2_checks.sh det")
#   run(kind="nvidia-h100-x2", needs_h200=true, carry=[".whl"], command="bash scripts/gpu/h200x2_checks.sh norms")
# On 2x H100 (no needs_h200): export CONFIG_FILE=train_configs/llama3_1b.toml first (the 8B needs H200s).
# det:   run-to-run bitwise, FSDP2, 5 steps, --debug.deterministic (loss_compare.py --assert-equal:
#        losses, grad norms, final weights, grads, optimizer state) for the plain command, the
#        fastest setting and the RMSNorm passes (norm + residual-add regions), in that order; a
#        pair that would end past DEADLINE_S (default 570) seconds is skipped.
# norms: the RMSNorm passes off vs on at FSDP2 and at TP2 (regional Inductor, the plain
#        command's mode), one run each in the order FSDP2, FSDP2 + passes, TP2, TP2 + passes
#        (scripts/gpu/h200x2.sh; REPEATS=N for more rounds).
# tp2:   8B TP2 (FSDP1xTP2): jit vs the plain command, alternating, step 8 profiled (REPEATS, default 3;
#        the script's deadline ends the last round early):
#   run(kind="nvidia-h200-x2", needs_h200=true, carry=[".whl"], command="bash scripts/gpu/h200x2_checks.sh tp2")
set -uo pipefail
here=$(dirname "$0")
NORMS="--compile.numerics_changing_optim --compile.passes residual_rmsnorm"
TP="--parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 2"
case "${1:-}" in
det)
    source "$here/setup.sh"   # wheels, PYTHONPATH, env, $OUT
    export NGPU=${NGPU:-2} CONFIG_FILE=${CONFIG_FILE:-train_configs/llama3_8b.toml}
    START=$SECONDS
    for r in "default:300:" "full:420:--compile.inductor_compilation full" "norms:300:$NORMS"; do
        IFS=':' read -r n t f <<< "$r"
        if (( SECONDS - START + t > ${DEADLINE_S:-570} )); then echo "det_$n skipped (deadline)"; continue; fi
        timeout "$t" python3 scripts/loss_compare.py --steps 5 --a-flags "--debug.deterministic $f" \
            --b-flags "--debug.deterministic $f" --a-label run1 --b-label run2 --assert-equal \
            --run-timeout $(( t / 2 )) --out "/tmp/det_$n" > "$OUT/det_$n.log" 2>&1
        echo "det_$n rc=$? ($(( SECONDS - START )) s)"; grep -h "bitwise\|differ\|FAILED\|^| [0-9]\|^| [a-z]" "$OUT/det_$n.log" | cut -c1-200
    done
    ;;
norms)
    RUNS="fsdp2:130:;fsdp2_norms:130:$NORMS;tp2:130:$TP;tp2_norms:130:$TP $NORMS" bash "$here/h200x2.sh" ;;
tp2)
    P="--profiling.enable_profiling --profiling.profile_freq 8 --profiling.profiler_warmup 1 --profiling.profiler_active 1"
    REPEATS=${REPEATS:-3} RUNS="jit:150:$TP $P --compile.mode jit;plain:150:$TP $P" bash "$here/h200x2.sh" ;;
*) echo "usage: $0 det|norms|tp2" >&2; exit 2 ;;
esac
