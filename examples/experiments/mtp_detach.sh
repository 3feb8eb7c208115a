#!/usr/bin/env bash
# Detached MTP heads beside a backbone they leave untouched: three runs of the README's main
# command (embedded default corpus, 4-layer GPT, Megatron's dropout 0.1, 300 iterations on
# 2 CPU ranks), then their curves and a table (docs/evidence.md shows what this printed).
#
#   bash examples/experiments/mtp_detach.sh                 # about 5 to 9 minutes on 2 cores
#   OUT=/tmp/exp bash examples/experiments/mtp_detach.sh --train-iters 20
#
# Runs: "no MTP" (--mtp-num-layers 0), "attached D=2" (MTP loss into the backbone, scale 0.3),
# "detached D=2" (--mtp-detach-heads: the heads train on the backbone's hidden states, their
# loss stops there). Each writes TensorBoard events and its console log under $OUT/<run>; the
# figures are $OUT/curves_iterations.svg and $OUT/curves_tokens.svg, the table $OUT/table.md.
# The detached run's lm loss and grad norm must equal the no-MTP run's at every iteration, bit
# for bit: the script fails otherwise. Extra arguments go to every run (after the script's).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
OUT=${OUT:-runs/experiments/mtp_detach}
NPROC=${NPROC:-2}
mkdir -p "$OUT"

declare -A RUNS=(
    [no_mtp]="--mtp-num-layers 0"
    [attached_d2]="--mtp-num-layers 2"
    [detached_d2]="--mtp-num-layers 2 --mtp-detach-heads"
)
for name in no_mtp attached_d2 detached_d2; do
    echo "mtp_detach.sh: training $name" >&2
    rm -rf "${OUT:?}/$name" && mkdir -p "$OUT/$name"
    # shellcheck disable=SC2086  # RUNS holds flags, split on purpose
    if ! "$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" pretrain_gpt_mtp.py \
            ${RUNS[$name]} --save "$OUT/$name/checkpoints" --tensorboard-dir "$OUT/$name/tensorboard" \
            --log-timers-to-tensorboard "$@" 2>&1 | tee "$OUT/$name/console.log" \
            | { grep --line-buffered -E "iteration +[0-9]+/|validation loss at" >&2 || true; }; then
        echo "mtp_detach.sh: error: run $name failed (its output: $OUT/$name/console.log)" >&2
        exit 1
    fi
done

runs=("no MTP=$OUT/no_mtp/tensorboard" "attached D=2=$OUT/attached_d2/tensorboard"
      "detached D=2=$OUT/detached_d2/tensorboard")
"$PYTHON" tools/plot_runs.py "${runs[@]}" --x iterations -o "$OUT/curves_iterations.svg" \
    --title "no MTP / attached / detached MTP heads (D=2)" --table > "$OUT/table.md"
"$PYTHON" tools/plot_runs.py "${runs[@]}" --x tokens -o "$OUT/curves_tokens.svg" \
    --title "no MTP / attached / detached MTP heads (D=2)"
cat "$OUT/table.md"
# The claim, checked: every iteration's lm loss and grad norm (TensorBoard, each iteration) and
# every validation lm loss of the detached run equal the no-MTP run's, bit for bit.
"$PYTHON" - "$OUT" <<'PY'
import sys
from megatron_mtp.runs import read
out = sys.argv[1]
without, detached = read(f"{out}/no_mtp/tensorboard"), read(f"{out}/detached_d2/tensorboard")
for name in ("lm loss", "grad norm", "lm loss validation"):
    a, b = without.series.get(name, {}), detached.series.get(name, {})
    if not a or a != b:
        sys.exit(f"mtp_detach.sh: error: {name}: the detached run differs from the run without MTP")
print(f"detached D=2 and no MTP: lm loss and grad norm equal at all {len(without.series['lm loss'])} "
      f"iterations, validation lm loss at {len(without.series['lm loss validation'])} evaluations")
PY
