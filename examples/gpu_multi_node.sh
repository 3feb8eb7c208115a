#!/usr/bin/env bash
# Several nodes without a scheduler: run this on every node with the same MASTER_ADDR (a
# host every node reaches), NNODES and RUN_ID; torchrun's c10d rendezvous assigns the ranks
# (megatron_mtp.launch: torchrun, exiting 0 after a signal to it once the workers saved).
#
#   MASTER_ADDR=node0 NNODES=4 RUN_ID=mtp-1 DATA=... bash examples/gpu_multi_node.sh
#
# On SLURM use examples/slurm/ instead (it also checkpoints before the time limit and
# requeues). See examples/gpu_args.sh for the rest.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MASTER_ADDR:?set MASTER_ADDR to the rendezvous host}" "${NNODES:?set NNODES}"
source examples/gpu_args.sh
exec "${PYTHON:-.venv/bin/python}" -m megatron_mtp.launch \
    --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" --rdzv-id "${RUN_ID:-megatron-mtp}" \
    pretrain_gpt_mtp.py "${TRAIN_ARGS[@]}" "$@"
