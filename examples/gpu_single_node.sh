#!/usr/bin/env bash
# One node, all its GPUs (NCCL).
#
#   DATA=data/corpus_text_document bash examples/gpu_single_node.sh
#   CONFIG=examples/configs/repeated_d3.sh TP=2 DATA=... bash examples/gpu_single_node.sh --train-iters 5000
#   GPUS_PER_NODE=8 DATA=... bash examples/gpu_single_node.sh --dry-run   # on a login node, no GPU
#
# See examples/gpu_args.sh for the model, the schedule and the environment variables; extra
# arguments go to pretrain_gpt_mtp.py (--dry-run checks everything and exits).
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/gpu_args.sh
exec "${PYTHON:-.venv/bin/python}" -m megatron_mtp.launch --standalone \
    --nproc-per-node "$GPUS_PER_NODE" \
    pretrain_gpt_mtp.py "${TRAIN_ARGS[@]}" "$@"
