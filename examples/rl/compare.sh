#!/usr/bin/env bash
# The RL example three ways, then its figures: MTP heads trained online, heads frozen at the start
# of RL, and no heads (plain sampling). 2 CPU ranks each; a few minutes in all.
#
#   bash examples/rl/compare.sh                      # OUT=runs/rl
#   OUT=/tmp/rl bash examples/rl/compare.sh --steps 5 --sft-steps 5
#
# Checks that the policy's trajectory is one and the same in the three runs (every step's reward,
# policy-gradient loss and grad norm as logged, and the backbone's weights at the end, by
# sha256): the heads never touch the policy. Writes
# $OUT/<heads>/{console.log,summary.json}, $OUT/rl_iterations.svg and $OUT/table.md. Extra
# arguments go to every run (after the script's).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
OUT=${OUT:-runs/rl}
NPROC=${NPROC:-2}
mkdir -p "$OUT"
for heads in online frozen none; do
    echo "compare.sh: RL with heads $heads" >&2
    "$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" examples/rl/grpo.py \
        --heads "$heads" --out "$OUT/$heads" "$@" > /dev/null
done
"$PYTHON" tools/plot_runs.py "heads online=$OUT/online/console.log" "heads frozen=$OUT/frozen/console.log" \
    "no heads=$OUT/none/console.log" -o "$OUT/rl_iterations.svg" \
    --title "GRPO on string reversal: MTP heads online / frozen / none" --table > "$OUT/table.md"
cat "$OUT/table.md"
"$PYTHON" - "$OUT" <<'PY'
import json, sys
from megatron_mtp.runs import read
out = sys.argv[1]
runs = {heads: json.load(open(f"{out}/{heads}/summary.json")) for heads in ("online", "frozen", "none")}
logs = {heads: read(f"{out}/{heads}/console.log").series for heads in runs}
for heads in ("frozen", "none"):
    for field in ("rewards", "backbone sha256"):
        if runs[heads][field] != runs["online"][field]:
            sys.exit(f"compare.sh: error: {field} of the run with heads {heads} differ from the online run's")
    for series in ("policy-gradient loss", "grad norm"):
        if logs[heads][series] != logs["online"][series]:
            sys.exit(f"compare.sh: error: {series} of the run with heads {heads} differs from the online run's")
print(f"the policy's trajectory is the same with heads online, frozen and none: {len(runs['none']['rewards'])} "
      f"rewards, policy-gradient losses and grad norms, backbone sha256 {runs['none']['backbone sha256'][:16]}...")
PY
