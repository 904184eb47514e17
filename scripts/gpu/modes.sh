#!/usr/bin/env bash
# One workload's modes in one device call: jit vs the plain command (alternating, step 8
# profiled: kernel time by category, idle, timeline PNG), the first step of the fastest setting
# cold and with a warm Inductor cache (wall from launch to step 2), then the plain command
# vs the fastest setting and the fastest setting vs FASTEST_B (profiled). `first` runs without the
# graph cache (--compile.graph_cache_dir off), which the fastest setting otherwise turns on.
#   run(kind="nvidia-h100-x1", carry=[".whl"], command="bash scripts/gpu/modes.sh 1b")
#   run(kind="nvidia-h100-x1", carry=[".whl"], command="bash scripts/gpu/modes.sh seed")
# 1b:   train_configs/llama3_1b.toml on one GPU.
# seed: rank 0 of the seed layout (8B FSDP4xTP2) under COMM_MODE=fake_collectives NGPU=8.
# REPEATS=N (default 2): runs per side of jit vs plain. FAST: the fastest setting's flags
# (default --compile.inductor_compilation full). FASTEST_B: flags of the last pair's B side
# (default: FAST + coordinate-descent tuning). PARTS (default "pair first cg fastb") picks the parts;
# more: jit_fast (jit vs the fastest setting, alternating), probe (interpreter start, imports,
# config check), plain_first / cg_first (the plain command without / with its CUDA graph, to
# step 2: the capture's memory), data (batches read in the step vs by a worker, the default),
# bitwise (eager vs the plain command under --debug.deterministic, 6 steps: losses, grad norms,
# final state hashes; 1b only: under fake_collectives eager and traced values differ with no pass
# at all), exact (the plain command without vs with its exact_pointwise regions, alternating,
# then on the 1b eager vs the plain command bitwise), jit_budget (jit vs the plain command with
# --compile.memory_budget_gib $BUDGET_GIB, e.g. jit's peak), iso (the fastest setting without vs with
# its RMSNorms isolated: + --compile.numerics_changing_optim --compile.passes isolate_rmsnorm),
# cold_profile (the fastest setting's step 1 from a cold Inductor cache under cProfile, top
# functions by cumulative and own time), first_cache (as first, both runs with one
# --compile.graph_cache_dir: the second loads the compiled step), first_auto (the same with the
# fastest setting's own graph cache, in the new Inductor cache), plain_cache (the same for the plain
# command: the second loads the graph, then compiles its regions and captures its CUDA graph),
# cache_bitwise (1b: the fastest setting and the plain command under --debug.deterministic, 4 steps,
# cold, then from the cache, for the fastest setting also from the graph alone: losses, grad norms
# and final state hashes equal), vs_fast (the fastest setting without vs with the flags in VS,
# alternating, profiled), plain_vs (the plain command with the flags in VS, e.g. a pass option
# turned off, vs without, alternating, profiled), first_vs (the plain command with VS's flags to
# step 2: launch -> step 2, the passes' times), layouts (one step of the fastest setting and of jit with
# TORCH_LOGS=output_code: the first forward matmul and attention calls and their buffers' strides),
# blocks (the fastest setting vs BLOCKS, default its regions per transformer block: annotate_blocks,
# alternating, profiled), blocks_first (BLOCKS' first step, cold and with a warm Inductor cache),
# launches (the plain command's step 8 launch by launch: its casts by grid, the device's gaps:
# scripts/gpu/launches.py), trio (a 2-step run that compiles the fastest setting into the cache, then
# REPEATS rounds of jit, the plain command and the fastest setting, step 8 profiled: h200x2.sh's
# table), norms (REPEATS rounds of the plain command, + the RMSNorm pass, + both norm passes:
# h200x2.sh's table; FIRST_ROUND continues an earlier call's rounds on the same machine). SMI=1:
# nvidia-smi samples SM clock, power and throttle reasons every 0.5 s (SMI=nvml:
# scripts/gpu/nvml_sampler.py, every 10 ms); after each comparison, per run over its steady steps
# (4..12): the SM clock's median and 10th percentile, the median power, the share of samples under
# the software power cap.
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
# profile one step, step 8 (launches, trio)
P="--profiling.enable_profiling --profiling.profile_freq 8 --profiling.profiler_warmup 1 --profiling.profiler_active 1"
W=$1; R=${REPEATS:-2}; FAST=${FAST:---compile.inductor_compilation full}; NO_EXACT="--compile.disable_passes exact_pointwise"
BLOCKS=${BLOCKS:---compile.numerics_changing_optim --compile.passes annotate_blocks}
FASTEST_B=${FASTEST_B:-$FAST --compile.full_inductor.configs '{\"coordinate_descent_tuning\":true}'}
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache_${W}_$$   # cold for the first run of FAST below
cmp() {  # name, A flags, B flags, A label, B label, repeats
    timeout $(( T * 2 * $6 )) python3 scripts/compare_mfu.py --a-flags "$L $2" --b-flags "$L $3" --a-label "$4" \
        --b-label "$5" --repeats "$6" --steps 12 --warmup 3 --profile-step 8 --run-timeout "$T" --out "/tmp/$1" \
        > "$OUT/$1.log" 2>&1
    echo "$1 rc=$?"; cp "/tmp/$1/comparison.json" "$OUT/$1.json" 2>/dev/null
    for f in /tmp/"$1"/*.png; do cp "$f" "$OUT/$1_$(basename "$f")"; done 2>/dev/null
    for k in /tmp/"$1"/runs/*/profile_traces/iteration_*/rank0_kernels.md; do  # every kernel of each profiled run
        r=${k#/tmp/"$1"/runs/}; cp "$k" "$OUT/$1_${r%%/*}_kernels.md"; done 2>/dev/null
    grep -h "ok in\|FAILED\|^|" "$OUT/$1.log" | cut -c1-300
    [[ -n ${SMI:-} ]] && python3 - "$OUT/smi.csv" /tmp/"$1"/runs/*.log <<'PY'
import datetime, re, statistics, sys
def when(text, fmt):
    return datetime.datetime.strptime(text, fmt).timestamp()
rows = []  # timestamp, clocks.sm [MHz], power.draw [W], clocks_event_reasons.active
for line in open(sys.argv[1]).read().splitlines()[1:]:
    f = [x.strip() for x in line.split(",")]
    try:
        rows.append((when(f[0], "%Y/%m/%d %H:%M:%S.%f"), float(f[1].split()[0]), float(f[2].split()[0]), f[3]))
    except (ValueError, IndexError):
        continue
for log in sys.argv[2:]:
    t = {int(m.group(2)): when(m.group(1), "%Y-%m-%d %H:%M:%S,%f") for line in open(log, errors="replace")
         if (m := re.search(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}).*step: *(\d+) ", line))}
    w = [r for r in rows if 4 in t and t[4] <= r[0] <= t[max(t)]]
    if w:
        clocks = sorted(r[1] for r in w)
        capped = sum(int(r[3], 16) & 0x4 != 0 for r in w)  # SW power cap
        print(f"{log.rsplit('/', 1)[-1][:-4]}: SM clock median {statistics.median(clocks):.0f} MHz (10th percentile "
              f"{clocks[len(clocks) // 10]:.0f}), power {statistics.median(r[2] for r in w):.0f} W, power cap in "
              f"{100 * capped / len(w):.0f} % of {len(w)} samples, reasons {sorted({r[3] for r in w})}")
PY
}
first_step() {  # name, flags: to step 2, wall from launch split at the first log line and at step 2
    local t0 t1; t0=$(date +%s.%N)
    timeout "$T" ./run_train.sh $L $2 --training.steps 2 --job.dump_folder "/tmp/$1" > "$OUT/$1.log" 2>&1
    local rc=$?; t1=$(date +%s.%N)
    python3 - "$1" "$rc" "$t0" "$t1" "$OUT/$1.log" <<'PY'
import datetime, re, sys
name, rc, t0, t1, log = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
stamps = [(datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp(), line)
          for line in open(log, errors="replace") if (m := re.search(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})", line))]
step2 = next((t for t, line in stamps if "step:  2" in line), None)
parts = f"launch -> first log line {stamps[0][0] - t0:.1f} s" if stamps else "no log line"
if step2 is not None:
    parts += f", -> step 2 {step2 - stamps[0][0]:.1f} s, step 2 -> exit {t1 - step2:.1f} s"
print(f"{name} rc={rc} launch-to-exit {t1 - t0:.1f} s ({parts})")
PY
    grep -h "Traced the training\|took \|compiled the whole\|compiled [0-9]* region\|annotate_blocks \|step:  [12] \|memory policy:\|cudagraph_pass\|graph cache:" "$OUT/$1.log" \
        | sed 's/^.*INFO - //' | cut -c1-220
    python3 - "/tmp/$1/metrics.jsonl" <<'PY'   # regional_inductor's five slowest compiles
import json, os, sys
for line in open(sys.argv[1]) if os.path.exists(sys.argv[1]) else []:
    for p in json.loads(line).get("summary", {}).get("passes", []):
        for c in sorted(p.get("stats", {}).get("compiles", []), key=lambda c: -c["s"])[:5]:
            print(f"  compile {c['s']:.2f} s, cache {c['cache'] or '-'}: {'+'.join(c['ops'])[:80]} ({c['inputs'][:90]})")
PY
}
bitwise() {  # name, B flags, B label: eager vs B under --debug.deterministic, 6 steps
    [[ $W == 1b ]] || { echo "$1 skipped: fake_collectives values are not comparable with eager's"; return; }
    timeout $(( T * 2 )) python3 scripts/loss_compare.py --a-flags "$L --compile.mode eager --debug.deterministic" \
        --b-flags "$L --debug.deterministic $2" --a-label eager --b-label "$3" --steps 6 --run-timeout "$T" \
        --out "/tmp/$1" > "$OUT/$1.log" 2>&1
    echo "$1 rc=$?"; grep -h "bitwise\|differ\|FAILED" "$OUT/$1.log" | cut -c1-300
}
cache_bitwise() {  # label, flags, runs (cold, compiled: from the compiled step, graph: from the graph)
    local label=$1 flags=$2 gc=/tmp/graph_cache_bw_$1_${W}_$$ run; shift 2
    for run in "$@"; do
        [[ $run == graph ]] && rm -f "$gc"/*.inductor
        timeout "$T" ./run_train.sh $L $flags --compile.graph_cache_dir "$gc" --debug.deterministic \
            --debug.state_hashes --training.steps 4 --job.dump_folder "/tmp/${W}_cb_${label}_$run" \
            > "$OUT/${W}_cb_${label}_$run.log" 2>&1
        echo "${W}_cb_${label}_$run rc=$? $(grep -ho "graph cache: loaded[^:]*" "$OUT/${W}_cb_${label}_$run.log")"
        grep -ho "step: *[0-9]* *loss: *[^ ]* *grad_norm: *[^ ]*\|final state sha256.*" "$OUT/${W}_cb_${label}_$run.log" \
            > "/tmp/${W}_cb_${label}_$run.txt"
        if [[ $run != "$1" ]]; then
            diff -q "/tmp/${W}_cb_${label}_$1.txt" "/tmp/${W}_cb_${label}_$run.txt" > /dev/null \
                && echo "${label}: $run == $1 bitwise ($(wc -l < "/tmp/${W}_cb_${label}_$run.txt") lines)" \
                || { echo "${label}: $run DIFFERS from $1"; diff "/tmp/${W}_cb_${label}_$1.txt" "/tmp/${W}_cb_${label}_$run.txt"; }
        fi
    done
}
rounds() {  # name, RUNS: REPEATS rounds of h200x2.sh's runs (its table), ending before the call's 585 s
    RUN_DIR=/tmp/${W}_$1 REPEATS=$R DEADLINE_S=$(( 585 - SECONDS )) RUNS="$2" bash "$(dirname "$0")/h200x2.sh"
}
layouts() {  # name, flags: one step with TORCH_LOGS=output_code; the first forward matmuls and attention
    # calls of the generated code, each with the allocations (shape, strides) of the buffers it names
    timeout "$T" env TORCH_LOGS=output_code ./run_train.sh $L $2 --training.steps 1 --job.dump_folder "/tmp/$1" \
        > "/tmp/$1.log" 2>&1
    echo "$1 rc=$?"
    python3 - "/tmp/$1.log" <<'PY' | tee "$OUT/$1.txt"
import re, sys
lines = [l.split("[__output_code]", 1)[1] for l in open(sys.argv[1], errors="replace") if "[__output_code]" in l]
alloc = {}
for line in lines:
    if (m := re.match(r"\s*(buf\d+) = (empty_strided_\w+\(.*)", line)) and m.group(1) not in alloc:
        alloc[m.group(1)] = m.group(2)[:160]
calls = [l for l in lines if "extern_kernels.mm(" in l or "torch.ops.aten._scaled_dot_product" in l and "= torch.ops" in l]
for line in calls[:8]:
    print(line.strip()[:400])
    for b in sorted(set(re.findall(r"\b(buf\d+)\b", line)) & alloc.keys(), key=lambda b: int(b[3:])):
        print(f"    {b} = {alloc[b]}")
PY
}
probe() {  # where the time before the first log line goes
    for c in "import torch" "import torch, torchtitan.train" "import datasets" "import torch._inductor.compile_fx"; do
        local t0; t0=$(date +%s.%N); python3 -c "$c"; echo "python3 -c '$c': $(python3 -c "import time; print(f'{time.time() - $t0:.1f}')") s"
    done
    local t0; t0=$(date +%s.%N); python3 -m graph_trainer.config --job.config_file "$CONFIG_FILE" $L > /dev/null 2>&1
    echo "config check: $(python3 -c "import time; print(f'{time.time() - $t0:.1f}')") s"
    python3 -X importtime -m graph_trainer.config --job.config_file "$CONFIG_FILE" $L 2>&1 >/dev/null \
        | sort -t'|' -k2 -n | tail -8
}
if [[ ${SMI:-} == nvml ]]; then python3 "$(dirname "$0")/nvml_sampler.py" --interval-ms 10 > "$OUT/smi.csv" 2>&1 & SMI_PID=$!
elif [[ -n ${SMI:-} ]]; then nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active \
    --format=csv -lms 500 > "$OUT/smi.csv" 2>&1 & SMI_PID=$!; fi
for part in ${PARTS:-pair first cg fastb}; do
case $part in
pair) cmp "${W}_jit_plain" "--compile.mode jit" "" "jit" "plain command" "$R" ;;
first) first_step "${W}_fast_cold" "$FAST --compile.graph_cache_dir off"
    first_step "${W}_fast_warm" "$FAST --compile.graph_cache_dir off" ;;
first_auto) first_step "${W}_fast_auto_cold" "$FAST"; first_step "${W}_fast_auto_warm" "$FAST" ;;
first_cache) GC="--compile.graph_cache_dir /tmp/graph_cache_${W}_$$"
    first_step "${W}_fast_gc_cold" "$FAST $GC"; first_step "${W}_fast_gc_warm" "$FAST $GC" ;;
plain_cache) GC="--compile.graph_cache_dir /tmp/graph_cache_plain_${W}_$$"
    first_step "${W}_plain_gc_cold" "$GC"; first_step "${W}_plain_gc_warm" "$GC" ;;
cache_bitwise) cache_bitwise fast "$FAST" cold compiled graph; cache_bitwise plain "" cold graph ;;
cold_profile) TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache_prof_${W}_$$ timeout $(( T * 2 )) python3 -m cProfile \
        -o "$OUT/${W}_cold.prof" -m graph_trainer.train --job.config_file "$CONFIG_FILE" \
        ${COMM_MODE:+--comm.mode $COMM_MODE} $L $FAST --compile.graph_cache_dir off --training.steps 1 \
        --job.dump_folder "/tmp/${W}_cold_profile" > "$OUT/${W}_cold_profile.log" 2>&1
    echo "${W}_cold_profile rc=$?"
    python3 -c "import pstats, sys; s = pstats.Stats(sys.argv[1]); s.sort_stats('cumulative').print_stats(60); \
s.sort_stats('tottime').print_stats(30)" "$OUT/${W}_cold.prof" 2>&1 | grep -v "^$" | cut -c1-200 | tee "$OUT/${W}_cold_profile.txt" \
        | head -120 ;;
plain_first) first_step "${W}_plain_first" "--compile.disable_passes cudagraph" ;;
cg_first) first_step "${W}_cg_first" "" ;;
probe) probe ;;
bitwise) bitwise "${W}_bitwise" "" "plain command" ;;
jit_budget) cmp "${W}_jit_budget" "--compile.mode jit" "--compile.memory_budget_gib ${BUDGET_GIB:?set BUDGET_GIB}" "jit" \
    "plain, budget ${BUDGET_GIB} GiB" "$R" ;;
exact) cmp "${W}_exact" "$NO_EXACT" "" "plain without exact_pointwise" "plain command" "$R"
    bitwise "${W}_exact_bitwise" "" "plain command" ;;
data) cmp "${W}_data" "--training.dataloader.num_workers 0" "" "data read in the step" "data worker (default)" "$R" ;;
jit_fast) cmp "${W}_jit_fast" "--compile.mode jit" "$FAST" "jit" "fastest ($FAST)" "$R" ;;
cg) cmp "${W}_cg_fast" "" "$FAST" "plain command" "fastest ($FAST)" 1
    grep -h "cudagraph_pass\|memory policy:" /tmp/"${W}_cg_fast"/runs/A1.log | sed 's/^.*INFO - //' | cut -c1-220 ;;
fastb) T=$(( T * 3 )) cmp "${W}_fast_b" "$FAST" "$FASTEST_B" "fastest" "fastest B" 1 ;;   # tuning compiles long
layouts) layouts "${W}_layouts_fast" "$FAST --compile.graph_cache_dir off"; layouts "${W}_layouts_jit" "--compile.mode jit" ;;
vs_fast) cmp "${W}_vs_fast" "$FAST" "$FAST ${VS:?set VS}" "fastest" "fastest + $VS" "$R" ;;
plain_vs) cmp "${W}_plain_vs" "${VS:?set VS}" "" "plain + $VS" "plain command" "$R" ;;
first_vs) first_step "${W}_first_vs_$(echo "$VS" | tr -c 'a-z0-9_\n' '_' | cut -c1-60)" "${VS:?set VS}" ;;
blocks) cmp "${W}_blocks" "$FAST" "$BLOCKS" "fastest" "blocks ($BLOCKS)" "$R" ;;
blocks_first) first_step "${W}_blocks_cold" "$BLOCKS"; first_step "${W}_blocks_warm" "$BLOCKS" ;;
launches) timeout "$T" ./run_train.sh $L $P --training.steps 9 --job.dump_folder "/tmp/${W}_launches" \
    > "$OUT/${W}_launches.log" 2>&1; echo "${W}_launches rc=$?"
    python3 "$(dirname "$0")/launches.py" "/tmp/${W}_launches/profile_traces/iteration_8/rank0_trace.json" \
        triton_poi_fused__to_copy bfloat16_copy_kernel | tee "$OUT/${W}_launches.txt" ;;
trio) timeout "$T" ./run_train.sh $L $FAST --training.steps 2 --job.dump_folder "/tmp/${W}_trio_warm" \
        > "$OUT/${W}_trio_warm.log" 2>&1; echo "${W}_trio warm-up rc=$?"
    rounds trio "jit:70:--compile.mode jit $L $P;plain:90:$L $P;fastest:60:$L $P $FAST" ;;
norms) rounds norms "plain:110:$L;norm:110:$L --compile.numerics_changing_optim;normres:110:$L \
        --compile.numerics_changing_optim --compile.passes residual_rmsnorm" ;;
iso) cmp "${W}_iso" "$FAST" "$FAST --compile.numerics_changing_optim --compile.passes isolate_rmsnorm" "fastest" \
    "fastest, RMSNorms isolated" "$R" ;;
esac
done
[[ -n ${SMI_PID:-} ]] && kill "$SMI_PID"   # it would hold the caller's pipe open
true
