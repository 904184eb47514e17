#!/usr/bin/env bash
# One device call on 2x H200 (<= 10 min): Llama3 8B FSDP2 (seq 8192, selective AC), the runs of
# RUNS round-robin, REPEATS rounds (default 1), each run with its own timeout; a run that would
# end past DEADLINE_S (default 570) seconds after the start is skipped (it is expected to take its
# timeout in the first round, then 1.2x its last duration). Ends with one table:
# per run name the median tps of its repeats (min-max), the ratio to the first name and the
# verdict (graph_trainer.tools.stats: "real" when the change exceeds the larger spread).
#   run(kind="nvidia-h100-x2", needs_h200=true, carry=[".whl"], command="REPEATS=2 bash scripts/gpu/h200x2.sh")
#   run(kind="nvidia-h100-x2", needs_h200=true, carry=[".whl"], command='RUNS="jit:110:--compile.mode jit;full:200:--compile.inductor_compilation full" bash scripts/gpu/h200x2.sh')
# On 2x H100 (no needs_h200) the 1B: CONFIG_FILE=train_configs/llama3_1b.toml REPEATS=3 RUNS="jit:90:...;default:90:;full:150:..."
# RUNS="name:timeout_s:flags;..." (flags without ';' or ':'); STEPS (default 12) steps per run,
# medians over steps 4..STEPS; FIRST_ROUND (default 1) continues the rounds of an earlier call on
# the same machine (the table counts every round found under RUN_DIR, default /tmp; two batches
# on one host need their own RUN_DIR); NGPU / CONFIG_FILE override the 8B FSDP2 default (the 8B FSDP2
# needs H200s: its leanest setting is predicted above an H100's memory). Run from another tree
# (an older version of the project unpacked beside this one): cd OTHER && bash THIS/scripts/gpu/h200x2.sh.
# Writes to $OUT: summary.txt (one line per run), table.md, metrics_all.txt, failed_tails.txt,
# kernels_all.md (runs with --profiling.enable_profiling). With COMM_MODE=fake_collectives every
# run is rank 0 of NGPU ranks in one process on one GPU (any one-GPU kind), e.g. the 70B:
#   COMM_MODE=fake_collectives NGPU=64 STEPS=8 RUNS="r70b:560:--model.flavor 70B
#     --parallelism.data_parallel_shard_degree 8 --parallelism.tensor_parallel_degree 8" bash scripts/gpu/h200x2.sh
set -uo pipefail
source "$(dirname "$0")/setup.sh"   # wheels, PYTHONPATH, env, $OUT
export NGPU=${NGPU:-2} CONFIG_FILE=${CONFIG_FILE:-train_configs/llama3_8b.toml}
{ nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
    | tee "$OUT/env.txt"
START=$SECONDS D=${RUN_DIR:-/tmp}
mkdir -p "$D"
declare -A took   # run name -> seconds its last repeat took
run() {  # name, timeout, flags...
    local name=$1 t=$2 rc t0=$SECONDS; shift 2
    local expect=$(( ${took[${name%_*}]:-$(( t * 5 / 6 ))} * 6 / 5 ))
    if (( SECONDS - START + expect > ${DEADLINE_S:-570} )); then echo "== $name skipped (deadline)" | tee -a "$OUT/summary.txt"; return; fi
    timeout "$t" ./run_train.sh --training.steps ${STEPS:-12} --job.dump_folder "$D/r_$name" "$@" > "$D/$name.log" 2>&1
    rc=$?; took[${name%_*}]=$(( SECONDS - t0 )); [ $rc = 0 ] || { echo "### $name rc=$rc"; grep -v "^\[rank1\]" "$D/$name.log" | grep -m1 -A45 "Traceback";
        echo "--- last lines"; grep -v "^\[rank1\]" "$D/$name.log" | tail -12; } >> "$OUT/failed_tails.txt"
    { echo "### $name"; cat "$D/r_$name/metrics.jsonl" 2>/dev/null; } >> "$OUT/metrics_all.txt"
    for k in $D/r_$name/profile_traces/iteration_*/rank0_kernels.md; do
        [ -f "$k" ] && { echo "### $name ($k)"; cat "$k"; } >> "$OUT/kernels_all.md"
    done
    echo "== $name rc=$rc ${took[${name%_*}]} s $(grep -h '"summary"' $D/r_$name/metrics.jsonl 2>/dev/null | python3 -c '
import json,sys
for l in sys.stdin:
    s=json.loads(l)["summary"]; print("tps %.0f mfu %s mem %.1f GiB (alloc %s, predicted %s) loss %.4f trace %.0fs compile %.0fs %s" % (s["tps"], s["mfu"], s["max_memory_gib"], s.get("max_memory_allocated_gib"), s.get("predicted_peak_gib"), s["final_loss"], s.get("trace_time_s") or 0, s.get("compile_time_s") or 0, s.get("memory_policy", "")))')" | tee -a "$OUT/summary.txt"
}
# default: the jit baseline, the plain command and the one-flag fastest setting
RUNS=${RUNS:-"jit:110:--compile.mode jit;default:130:;full:200:--compile.inductor_compilation full"}
IFS=';' read -ra items <<< "$RUNS"
names=()
for it in "${items[@]}"; do IFS=':' read -r n t f <<< "$it"; names+=("$n"); done
for r in $(seq "${FIRST_ROUND:-1}" "${REPEATS:-1}"); do
    for it in "${items[@]}"; do IFS=':' read -r n t f <<< "$it"; run "${n}_$r" "$t" $f; done
done
python3 - "$_root" "$D" "${STEPS:-12}" "${names[@]}" <<'PY' | tee "$OUT/table.md"
import glob, json, sys
sys.path.insert(0, sys.argv.pop(1))   # this script's tree, also when run from another one
from graph_trainer.tools.stats import delta, fmt_value, run_stats, side_stats
d, steps, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
stats = {}
for n in names:
    runs = []
    for path in sorted(glob.glob(f"{d}/r_{n}_[0-9]*/metrics.jsonl")):
        rows = [r for r in map(json.loads, open(path)) if "step" in r]
        if rows and rows[-1]["step"] == steps:
            runs.append(run_stats(rows, warmup=3))
    stats[n] = side_stats(runs)
print("| run | repeats | tps/GPU median (min–max) | vs %s | MFU | peak memory |" % names[0])
print("|---|---:|---:|---|---:|---:|")
for n in names:
    s, base = stats[n]["tps"], stats[names[0]]
    if not s["n"]:
        print(f"| {n} | 0 | failed | | | |"); continue
    d = delta(base, stats[n])["tps"] if base["tps"]["n"] else {"pct": None}
    vs = "n/a" if d["pct"] is None else f"{1 + d['pct'] / 100:.3f}× ({d['verdict']})"
    print(f"| {n} | {s['n']} | {s['median']:,.0f} ({s['min']:,.0f}–{s['max']:,.0f}) | {vs} | "
          f"{fmt_value('mfu', stats[n]['mfu']['median'])} | {fmt_value('memory_gib', stats[n]['memory_gib']['max'])} |")
PY
