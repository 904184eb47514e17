#!/usr/bin/env bash
# One workload's modes in one device call: jit vs the plain command (alternating, step 8
# profiled: kernel time by category, idle, timeline PNG), the first step of the fastest setting
# cold and with a warm Inductor cache (wall from launch to step 2), then the plain command
# + CUDA graphs vs the fastest setting and the fastest setting vs FASTEST_B (profiled).
#   run(kind="nvidia-h100-x1", carry=[".whl"], command="bash scripts/gpu/modes.sh 1b")
#   run(kind="nvidia-h100-x1", carry=[".whl"], command="bash scripts/gpu/modes.sh seed")
# 1b:   train_configs/llama3_1b.toml on one GPU.
# seed: rank 0 of the seed layout (8B FSDP4xTP2) under COMM_MODE=fake_collectives NGPU=8.
# REPEATS=N (default 2): runs per side of jit vs plain. FAST: the fastest setting's flags
# (default --compile.inductor_compilation full). FASTEST_B: flags of the last pair's B side
# (default: FAST + coordinate-descent tuning); PARTS="pair first cg fastb" picks parts.
set -uo pipefail
source "$(dirname "$0")/setup.sh"   # wheels, PYTHONPATH, env, $OUT
{ nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
    | tee "$OUT/env.txt"
case "${1:-}" in
1b) export NGPU=1 CONFIG_FILE=train_configs/llama3_1b.toml; L=""; T=150 ;;
seed) export NGPU=8 COMM_MODE=fake_collectives CONFIG_FILE=train_configs/llama3_8b.toml
    L="--parallelism.data_parallel_shard_degree 4 --parallelism.tensor_parallel_degree 2"; T=300 ;;
*) echo "usage: $0 1b|seed" >&2; exit 2 ;;
esac
W=$1; R=${REPEATS:-2}; FAST=${FAST:---compile.inductor_compilation full}
FASTEST_B=${FASTEST_B:-$FAST --compile.full_inductor.configs '{\"coordinate_descent_tuning\":true}'}
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache_${W}_$$   # cold for the first run of FAST below
cmp() {  # name, A flags, B flags, A label, B label, repeats
    timeout $(( T * 2 * $6 )) python3 scripts/compare_mfu.py --a-flags "$L $2" --b-flags "$L $3" --a-label "$4" \
        --b-label "$5" --repeats "$6" --steps 12 --warmup 3 --profile-step 8 --run-timeout "$T" --out "/tmp/$1" \
        > "$OUT/$1.log" 2>&1
    echo "$1 rc=$?"; cp "/tmp/$1/comparison.json" "$OUT/$1.json" 2>/dev/null
    for f in /tmp/"$1"/*.png; do cp "$f" "$OUT/$1_$(basename "$f")"; done 2>/dev/null
    grep -h "ok in\|FAILED\|^|" "$OUT/$1.log" | cut -c1-300
}
first_step() {  # name: FAST to step 2, wall from launch (s) and step 1's time
    local t0 t1; t0=$(date +%s.%N)
    timeout "$T" ./run_train.sh $L $FAST --training.steps 2 --job.dump_folder "/tmp/$1" > "$OUT/$1.log" 2>&1
    local rc=$?; t1=$(date +%s.%N)
    echo "$1 rc=$rc launch-to-step-2 wall $(python3 -c "print(f'{$t1 - $t0:.1f}')") s"
    grep -h "Traced the training\|took \|compiled the whole\|step:  [12] \|memory policy:\|cudagraph_pass" "$OUT/$1.log" \
        | sed 's/^.*INFO - //' | cut -c1-220
}
for part in ${PARTS:-pair first cg fastb}; do
case $part in
pair) cmp "${W}_jit_plain" "--compile.mode jit" "" "jit" "plain command" "$R" ;;
first) first_step "${W}_fast_cold"; first_step "${W}_fast_warm" ;;
cg) cmp "${W}_cg_fast" "--compile.passes cudagraph" "$FAST" "plain + cudagraph" "fastest ($FAST)" 1
    grep -h "cudagraph_pass\|memory policy:" /tmp/"${W}_cg_fast"/runs/A1.log | sed 's/^.*INFO - //' | cut -c1-220 ;;
fastb) cmp "${W}_fast_b" "$FAST" "$FASTEST_B" "fastest" "fastest B" 1 ;;
esac
done
