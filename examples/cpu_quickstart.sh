#!/usr/bin/env bash
# CPU quick start: your own jsonl (default: a sample written from the Python Language
# Reference) -> an indexed dataset -> a tiny GPT with MTP on 2 CPU ranks, checkpointed.
#
#   bash examples/cpu_quickstart.sh                                  # defaults
#   CONFIG=examples/configs/repeated_d3.sh bash examples/cpu_quickstart.sh --train-iters 50
#
# WORK (default runs/quickstart/CONFIG's name, so each config resumes its own run) holds the
# sample, the dataset, the checkpoints and TensorBoard.
#   JSONL=my.jsonl JSON_KEY=content TOKENIZER=tokenizer.json bash examples/cpu_quickstart.sh
#
# Extra arguments go to pretrain_gpt_mtp.py (after this script's, so they win).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
CONFIG=${CONFIG:-examples/configs/deepseek_v3_d1.sh}
WORK=${WORK:-runs/quickstart/$(basename "$CONFIG" .sh)}
TOKENIZER=${TOKENIZER:-bytes}
source "$CONFIG"
mkdir -p "$WORK"
# Warm up for a tenth of the run, whatever its --train-iters, unless the arguments say otherwise
# (Megatron-LM takes one warmup flag).
WARMUP=(--lr-warmup-fraction 0.1)
for arg in "$@"; do
    if [[ $arg == --lr-warmup-* ]]; then
        WARMUP=()
    fi
done

JSONL=${JSONL:-$WORK/sample.jsonl}
if [[ ! -f "$JSONL" ]]; then
    "$PYTHON" - "$JSONL" <<'PY'
import json, sys
from pydoc_data.topics import topics
with open(sys.argv[1], "w") as out:
    for name in sorted(topics):
        out.write(json.dumps({"text": topics[name]}) + "\n")
PY
fi
"$PYTHON" tools/preprocess_data.py --input "$JSONL" --json-key "${JSON_KEY:-text}" \
    --tokenizer "$TOKENIZER" --output-prefix "$WORK/data" --workers 2

"$PYTHON" -m torch.distributed.run --nproc-per-node 2 pretrain_gpt_mtp.py \
    --data-path "$WORK/data" --split 98,2,0 \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 \
    --micro-batch-size 8 --global-batch-size 16 --train-iters 200 \
    --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine "${WARMUP[@]}" --weight-decay 0.01 --clip-grad 1.0 \
    --eval-interval 100 --eval-iters 4 --log-interval 10 \
    --save "$WORK/checkpoints" --load "$WORK/checkpoints" --save-interval 100 \
    --tensorboard-dir "$WORK/tensorboard" \
    "${MTP_ARGS[@]}" "$@"
