#!/usr/bin/env bash
# The GPU path in one short run, on a machine with a CUDA device (Transformer Engine, apex and
# flash-attn used where installed): what a session lent a GPU runs first. docs/measurements.md has
# the results of the last run.
#
#   bash tools/gpu_check.sh [RESULTS]    (PYTHON: the interpreter, default .venv/bin/python)
#
# Checks, most telling first, each under its own time limit (the next runs whatever it gave),
# each writing RESULTS/NAME.log and a line to RESULTS/summary.txt:
#   environment     the device, torch, and which of Transformer Engine, apex, flash-attn exist
#   fp32_cpu_gpu    the embedded default, 20 iterations in fp32 on the GPU and on the CPU side by
#                   side, from the same initial weights without dropout: every iteration's losses,
#                   largest relative difference
#   bf16_default    the embedded default on the GPU in bf16 (300 iterations, 3 evaluations, checkpoints)
#   gpu_tests       tests marked gpu: bf16 library steps on NCCL; detached heads leave the backbone
#                   bit-identical on CUDA (MTP RNG streams through the CUDA RNG tracker); packed rows
#                   with Gated DeltaNet through flash-linear-attention (cu_seqlens) against the reference
#   deepseek_v3     examples/configs/deepseek_v3_tiny.sh (MLA + MoE + MTP) in bf16
#   throughput      a 1024-wide, 8-layer GPT at sequence 2048 in bf16: tokens/s at D = 0 and D = 2
#   qwen3_next      examples/configs/qwen3_next_tiny.sh (Gated DeltaNet hybrid) in bf16
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
RESULTS=${1:-runs/gpu_check}
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
mkdir -p "$RESULTS"
SUMMARY=$RESULTS/summary.txt
: > "$SUMMARY"
export PYTHONUNBUFFERED=1

check() {  # NAME SECONDS COMMAND...: COMMAND's output in RESULTS/NAME.log, its status in the summary
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    timeout --kill-after=10 "$limit" "$@" > "$RESULTS/$name.log" 2>&1
    echo "$name: exit $?, $((SECONDS - start)) s" | tee -a "$SUMMARY"
}
trainer() {  # the argv of a one-process run of pretrain_gpt_mtp.py
    echo "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 1 pretrain_gpt_mtp.py
}
# the metrics of a log's iteration lines, as numbers (megatron_mtp.runs reads what tests read)
metrics() {
    "$PYTHON" - "$@" <<'PY'
import sys
from megatron_mtp.runs import parse_console
for path in sys.argv[1:]:
    iterations, validations = parse_console(open(path, errors="replace").read())
    last = max(iterations) if iterations else None
    print(path, "iterations", sorted(iterations)[:1] + sorted(iterations)[-1:], "last", iterations.get(last),
          "validation", validations)
PY
}

environment() {
    nvidia-smi -L && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    "$PYTHON" - <<'PY'
import importlib.util, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(), "nccl", torch.cuda.nccl.version())
print({m: importlib.util.find_spec(m) is not None for m in ("transformer_engine", "apex", "fused_weight_gradient_mlp_cuda",
                                                            "fast_layer_norm", "flash_attn", "fla", "grouped_gemm")})
PY
}
export PYTHON
export -f environment
check environment 30 bash -c environment

# CPU initialization (the same weights on both) and no dropout (no random draws): only the kernels differ
FP32=(--train-iters 20 --log-interval 1 --eval-iters 0 --save-interval 1000 --use-cpu-initialization
      --hidden-dropout 0 --attention-dropout 0)
# two runs at once: the CPU run's dataset indices in a directory of its own
check fp32_cpu_gpu 120 bash -c "
    CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=8 $(trainer) ${FP32[*]} --save $SCRATCH/fp32_cpu --data-cache-path $SCRATCH/cpu_indices > $RESULTS/fp32_cpu.txt 2>&1 &
    $(trainer) ${FP32[*]} --save $SCRATCH/fp32_gpu > $RESULTS/fp32_gpu.txt 2>&1; gpu=\$?; wait \$!; cpu=\$?
    echo gpu exit \$gpu, cpu exit \$cpu
    $PYTHON - $RESULTS/fp32_gpu.txt $RESULTS/fp32_cpu.txt <<'PY'
import sys
from megatron_mtp.runs import parse_console
gpu, cpu = (parse_console(open(path, errors='replace').read())[0] for path in sys.argv[1:])
assert sorted(gpu) == sorted(cpu) == list(range(1, 21)), (sorted(gpu), sorted(cpu))
worst = {}
for step in gpu:
    for tag, value in cpu[step].items():
        if 'loss' in tag or tag in ('grad norm', 'mtp_1 acceptance', 'mtp_2 acceptance'):
            difference = abs(gpu[step][tag] - value) / max(abs(value), 1e-12)
            worst[tag] = max(worst.get(tag, 0.0), difference)
            if step in (1, 20):
                print(step, tag, 'gpu', gpu[step][tag], 'cpu', value)
print('largest relative difference over 20 iterations:', {tag: f'{value:.2e}' for tag, value in worst.items()})
PY"

check bf16_default 120 bash -c "$(trainer) --bf16 --save $SCRATCH/bf16 && echo finished"
metrics "$RESULTS/bf16_default.log" >> "$SUMMARY" 2>&1

check gpu_tests 200 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_gpu.py

check deepseek_v3 100 bash -c "source examples/configs/deepseek_v3_tiny.sh &&
    $(trainer) \"\${MTP_ARGS[@]}\" --bf16 --train-iters 30 --eval-iters 2 --eval-interval 30 --save $SCRATCH/ds"
metrics "$RESULTS/deepseek_v3.log" >> "$SUMMARY" 2>&1

LARGER=(--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048
        --micro-batch-size 4 --global-batch-size 16 --train-iters 30 --log-interval 10 --eval-iters 0
        --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 --lr 3e-4 --bf16 --swiglu
        --normalization RMSNorm --disable-bias-linear --untie-embeddings-and-output-weights)
check throughput 150 bash -c "for depth in 0 2; do echo D=\$depth; $(trainer) ${LARGER[*]} --mtp-num-layers \$depth \
    --save $SCRATCH/larger\$depth --save-interval 1000 | grep -E 'iteration +(20|30)/|error'; done"

check qwen3_next 60 bash -c "source examples/configs/qwen3_next_tiny.sh &&
    $(trainer) \"\${MTP_ARGS[@]}\" --bf16 --train-iters 20 --eval-iters 0 --save $SCRATCH/qn"
metrics "$RESULTS/qwen3_next.log" >> "$SUMMARY" 2>&1
grep -h -E "error|Error|largest relative|^[0-9]+ (lm|grad)|passed|failed|D=|tokens/s" "$RESULTS"/*.log \
    | grep -v -i "warn" | cut -c1-400 | tail -60 >> "$SUMMARY"
cat "$SUMMARY"
