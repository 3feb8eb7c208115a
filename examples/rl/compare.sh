#!/usr/bin/env bash
# The RL example six ways, then its figures: MTP heads trained online toward the rollout tokens (ce)
# and toward the policy's own distribution (kl, tv, e2e_tv: spec section 12), heads frozen at the
# start of RL, and no heads (plain sampling). 2 CPU ranks each.
#
#   bash examples/rl/compare.sh                      # OUT=runs/rl
#   OUT=/tmp/rl bash examples/rl/compare.sh --steps 5 --sft-steps 5
#   POLICY=qwen3_5 OUT=runs/rl_qwen3_5 bash examples/rl/compare.sh
#
# POLICY: grpo.py's --policy (llama, the default; qwen3_5: the tiny Qwen3.5-MoE on packed rows at
# --context-parallel-size 2, so every run needs 2 ranks).
#
# Checks that the policy's trajectory is one and the same in every run (every step's reward,
# policy-gradient loss and grad norm as logged, and the backbone's weights at the end, by
# sha256): the heads never touch the policy. Writes $OUT/<variant>/{console.log,summary.json},
# $OUT/rl_iterations.svg and $OUT/table.md. Extra arguments go to every run (after the script's).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
OUT=${OUT:-runs/rl}
NPROC=${NPROC:-2}
POLICY=${POLICY:-llama}
case "$POLICY" in
    llama) POLICY_OPTIONS=(--policy llama); NAME="the Llama policy" ;;
    qwen3_5) POLICY_OPTIONS=(--policy qwen3_5 --context-parallel-size 2)
             NAME="the Qwen3.5-MoE policy (packed rows, CP = 2)" ;;
    *) echo "compare.sh: error: POLICY=$POLICY: llama or qwen3_5" >&2; exit 2 ;;
esac
mkdir -p "$OUT"
declare -A OPTIONS=(
    [online]="--heads online --mtp-loss-type ce"
    [kl]="--heads online --mtp-loss-type kl"
    [tv]="--heads online --mtp-loss-type tv"
    [e2e_tv]="--heads online --mtp-loss-type e2e_tv"
    [frozen]="--heads frozen"
    [none]="--heads none"
)
VARIANTS=(online kl tv e2e_tv frozen none)
for variant in "${VARIANTS[@]}"; do
    echo "compare.sh: RL with ${POLICY_OPTIONS[*]} ${OPTIONS[$variant]}" >&2
    # shellcheck disable=SC2086  # the options are words
    "$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" examples/rl/grpo.py "${POLICY_OPTIONS[@]}" \
        ${OPTIONS[$variant]} --out "$OUT/$variant" "$@" > /dev/null
done
"$PYTHON" tools/plot_runs.py "heads online, ce=$OUT/online/console.log" "heads online, kl=$OUT/kl/console.log" \
    "heads online, tv=$OUT/tv/console.log" "heads online, e2e_tv=$OUT/e2e_tv/console.log" \
    "heads frozen=$OUT/frozen/console.log" "no heads=$OUT/none/console.log" -o "$OUT/rl_iterations.svg" \
    --title "GRPO on string reversal, $NAME: MTP heads online (ce, kl, tv, e2e_tv) / frozen / none" --table > "$OUT/table.md"
cat "$OUT/table.md"
"$PYTHON" - "$OUT" "${VARIANTS[@]}" <<'PY'
import json, sys
from megatron_mtp.runs import read
out, variants = sys.argv[1], sys.argv[2:]
runs = {v: json.load(open(f"{out}/{v}/summary.json")) for v in variants}
logs = {v: read(f"{out}/{v}/console.log").series for v in variants}
for v in variants[1:]:
    for field in ("rewards", "backbone sha256"):
        if runs[v][field] != runs["online"][field]:
            sys.exit(f"compare.sh: error: {field} of the run {v} differ from the online run's")
    for series in ("policy-gradient loss", "grad norm"):
        if logs[v][series] != logs["online"][series]:
            sys.exit(f"compare.sh: error: {series} of the run {v} differs from the online run's")
print(f"the policy's trajectory is the same in all {len(variants)} runs: {len(runs['none']['rewards'])} "
      f"rewards, policy-gradient losses and grad norms, backbone sha256 {runs['none']['backbone sha256'][:16]}...")
PY
