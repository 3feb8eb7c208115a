#!/usr/bin/env bash
# The body of the SLURM batch scripts in this directory (submit them from the repository
# root). One task per node runs torchrun, which starts one process per GPU; torchrun's c10d
# rendezvous on the first node of the allocation assigns the ranks.
#
# Before the time limit SLURM sends SIGUSR1 to this script (#SBATCH --signal=B:USR1@...).
# It passes the signal on to the training processes of every node (torchrun's children,
# nothing else: helper processes such as the asynchronous checkpoint writer must not get
# it) until they exit: they finish the current iteration, save a checkpoint and exit with
# status 0, and so does torchrun. The script then requeues the job, which resumes from that
# checkpoint (--load is --save). A run that ends for any other reason is not requeued.
#
# ARGS_FILE (default examples/gpu_args.sh) sets TRAIN_ARGS, the arguments of
# pretrain_gpt_mtp.py; GPUS_PER_NODE, PYTHON and RDZV_PORT have defaults.
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:?submit with sbatch from the repository root}"
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}  # the allocation's, before gpu_args.sh probes
source "${ARGS_FILE:-examples/gpu_args.sh}"
PYTHON=${PYTHON:-.venv/bin/python}
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
echo "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): $SLURM_NNODES node(s) x $GPUS_PER_NODE process(es)," \
    "rendezvous at $HEAD"

stop_requested=0
trap 'stop_requested=1; echo "pre-timeout signal: saving and stopping"' USR1

# A node-local file on every node naming its torchrun, for passing the signal on.
TORCHRUN_PID=/tmp/megatron-mtp-$SLURM_JOB_ID.torchrun
srun --kill-on-bad-exit=1 --ntasks-per-node=1 bash -c '
    trap "" USR1  # inherited by torchrun and its workers until the workers install their handler
    "$0" -m torch.distributed.run --nnodes "$SLURM_NNODES" --nproc-per-node "$1" \
        --rdzv-backend c10d --rdzv-endpoint "$2" --rdzv-id "$SLURM_JOB_ID" "${@:4}" &
    echo $! > "$3"
    wait $!
' "$PYTHON" "$GPUS_PER_NODE" "$HEAD:${RDZV_PORT:-29500}" "$TORCHRUN_PID" \
    pretrain_gpt_mtp.py "${TRAIN_ARGS[@]}" --exit-signal-handler --exit-signal SIGUSR1 &
step=$!

while kill -0 "$step" 2>/dev/null; do
    if (( stop_requested )); then
        # Repeated until the run exits, in case the signal came before the training processes
        # had their handler.
        srun --overlap --ntasks-per-node=1 bash -c "pkill -USR1 --parent \$(cat $TORCHRUN_PID)" 2>/dev/null || true
    fi
    sleep 5 & wait $! || true  # the trap interrupts this wait
done
status=0
wait "$step" || status=$?

if (( stop_requested )) && (( status == 0 )); then
    echo "checkpoint saved; requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
