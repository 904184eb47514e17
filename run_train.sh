#!/usr/bin/env bash
# graph_trainer launcher (torchtitan-style).
#
#   NGPU        processes (default: visible CUDA GPUs, or 1 CPU process without CUDA)
#   CONFIG_FILE TOML config (default train_configs/debug_model.toml)
#   CONFIG      a config name instead of a file, e.g. graph_trainer_llama3_8b
#               (graph_trainer_llama3_{debugmodel,1b,8b} -> train_configs/*.toml)
#   MODULE      model module (graph_trainer.llama3, the only one)
#   LOG_RANK    ranks whose output is shown (default 0)
#   COMM_MODE   "fake_backend": trace on a fake process group, one process
# Every other argument is passed through as a --section.key value override, e.g.
#   NGPU=8 ./run_train.sh --compile.mode aot_fx_trace --training.steps 20
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

MODULE=${MODULE:-graph_trainer.llama3}
if [[ "$MODULE" != "graph_trainer.llama3" ]]; then
    echo "error: MODULE=$MODULE is not known; the only model module is graph_trainer.llama3." >&2
    exit 2
fi

# The config: CONFIG_FILE, else CONFIG (a name that graph_trainer.config.CONFIG_NAMES maps to a
# file, resolved in Python from the environment), else the debug model.
CONFIG_ARGS=()
if [[ -n "${CONFIG_FILE:-}" ]]; then
    if [[ ! -f "$CONFIG_FILE" ]]; then
        echo "error: config file '$CONFIG_FILE' does not exist. Set CONFIG_FILE to one of: $(ls train_configs/*.toml | tr '\n' ' ')" >&2
        exit 2
    fi
    CONFIG_ARGS=(--job.config_file "$CONFIG_FILE")
elif [[ -z "${CONFIG:-}" ]]; then
    CONFIG_ARGS=(--job.config_file train_configs/debug_model.toml)
fi

# --help: the flag reference, printed without starting torchrun
for arg in "$@"; do
    if [[ "$arg" == "--help" || "$arg" == "-h" ]]; then
        exec python3 -m graph_trainer.config --help
    fi
done

# GPUs this process may use (CUDA_VISIBLE_DEVICES, else nvidia-smi), without importing torch
if [[ -n "${CUDA_VISIBLE_DEVICES+x}" ]]; then
    VISIBLE_GPUS=$(tr ',' '\n' <<< "$CUDA_VISIBLE_DEVICES" | grep -c '[^[:space:]]' || true)
elif command -v nvidia-smi > /dev/null; then
    VISIBLE_GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
else
    VISIBLE_GPUS=0
fi
if [[ -z "${NGPU:-}" ]]; then
    NGPU=$(( VISIBLE_GPUS > 0 ? VISIBLE_GPUS : 1 ))
fi
export NGPU
LOG_RANK=${LOG_RANK:-0}

if [[ "${COMM_MODE:-}" == "fake_backend" ]]; then
    exec python3 -m graph_trainer.train "${CONFIG_ARGS[@]}" --comm.mode fake_backend "$@"
fi

if (( VISIBLE_GPUS > 0 && NGPU > VISIBLE_GPUS )); then
    echo "error: NGPU=$NGPU but only $VISIBLE_GPUS CUDA GPU(s) are visible. Set NGPU<=$VISIBLE_GPUS." >&2
    exit 2
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# As torchtitan's run_train.sh: the CUDA caching allocator with expandable segments (less
# fragmentation; peak *reserved* memory, which metrics report, drops). Unless the caller set one.
if [[ -z "${PYTORCH_ALLOC_CONF:-}${PYTORCH_CUDA_ALLOC_CONF:-}" ]]; then
    export PYTORCH_ALLOC_CONF="expandable_segments:True"
fi
# Validate the command line and what it points at (data, tokenizer, degrees vs NGPU,
# checkpoint folder) once, before any process or model is started.
if ! err=$(python3 -m graph_trainer.config "${CONFIG_ARGS[@]}" "$@" 2>&1 >/dev/null); then
    echo "$err" >&2
    exit 2
fi
# torchrun's own failure report is dropped after a worker's one-paragraph "error: ..."
# (graph_trainer/stderr_filter.py); the exit code is torchrun's, or 2 when a worker stopped
# on such a user error (bad data met late, a non-finite loss, a checkpoint that fails to load).
set +e
{ torchrun --nproc_per_node="$NGPU" --rdzv_backend c10d --rdzv_endpoint="localhost:0" \
    --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
    -m graph_trainer.train "${CONFIG_ARGS[@]}" "$@" 2>&1 1>&4 4>&- \
    | python3 -u -m graph_trainer.stderr_filter 4>&-; } 4>&1
rc=(${PIPESTATUS[@]})
if (( rc[0] != 0 && rc[1] == 3 )); then exit 2; fi
exit "${rc[0]}"
