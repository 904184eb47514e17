#!/usr/bin/env bash
# graph_trainer launcher (torchtitan-style).
#
#   NGPU        processes (default: visible CUDA GPUs, or 1 CPU process without CUDA)
#   CONFIG_FILE TOML config (default train_configs/debug_model.toml)
#   CONFIG      a config name instead of a file, e.g. graph_trainer_llama3_8b
#               (graph_trainer_llama3_{debugmodel,1b,8b} -> train_configs/*.toml)
#   MODULE      model module (graph_trainer.llama3, the only one)
#   LOG_RANK    local ranks whose output is shown, on every host (default 0)
#   COMM_MODE   "fake_backend": trace the NNODES x NGPU layout on a fake process group, one process
#               (a dry run); "fake_collectives": one process trains as rank 0 of that layout on
#               one device, every collective a local copy (its compute and host time; numerics meaningless)
#   NNODES      hosts (default 1); the world is NNODES x NGPU ranks, NGPU on every host
#   NODE_RANK   this host's index, 0..NNODES-1 (default 0); its ranks are
#               NODE_RANK*NGPU .. NODE_RANK*NGPU+NGPU-1, as on one host of NNODES*NGPU
#   RDZV_ENDPOINT  host:port of the NODE_RANK=0 host (required when NNODES>1; default
#               localhost:0 on one host). Across hosts torchrun's static rendezvous: the
#               NODE_RANK=0 host serves the store on that port, the others wait for it
#               (c10d's dynamic rendezvous ignores --node_rank and orders hosts itself).
#               Each host needs the data and tokenizer at the same paths; a checkpoint
#               needs --job.dump_folder on a filesystem shared by the hosts.
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
LOG_RANK=${LOG_RANK:-0}

# Hosts: NNODES x NGPU ranks in all; this host's ranks follow from NODE_RANK.
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
if [[ ! "$NGPU" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: NGPU=$NGPU is not a positive integer (processes on this host)." >&2
    exit 2
fi
if [[ ! "$NNODES" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: NNODES=$NNODES is not a positive integer (the number of hosts)." >&2
    exit 2
fi
if [[ ! "$NODE_RANK" =~ ^(0|[1-9][0-9]*)$ ]] || (( NODE_RANK >= NNODES )); then
    echo "error: NODE_RANK=$NODE_RANK must be an integer from 0 to NNODES-1=$(( NNODES - 1 )) (this host's index)." >&2
    exit 2
fi
export NGPU NNODES NODE_RANK

if [[ "${COMM_MODE:-}" == "fake_backend" || "${COMM_MODE:-}" == "fake_collectives" ]]; then
    # one process: rank 0 of the whole NNODES x NGPU world, on a fake process group
    NGPU=$(( NNODES * NGPU )) exec python3 -m graph_trainer.train "${CONFIG_ARGS[@]}" --comm.mode "$COMM_MODE" "$@"
elif [[ -n "${COMM_MODE:-}" && "$COMM_MODE" != "default" ]]; then
    echo "error: COMM_MODE=$COMM_MODE is not supported; use fake_backend (a dry run) or fake_collectives (rank 0's step on one device)." >&2
    exit 2
fi

if (( NNODES > 1 )); then
    if [[ -z "${RDZV_ENDPOINT:-}" ]]; then
        echo "error: NNODES=$NNODES needs RDZV_ENDPOINT=host:port of the NODE_RANK=0 host (the same on every host), e.g. RDZV_ENDPOINT=host0:29500." >&2
        exit 2
    fi
    if [[ ! "$RDZV_ENDPOINT" =~ ^[^[:space:]]+:[0-9]+$ || "$RDZV_ENDPOINT" =~ :0+$ ]]; then
        echo "error: RDZV_ENDPOINT=$RDZV_ENDPOINT is not host:port with a fixed port, e.g. RDZV_ENDPOINT=host0:29500." >&2
        exit 2
    fi
    # static: --node_rank decides the ranks (c10d would ignore it); the NODE_RANK=0 host serves the store
    RDZV_ARGS=(--nnodes "$NNODES" --node_rank "$NODE_RANK" --rdzv_backend static --rdzv_endpoint "$RDZV_ENDPOINT")
else
    RDZV_ARGS=(--nnodes 1 --rdzv_backend c10d --rdzv_endpoint "${RDZV_ENDPOINT:-localhost:0}")
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
if (( NNODES == 1 && NGPU == 1 )); then
    # one process: no launcher and no separate check (each starts an interpreter that imports
    # torch); the trainer checks its input first and reports it the same way
    exec python3 -m graph_trainer.train "${CONFIG_ARGS[@]}" "$@"
fi
# Validate the command line and what it points at (data, tokenizer, degrees vs the
# NNODES x NGPU world, checkpoint folder) once, before any process or model is started.
if ! err=$(python3 -m graph_trainer.config "${CONFIG_ARGS[@]}" "$@" 2>&1 >/dev/null); then
    echo "$err" >&2
    exit 2
fi
# torchrun's own failure report is dropped after a worker's one-paragraph "error: ..."
# (graph_trainer/stderr_filter.py); the exit code is torchrun's, or 2 when a worker stopped
# on such a user error (bad data met late, a non-finite loss, a checkpoint that fails to load).
set +e
{ torchrun --nproc_per_node="$NGPU" "${RDZV_ARGS[@]}" \
    --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
    -m graph_trainer.train "${CONFIG_ARGS[@]}" "$@" 2>&1 1>&4 4>&- \
    | python3 -u -m graph_trainer.stderr_filter 4>&-; } 4>&1
rc=(${PIPESTATUS[@]})
if (( rc[0] != 0 && rc[1] == 3 )); then exit 2; fi
exit "${rc[0]}"
