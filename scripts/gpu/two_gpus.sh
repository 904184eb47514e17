#!/usr/bin/env bash
# Two one-GPU batches at once on a two-GPU host (nvidia-h100-x2, nvidia-h200-x2): the first command
# line on GPU 0 and the first half of the cores, the second on GPU 1 and the other half, each with
# its own OUT ($OUT/gpu0, $OUT/gpu1: console.log and the batch's files), RUN_DIR (/tmp/gpuN, for
# h200x2.sh), Inductor cache and half the compile threads. Compare runs only inside one batch.
#   run(kind="nvidia-h200-x2", carry=[".whl"], command='bash scripts/gpu/two_gpus.sh \
#       "REPEATS=3 PARTS=pair bash scripts/gpu/modes.sh seed" "REPEATS=3 PARTS=pair bash scripts/gpu/modes.sh 1b"')
set -uo pipefail
(( $# == 2 )) || { echo "usage: $0 'batch on GPU 0' 'batch on GPU 1'" >&2; exit 2; }
source "$(dirname "$0")/setup.sh"   # installs the wheels once, before both batches start
n=$(nproc); h=$(( n / 2 )); root=$OUT; cores=("0-$(( h - 1 ))" "$h-$(( n - 1 ))"); cmds=("$1" "$2")
for g in 0 1; do
    ( export CUDA_VISIBLE_DEVICES=$g OUT=$root/gpu$g RUN_DIR=/tmp/gpu$g TORCHINDUCTOR_COMPILE_THREADS=$h \
          TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache_gpu$g
      mkdir -p "$OUT"; taskset -c "${cores[$g]}" bash -c "${cmds[$g]}" > "$OUT/console.log" 2>&1
      echo "GPU $g batch rc=$?" ) &
done
wait
