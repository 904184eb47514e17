#!/usr/bin/env bash
# One device call on 1x H100 (<= 10 min): the single-GPU measurements still pending in docs/perf.md.
#   run(kind="nvidia-h100-x1", carry=[".whl"], command="bash scripts/gpu/h100.sh")
# .whl: MINIMAL=1 BENCH=1 bash scripts/offline_wheels.sh .whl  (here, before the call)
# Writes at most 8 files to $OUT (the device tool's limit); each step has its own timeout.
# (The RMSNorm benchmark, fusion report and 1B pass off/on ran 2026-11-22: docs/perf.md.)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
{ nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } | tee "$OUT/env.txt"
# 1. issue 5 on GPU: run-to-run + resume bitwise, 1B, 10 steps, RMSNorm pass, --debug.deterministic
timeout 250 python3 -m pytest -q -x tests/test_determinism.py -k gpu_1b > "$OUT/determinism.log" 2>&1
echo "determinism rc=$?"; tail -5 "$OUT/determinism.log"
# 2. what --debug.deterministic costs (1B, one run each side)
CONFIG_FILE=train_configs/llama3_1b.toml timeout 140 python3 scripts/compare_mfu.py --a-flags "" \
    --b-flags "--debug.deterministic" --a-label "default" --b-label "deterministic" \
    --repeats 1 --steps 15 --warmup 3 --run-timeout 65 --out /tmp/cmpdet > "$OUT/compare_det.log" 2>&1
echo "det cost rc=$?"; grep -h "ok in\|FAILED" "$OUT/compare_det.log"
# 3. issue 7's Inductor ablation: 1B (2 layers) train step and the RMSNorm kernel
timeout 170 python3 scripts/ablate_inductor.py --config-file train_configs/llama3_1b.toml --layers 2 \
    --json "$OUT/ablation.json" > "$OUT/ablation.md" 2>/tmp/ablate.log
rc=$?; echo "ablation rc=$rc"; [ $rc = 0 ] || tail -20 /tmp/ablate.log; cat "$OUT/ablation.md"
