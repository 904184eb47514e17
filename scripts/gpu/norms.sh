#!/usr/bin/env bash
# RMSNorm over-fusion experiment on one GPU (<= 10 min), one call:
#   run(kind="nvidia-h100-x1", carry=[".whl"], command="bash scripts/gpu/norms.sh")
# 1. Llama3 1B under full Inductor: Inductor's triton.mix_order_reduction on (default) vs off,
#    REPEATS (default 2) alternating, step 8 profiled (kernel time by category, idle).
# 2. fusion_report, 1B with 2 layers: forward / backward kernel time of the whole-graph compile
#    (mix_order_reduction on and off, and with the norms isolated: isolate_rmsnorm) against the
#    norm as its own region (regional + RMSNorm pass).
# 3. bench_rmsnorm at the norm shapes of the workloads (tokens x dim): 1B 8192x2048, 8B FSDP
#    8192x4096, 8B seed rank (TP2, sequence-parallel norm) 4096x4096, and 32768x4096; the regional
#    norm with Inductor's defaults, the timed pick (guarded) and mix_order_reduction off, beside eager,
#    torch.compile and a copy that moves the same bytes.
#    Then the same shapes with --residual: the residual add + RMSNorm region (residual_rmsnorm's kernel).
# 4. (PARTS=bitwise) 1B, run-to-run with the RMSNorm and residual-add passes on under
#    --debug.deterministic (losses, grad norms, final state hashes), and (PARTS=firstdiff) the op
#    the first-divergence finder names between the default and those passes, step 1.
# PARTS (default "mix fusion bench residual") picks the steps.
set -uo pipefail
source "$(dirname "$0")/setup.sh"   # wheels, PYTHONPATH, env, $OUT
{ nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } | tee "$OUT/env.txt"
F="--compile.inductor_compilation full"
NOMIX="--compile.full_inductor.configs '{\"triton.mix_order_reduction\":false}'"
R=${REPEATS:-2}
for part in ${PARTS:-mix fusion bench residual}; do
case $part in
mix)
CONFIG_FILE=train_configs/llama3_1b.toml timeout $(( 150 * R )) python3 scripts/compare_mfu.py \
    --a-flags "$F" --b-flags "$F $NOMIX" --a-label "1B full" --b-label "1B full, mix_order_reduction off" \
    --repeats "$R" --steps 12 --warmup 3 --profile-step 8 --run-timeout 90 --out /tmp/cmp_mix > "$OUT/cmp_mix.log" 2>&1
echo "cmp_mix rc=$?"
cp /tmp/cmp_mix/comparison.json "$OUT/comparison_mix.json" 2>/dev/null
for f in /tmp/cmp_mix/*.png; do cp "$f" "$OUT/mix_$(basename "$f")"; done 2>/dev/null
grep -h "ok in\|FAILED\|^|\|rror" "$OUT/cmp_mix.log" | cut -c1-400 ;;
fusion)
timeout 150 python3 scripts/fusion_report.py --config-file train_configs/llama3_1b.toml --layers 2 --steps 5 \
    --json "$OUT/fusion_1b.json" > "$OUT/fusion_1b.md" 2>&1
echo "fusion rc=$?"; grep -v "^\s*$" "$OUT/fusion_1b.md" | tail -40 | cut -c1-300 ;;
bench)
timeout 120 python3 scripts/bench_rmsnorm.py --variants eager,regional,torch.compile \
    --shapes 8192x2048,8192x4096,4096x4096,32768x4096 --inductor-configs default='{}' \
    --inductor-configs guarded --inductor-configs nomix='{"triton.mix_order_reduction": false}' \
    --json "$OUT/rmsnorm.json" > "$OUT/rmsnorm.md" 2>&1
echo "rmsnorm rc=$?"; tail -30 "$OUT/rmsnorm.md" ;;
residual)
timeout 120 python3 scripts/bench_rmsnorm.py --residual --variants eager,regional,torch.compile \
    --shapes 8192x2048,8192x4096,4096x4096,32768x4096 --inductor-configs default='{}' --inductor-configs guarded \
    --json "$OUT/residual_rmsnorm.json" > "$OUT/residual_rmsnorm.md" 2>&1
echo "residual rc=$?"; tail -20 "$OUT/residual_rmsnorm.md" ;;
bitwise)
P="--debug.deterministic --compile.numerics_changing_optim --compile.passes residual_rmsnorm"
CONFIG_FILE=train_configs/llama3_1b.toml timeout 200 python3 scripts/loss_compare.py --a-flags "$P" --b-flags "$P" \
    --a-label "norm passes, run 1" --b-label "norm passes, run 2" --steps 6 --run-timeout 95 --out /tmp/norm_bitwise \
    > "$OUT/norm_bitwise.log" 2>&1
echo "norm_bitwise rc=$?"; grep -h "bitwise\|differ\|FAILED" "$OUT/norm_bitwise.log" | cut -c1-300 ;;
firstdiff)
P="--compile.numerics_changing_optim --compile.passes residual_rmsnorm"
CONFIG_FILE=train_configs/llama3_1b.toml timeout 200 python3 scripts/numerics_diff.py --a-flags "--debug.deterministic" \
    --b-flags "--debug.deterministic $P" --a-label default --b-label "norm passes" --run-timeout 95 --out /tmp/norm_firstdiff \
    > "$OUT/norm_firstdiff.log" 2>&1
echo "norm_firstdiff rc=$?"; grep -A8 "ops compared" "$OUT/norm_firstdiff.log" | cut -c1-300 ;;
esac
done
