#!/usr/bin/env bash
# The 8B from source tree A vs tree B (default: this checkout), alternating A B A B, one device
# call: tps, memory and the per-pass table of each; by default rank 0 of the seed layout (FSDP4xTP2,
# COMM_MODE=fake_collectives) on one GPU. Make a tree of a commit here first (ignored by git, carried):
#   mkdir -p .base && git archive REF graph_trainer train_configs run_train.sh scripts pyproject.toml | tar -x -C .base
#   run(kind="nvidia-h100-x1", carry=[".whl", ".base"], command="bash scripts/gpu/tree_vs_tree.sh .base . 2")
# Extra flags for both sides: FLAGS="--compile.inductor_compilation full" bash scripts/gpu/tree_vs_tree.sh .base . 2
# Another layout: NGPU, COMM_MODE (default fake_collectives; "default" for real NCCL), LAYOUT
# (the --parallelism flags), STEPS (default 10), CONFIG_FILE (default the 8B), e.g. FSDP2 and TP2 on two GPUs:
#   COMM_MODE=default NGPU=2 LAYOUT="" bash scripts/gpu/tree_vs_tree.sh .base . 1
#   COMM_MODE=default NGPU=2 LAYOUT="--parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 2" bash ...
# TAG prefixes the logs and $OUT/pass_tables.md of one invocation (several in one call);
# RUN_TIMEOUT (default 280) seconds per run.
set -uo pipefail
BASE=$(cd "${1:?usage: $0 TREE_A [TREE_B] [REPEATS]}" && pwd); HERE=$(cd "${2:-.}" && pwd); REPEATS=${3:-2}
source "$(dirname "$0")/setup.sh"   # wheels, PYTHONPATH, env, $OUT
nvidia-smi -L | tee "$OUT/env.txt"; python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/env.txt"
export COMM_MODE=${COMM_MODE:-fake_collectives} NGPU=${NGPU:-8}
CFG=${CONFIG_FILE:-train_configs/llama3_8b.toml}; unset CONFIG_FILE   # a path in each tree
ARGS="--job.config_file $CFG ${LAYOUT---parallelism.data_parallel_shard_degree 4
    --parallelism.tensor_parallel_degree 2} --training.steps ${STEPS:-10} --metrics.log_freq 1 ${FLAGS:-}"
for r in $(seq "$REPEATS"); do
    for side in a b; do
        [[ $side == a ]] && dir=$BASE || dir=$HERE
        log="/tmp/tvt_${TAG:-}${side}_$r.log"
        (cd "$dir" && PYTHONPATH="$dir:/tmp/site" timeout "${RUN_TIMEOUT:-280}" ./run_train.sh $ARGS --job.dump_folder "/tmp/tvt_${TAG:-}${side}_$r") > "$log" 2>&1
        rc=$?; echo "$side repeat $r rc=$rc"
        [ $rc = 0 ] || grep -v "^\[rank1\]" "$log" | grep -m1 -A30 Traceback || tail -5 "$log"
        grep -h "summary (median\|memory policy:" "$log" | sed 's/^.*INFO - //'
    done
done
for side in a b; do echo "### side $side"; grep -h "^\(\[rank0\]:\)\?|" "/tmp/tvt_${TAG:-}${side}_1.log" | sed "s/^\[rank0\]://"
done > "$OUT/${TAG:-}pass_tables.md"
