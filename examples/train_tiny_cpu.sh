#!/usr/bin/env bash
# Tiny GPT with 2 MTP depths on 4 CPU ranks: TP=2 x PP=2, checkpoint at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/torchrun --nproc-per-node 4 pretrain_gpt_mtp.py \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
    --num-layers 4 --mtp-num-layers 2 --train-iters 40 --save runs/tiny-tp2-pp2 "$@"
