#!/usr/bin/env bash
# One device call on 1x H100: the pass author's workbench on the 1B (first-divergence finder,
# step timeline pictures).
#   run(kind="nvidia-h100-x1", carry=[".whl"], command="bash scripts/gpu/h100_workbench.sh")
set -uo pipefail
source "$(dirname "$0")/setup.sh"   # wheels, PYTHONPATH, env, $OUT
export CONFIG_FILE=train_configs/llama3_1b.toml
{ nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } | tee "$OUT/env.txt"
D="--debug.deterministic"
# 1. default vs the RMSNorm pass, then eager vs traced (both deterministic)
timeout 240 python3 scripts/numerics_diff.py --a-flags "$D" --b-flags "$D --compile.numerics_changing_optim" \
    --out /tmp/nd_rms > "$OUT/nd_rmsnorm.txt" 2>&1; echo "nd_rmsnorm rc=$?"
timeout 240 python3 scripts/numerics_diff.py --a-flags "$D --compile.mode eager" --b-flags "$D" \
    --out /tmp/nd_eager > "$OUT/nd_eager.txt" 2>&1; echo "nd_eager rc=$?"
grep -v "^\[rank\|^side\|^\[A\]\|^\[B\]" "$OUT/nd_rmsnorm.txt" "$OUT/nd_eager.txt"
# 2. step pictures: jit vs the fastest traced setting (one flag), step 5 profiled
P="--training.steps 6 --profiling.enable_profiling --profiling.profile_freq 5 --profiling.profiler_warmup 1 --profiling.profiler_active 1"
for s in "jit:--compile.mode jit" "full:--compile.inductor_compilation full"; do
    n=${s%%:*}; timeout 150 ./run_train.sh $P --job.dump_folder /tmp/tl_$n ${s#*:} > /tmp/tl_$n.log 2>&1
    echo "$n rc=$?"; cp /tmp/tl_$n/profile_traces/iteration_5/rank0_timeline.png "$OUT/timeline_1b_$n.png"
done
python3 -c "
from graph_trainer.tools.timeline import timeline_a_vs_b
r = timeline_a_vs_b('$OUT/timeline_1b_jit_vs_full.png', '/tmp/tl_jit/profile_traces/iteration_5/rank0_kernels.json',
                    '/tmp/tl_full/profile_traces/iteration_5/rank0_kernels.json', labels=('jit', 'traced, full Inductor'))
print({k: v for k, v in r.items() if not k.endswith('ranges_ms')})"
