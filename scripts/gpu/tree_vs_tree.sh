#!/usr/bin/env bash
# Rank 0 of the seed layout (8B FSDP4xTP2, COMM_MODE=fake_collectives) from source tree A vs
# tree B (default: this checkout), alternating A B A B, one device call: tps, memory and the
# per-pass table of each. Make a tree of a commit here first (ignored by git, carried):
#   mkdir -p .base && git archive REF graph_trainer train_configs run_train.sh scripts pyproject.toml | tar -x -C .base
#   run(kind="nvidia-h100-x1", carry=[".whl", ".base"], command="bash scripts/gpu/tree_vs_tree.sh .base . 2")
# Extra flags for both sides: FLAGS="--compile.inductor_compilation full" bash scripts/gpu/tree_vs_tree.sh .base . 2
set -uo pipefail
BASE=$(cd "${1:?usage: $0 TREE_A [TREE_B] [REPEATS]}" && pwd); HERE=$(cd "${2:-.}" && pwd); REPEATS=${3:-2}
source "$(dirname "$0")/setup.sh"   # wheels, PYTHONPATH, env, $OUT
nvidia-smi -L | tee "$OUT/env.txt"; python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/env.txt"
export COMM_MODE=fake_collectives NGPU=8
ARGS="--job.config_file train_configs/llama3_8b.toml --parallelism.data_parallel_shard_degree 4
    --parallelism.tensor_parallel_degree 2 --training.steps 10 --metrics.log_freq 1 ${FLAGS:-}"
for r in $(seq "$REPEATS"); do
    for side in a b; do
        [[ $side == a ]] && dir=$BASE || dir=$HERE
        log="$OUT/${side}_$r.log"
        (cd "$dir" && PYTHONPATH="$dir:/tmp/site" timeout 280 ./run_train.sh $ARGS --job.dump_folder "/tmp/tvt_${side}_$r") > "$log" 2>&1
        echo "$side repeat $r rc=$?"
        grep -h "summary (median\|memory policy:" "$log" | sed 's/^.*INFO - //'
    done
done
for side in a b; do grep -h "^\(\[rank0\]:\)\?|" "$OUT/${side}_1.log" | sed "s/^\[rank0\]://" > "$OUT/pass_table_$side.md"; done
cat "$OUT/pass_table_a.md" "$OUT/pass_table_b.md"
