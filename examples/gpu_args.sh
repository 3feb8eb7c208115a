# TRAIN_ARGS of the GPU runs, shared by gpu_single_node.sh, gpu_multi_node.sh and slurm/.
# A ~1.3B-parameter GPT (Llama-style: RMSNorm, SwiGLU, GQA, RoPE, untied output) with
# Transformer Engine layers in bf16, the distributed optimizer with overlapped communication,
# checkpoints every SAVE_INTERVAL iterations, and a checkpoint before exiting on the exit
# signal (EXIT_SIGNAL, default SIGTERM; the SLURM scripts use SIGUSR1).
#
# Environment: DATA (dataset prefix(es), e.g. "0.7 data/a_text_document 0.3 data/b_text_document"),
# SAVE (checkpoint directory, resumed from when it holds one), CONFIG (an MTP config from
# examples/configs/), TP, PP (parallel sizes), TRAIN_ITERS, SAVE_INTERVAL, GPUS_PER_NODE (default:
# the GPUs nvidia-smi lists here; a login node has none, so a --dry-run there needs it set).
: "${DATA:?set DATA to a dataset prefix written by tools/preprocess_data.py (or a blend)}"
if [ -z "${GPUS_PER_NODE:-}" ]; then
    # "GPU 0: ..." lines only: nvidia-smi without a driver prints its failure on stdout
    GPUS_PER_NODE=$( (nvidia-smi -L 2>/dev/null || true) | { grep -c '^GPU ' || true; })
    if (( GPUS_PER_NODE == 0 )); then
        echo "no GPU found here (nvidia-smi lists none): set GPUS_PER_NODE to the GPUs of each node the run is" \
            "for (a --dry-run on a login node checks the arguments for that many)" >&2
        exit 2
    fi
fi
SAVE=${SAVE:-runs/gpu}
CONFIG=${CONFIG:-examples/configs/deepseek_v3_d1.sh}
TP=${TP:-1}
PP=${PP:-1}
source "$CONFIG"
read -r -a DATA_PATH <<< "$DATA"
# Grouped-query attention, unless the config's attention is multi-latent (they exclude each other).
ATTENTION_ARGS=(--group-query-attention --num-query-groups 4)
if [[ " ${MTP_ARGS[*]} " == *" --multi-latent-attention "* ]]; then
    ATTENTION_ARGS=()
fi

TRAIN_ARGS=(
    --transformer-impl transformer_engine --bf16
    --num-layers 24 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16
    "${ATTENTION_ARGS[@]}" --swiglu --normalization RMSNorm --disable-bias-linear
    --untie-embeddings-and-output-weights --position-embedding-type rope
    --seq-length 4096 --max-position-embeddings 4096
    --micro-batch-size 1 --global-batch-size "${GLOBAL_BATCH_SIZE:-256}"
    --train-iters "${TRAIN_ITERS:-100000}"
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000
    --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
    --data-path "${DATA_PATH[@]}" --split 990,8,2
    --eval-interval 1000 --eval-iters 10 --log-interval 10
    --save "$SAVE" --load "$SAVE" --save-interval "${SAVE_INTERVAL:-1000}"
    --exit-signal-handler --exit-signal "${EXIT_SIGNAL:-SIGTERM}"
    --tensorboard-dir "$SAVE/tensorboard"
    "${MTP_ARGS[@]}"
)
if (( TP > 1 )); then
    TRAIN_ARGS+=(--sequence-parallel)
fi
