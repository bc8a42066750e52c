#!/usr/bin/env bash
# Train titan_gdn with torchtitan's trainer, in the style of torchtitan's run_train.sh.
#
#   NGPU=1 ./run_train.sh                                  # train_configs/debug_model.toml
#   CONFIG_FILE=./train_configs/x.toml ./run_train.sh --training.steps 5
#
# Arguments after the script are torchtitan config overrides (--section.key value).
# NGPU: processes per node. Default: the visible CUDA GPUs, or 1 process when there are none;
#   without an accelerator each process trains on CPU over gloo (titan_gdn/cpu.py).
# LOG_RANK: local ranks whose output is shown (comma list). Default 0.
#
# CONFIG_FILE, or --job.config_file among the arguments: the training TOML (paths in it, and
#   this default, are relative to the working directory: run from the checkout's root).
# Multi-node: run this script once per node with the same NNODES (> 1) and either
#   - MASTER_ADDR (+ MASTER_PORT, default 29500) and NODE_RANK: static rendezvous, node ranks
#     fixed by NODE_RANK (0 on the node at MASTER_ADDR); or
#   - RDZV_ENDPOINT=host:port (or MASTER_ADDR without NODE_RANK): c10d rendezvous at that
#     address, node ranks assigned on arrival; RDZV_ID names the job (default titan_gdn).
# scripts/slurm_example.sbatch shows it under Slurm.

set -e

# The checkout's own packages (titan_gdn, tests.fixtures) import without a pip install.
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PYTHONPATH="${SCRIPT_DIR}${PYTHONPATH:+:${PYTHONPATH}}"

visible_gpus() {
    python -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" \
        2>/dev/null || echo 0
}

fail() { echo "run_train.sh: $*" >&2; exit 2; }
is_count() { [[ "$1" =~ ^[1-9][0-9]*$ ]]; }

if [ -z "${NGPU}" ]; then
    NGPU=$(visible_gpus)
    if [ "${NGPU}" -lt 1 ]; then NGPU=1; fi
fi
is_count "${NGPU}" || fail "NGPU=${NGPU} is not a number of processes (1, 2, ...)"
export LOG_RANK=${LOG_RANK:-0}
for rank in ${LOG_RANK//,/ }; do
    [[ "${rank}" =~ ^[0-9]+$ ]] && [ "${rank}" -lt "${NGPU}" ] ||
        fail "LOG_RANK=${LOG_RANK}: local rank ${rank} does not exist with NGPU=${NGPU} (0 to $((NGPU - 1)))"
done
NNODES=${NNODES:-1}
is_count "${NNODES}" || fail "NNODES=${NNODES} is not a number of nodes (1, 2, ...)"

# The config file: CONFIG_FILE, or --job.config_file among the arguments (taken out of them:
# the file is passed once, below, as torchtitan reads only the first one).
ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --job.config_file=*|--job.config-file=*) FLAG_CONFIG="${1#*=}" ;;
        --job.config_file|--job.config-file) FLAG_CONFIG="$2"; shift ;;
        *) ARGS+=("$1") ;;
    esac
    shift
done
if [ -n "${FLAG_CONFIG}" ] && [ -n "${CONFIG_FILE}" ] && [ "${FLAG_CONFIG}" != "${CONFIG_FILE}" ]; then
    fail "two config files: CONFIG_FILE=${CONFIG_FILE} and --job.config_file ${FLAG_CONFIG}; give one"
fi
CONFIG_FILE=${FLAG_CONFIG:-${CONFIG_FILE:-"./train_configs/debug_model.toml"}}
set -- "${ARGS[@]}"
if [ "${NNODES}" -gt 1 ] && [ -z "${MASTER_ADDR}${RDZV_ENDPOINT}" ]; then
    echo "NNODES=${NNODES} needs MASTER_ADDR (+ NODE_RANK) or RDZV_ENDPOINT" >&2
    exit 2
fi

if [ "${NNODES}" -gt 1 ] && [ -n "${MASTER_ADDR}" ] && [ -n "${NODE_RANK}" ] && [ -z "${RDZV_ENDPOINT}" ]; then
    LAUNCH=(--nnodes="${NNODES}" --node-rank="${NODE_RANK}"
            --master-addr="${MASTER_ADDR}" --master-port="${MASTER_PORT:-29500}")
elif [ -n "${RDZV_ENDPOINT}" ] || { [ -n "${MASTER_ADDR}" ] && [ "${NNODES}" -gt 1 ]; }; then
    LAUNCH=(--nnodes="${NNODES}" --rdzv_backend c10d --rdzv_id="${RDZV_ID:-titan_gdn}"
            --rdzv_endpoint="${RDZV_ENDPOINT:-${MASTER_ADDR}:${MASTER_PORT:-29500}}")
else
    # Port 0: the launcher picks a free one, so concurrent single-node runs do not collide
    # (a MASTER_ADDR left in the environment, by Slurm for one, plays no part on one node).
    LAUNCH=(--rdzv_backend c10d --rdzv_endpoint="localhost:0")
fi

# OpenMP threads that wait sleep instead of spinning: when the cores are shared (another
# process, a second rank), spinning threads made CPU steps 5-20x slower.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}

# Colours only on a terminal: torchrun's workers never see one, so decide here. Arguments that
# follow (e.g. --metrics.no-disable-color-printing) still win.
COLOR=()
if [ ! -t 1 ]; then COLOR=(--metrics.disable_color_printing); fi

# The whole config checked once, in the launcher before torchrun starts any rank: a mistake is
# named in a few lines (titan_gdn/validation.py), not inside each rank's traceback and
# torchrun's report. (Not for --help: torchtitan's own help follows.)
CHECK=(--check $((NGPU * NNODES)))
case " $* " in *" --help "*|*" -h "*) CHECK=() ;; esac

# exec: the launcher (the check, then torchrun: titan_gdn/launch.py) takes this script's
# process, so a signal to it (kill -9 included) reaches the launcher itself; the ranks end with
# their launcher (titan_gdn/train.py). Ctrl-C and SIGTERM end the run with one line and status
# 130 / 143, during the check too.
export PYTORCH_ALLOC_CONF="expandable_segments:True"
exec python "${SCRIPT_DIR}/titan_gdn/launch.py" "${CHECK[@]}" --nproc_per_node="${NGPU}" "${LAUNCH[@]}" \
    --local-ranks-filter "${LOG_RANK}" --role rank --tee 3 \
    -m titan_gdn.train --job.config_file "${CONFIG_FILE}" "${COLOR[@]}" "$@"
