#!/usr/bin/env bash
# The GPU tier in one device call: the numerics claims with NCCL (tests/test_gpu_tier.py,
# marker multigpu) on a machine with 2 or more GPUs, the one-GPU tests (marker gpu) on one GPU.
# One PASSED / FAILED line per claim (pytest's -rA summary); each pytest's log under $OUT/tier/,
# the call's record under $OUT/results/ (copy it into docs/results/, then python3 scripts/results_page.py).
#
#   bash scripts/gpu/tier.sh                                   # every claim the GPUs allow
#   TIER_K=eager_equals bash scripts/gpu/tier.sh               # a subset (pytest -k)
#   GPU_TIER_CONFIG=train_configs/llama3_8b.toml TIER_K=eager_equals bash scripts/gpu/tier.sh
#
# With 4 or more GPUs the 2-GPU claims run two streams at once (GPUs 0,1 and 2,3), then the
# 4-GPU claims. GPU_TIER_CONFIG / GPU_TIER_STEPS: see tests/test_gpu_tier.py. TIER_DEADLINE_S:
# interrupt the claims still running that many seconds after the start (pytest's SIGINT: the
# finished claims are still summarised and recorded), for a call's time limit.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
mkdir -p "$OUT/tier"
n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
k=${TIER_K:+ and (${TIER_K})}
tier() {  # name, CUDA_VISIBLE_DEVICES, pytest arguments...
    local left=$(( ${TIER_DEADLINE_S:-86400} - SECONDS ))
    (( left > 0 )) || { echo "not started: TIER_DEADLINE_S passed" > "$OUT/tier/$1.log"; return; }
    CUDA_VISIBLE_DEVICES=$2 timeout -s INT -k 30 "$left" python3 -m pytest -v -s -rA -p no:cacheprovider "${@:3}" \
        > "$OUT/tier/$1.log" 2>&1
}
echo "GPU tier: $n GPU(s), config ${GPU_TIER_CONFIG:-train_configs/llama3_1b.toml}, torch $(python3 -c 'import torch; print(torch.__version__)')"
if (( n == 1 )); then
    tier one 0 -m gpu tests ${TIER_K:+-k "$TIER_K"}
elif (( n >= 2 )); then
    two="tests/test_gpu_tier.py"
    if (( n >= 4 )); then
        tier fsdp2 0,1 "$two" -k "fsdp2 and not fsdp2tp2$k" &
        tier tp2 2,3 "$two" -k "tp2 and not fsdp2tp2$k" &
        wait
        tier fsdp2tp2 0,1,2,3 "$two" -k "fsdp2tp2$k"
    else
        tier two_gpus 0,1 "$two" -k "not fsdp2tp2$k"
    fi
fi
grep -h -E '^(PASSED|FAILED|ERROR|SKIPPED) ' "$OUT"/tier/*.log
# the call's record for the results page (docs/results/, scripts/results_page.py): copy it there
python3 - "$OUT" "${GPU_TIER_CONFIG:-train_configs/llama3_1b.toml}" "${GPU_TIER_STEPS:-20}" "${TIER_K:-}" <<'PY'
import glob, os, re, shlex, sys, torch
from graph_trainer.tools.bench import device_name, utc_date_time, write_record
from graph_trainer.tools.sides import git_state
out, config, steps, k = sys.argv[1:]
what = {"test_eager_equals_traced": f"eager == traced, {steps} steps + final state",
        "test_cuda_graph_equals_eager": f"eager == traced replayed as a CUDA graph, {steps} steps + final state",
        "test_run_to_run_with_numerics_changing_options": "run to run, 6 steps + final state",
        "test_resume_bitwise": "stopped at step 2 and resumed == uninterrupted, 4 steps + final state",
        "test_run_to_run_and_resume_bitwise_with_pass": "one GPU: run to run and resumed == uninterrupted, 10 steps",
        "test_cuda_regions_are_bitwise_eager": "one GPU: the exact pointwise regions == eager",
        "test_fused_region_is_bitwise_eager_in_bf16_and_plain_inductor_is_not": "one GPU: an exact region == eager",
        "test_local_copy_process_group_copies_on_a_side_stream": "one GPU: fake collectives' copies on a side stream"}
deadline = os.environ.get("TIER_DEADLINE_S")
cut_by = f"started, no result: cut by TIER_DEADLINE_S={deadline}" if deadline else "started, no result"
claims = []
for f in sorted(glob.glob(f"{out}/tier/*.log")):
    log = open(f).read()
    done = {m[2]: m[1] for m in re.finditer(r"^(PASSED|FAILED|ERROR) \S+::(\S+)", log, re.M)}
    cut = [m[1] for m in re.finditer(r"^\S+::(\S+) ", log, re.M) if m[1] not in done]  # pytest -v: started
    claims += [{"claim": c, "what": what.get(c.split("[")[0], ""), "result": r} for c, r in done.items()]
    claims += [{"claim": c, "what": what.get(c.split("[")[0], ""), "result": "NOT RUN", "detail": cut_by} for c in cut]
if claims:
    model = config.rsplit("/", 1)[-1].removesuffix(".toml")
    git = git_state(".")
    env = " ".join(f"{n}={shlex.quote(v)}" for n, v in
                   (("GPU_TIER_CONFIG", config), ("GPU_TIER_STEPS", steps), ("TIER_K", k)) if v)
    rec = {"schema": 1, "kind": "tier", "model": model, "workload": f"gpu tier {model} {k}".strip(),
           "title": f"GPU tier, {model}" + (f" ({k})" if k else ""), **utc_date_time(), "device": device_name(),
           "torch": torch.__version__, **git, "git_sha": git["git_sha"] or "unknown",
           "command": f"{env} bash scripts/gpu/tier.sh".strip(),
           "claims": sorted(claims, key=lambda c: c["claim"])}
    print("record:", write_record(f"{out}/results", rec))
PY
! grep -q -E '^(FAILED|ERROR) ' "$OUT"/tier/*.log
