#!/usr/bin/env bash
# Rank 0 of Llama3 8B layouts (seq 8192, selective AC) on one GPU under COMM_MODE=fake_collectives:
# the rank's compute and host time without communication, A vs B in one call (compare_mfu,
# step 8 profiled: kernel time by category, idle time, timeline PNG), one or more modes per call:
#   run(kind="nvidia-h200", carry=[".whl"], command="bash scripts/gpu/one_rank.sh regional seed fsdp2")
#   run(kind="nvidia-h200", carry=[".whl"], command="bash scripts/gpu/one_rank.sh full")
#   run(kind="nvidia-h100-x1", carry=[".whl"], command="bash scripts/gpu/one_rank.sh seed seed_jit")
# regional: the traced step without vs with CUDA graphs (the plain command has them).
# full:     --compile.inductor_compilation full, without vs with the cudagraph pass.
# seed:     rank 0 of the seed layout (FSDP4xTP2, 8 ranks), without vs with CUDA graphs.
# seed_full: the seed layout's rank under full Inductor, without vs with the cudagraph pass.
# seed_jit: rank 0 of the seed layout, torch.compile per block (--compile.mode jit) vs traced.
# fsdp2:    rank 0 of FSDP2 (2 ranks), without vs with CUDA graphs.
# seed_norm: rank 0 of the seed layout, plain vs the RMSNorm pass (--compile.numerics_changing_optim).
# seed_residual: rank 0 of the seed layout, the RMSNorm pass vs the same + --compile.passes residual_rmsnorm.
# REPEATS=N (default 1): N runs per side, alternating.
set -uo pipefail
source "$(dirname "$0")/setup.sh"   # wheels, PYTHONPATH, env, $OUT
export COMM_MODE=fake_collectives CONFIG_FILE=train_configs/llama3_8b.toml
TP="--parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 2"
CG="--compile.passes cudagraph"; NOCG="--compile.disable_passes cudagraph"   # (the policy's default: with)
S4="--parallelism.data_parallel_shard_degree 4 --parallelism.tensor_parallel_degree 2"
for mode in "$@"; do
case "$mode" in
regional) A="$TP $NOCG"; B="$TP $CG"; LA="TP2 rank"; LB="TP2 rank cudagraph"; T=200 ;;
full) F="--compile.inductor_compilation full"; A="$TP $F"; B="$TP $F $CG"; LA="TP2 rank full"
    LB="TP2 rank full cudagraph"; T=560 ;;
seed) A="$S4 $NOCG"; B="$S4 $CG"; LA="FSDP4xTP2 rank"; LB="FSDP4xTP2 rank cudagraph"; T=200 ;;
seed_full) F="--compile.inductor_compilation full"; A="$S4 $F"; B="$S4 $F $CG"; LA="FSDP4xTP2 rank full"
    LB="FSDP4xTP2 rank full cudagraph"; T=560 ;;
seed_jit) A="$S4 --compile.mode jit"; B="$S4"; LA="FSDP4xTP2 rank jit"; LB="FSDP4xTP2 rank traced"; T=260 ;;
fsdp2) A="$NOCG"; B="$CG"; LA="FSDP2 rank"; LB="FSDP2 rank cudagraph"; T=200 ;;
seed_norm) N="--compile.numerics_changing_optim"; A="$S4"; B="$S4 $N"; LA="FSDP4xTP2 rank"
    LB="FSDP4xTP2 rank RMSNorm pass"; T=200 ;;
seed_residual) N="--compile.numerics_changing_optim"; A="$S4 $N"; B="$S4 $N --compile.passes residual_rmsnorm"
    LA="FSDP4xTP2 rank RMSNorm pass"; LB="FSDP4xTP2 rank RMSNorm + residual add"; T=200 ;;
*) echo "usage: $0 regional|full|seed|seed_full|seed_jit|fsdp2|seed_norm|seed_residual ..." >&2; exit 2 ;;
esac
[[ "$mode" == seed* ]] && export NGPU=8 || export NGPU=2
timeout $(( T * ${REPEATS:-1} )) python3 scripts/compare_mfu.py --a-flags "$A" --b-flags "$B" --a-label "$LA" --b-label "$LB" \
    --repeats "${REPEATS:-1}" --steps 12 --warmup 3 --profile-step 8 --run-timeout $(( T / 2 - 5 )) --out "/tmp/cmp_$mode" \
    > "$OUT/cmp_$mode.log" 2>&1
echo "cmp_$mode rc=$?"
cp /tmp/cmp_"$mode"/comparison.json "$OUT/comparison_$mode.json" 2>/dev/null
for f in /tmp/cmp_"$mode"/*.png; do cp "$f" "$OUT/${mode}_$(basename "$f")"; done 2>/dev/null
grep -h "ok in\|FAILED\|^|\|rror" "$OUT/cmp_$mode.log" | cut -c1-400
done
