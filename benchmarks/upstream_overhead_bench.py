"""The fork's MTP step against pristine upstream, side by side in one run (isolation off).

    .venv/bin/python benchmarks/upstream_overhead_bench.py [--version 0.19.2] [--rounds 10] [--vocab 8192]

Two sides build the same GPT (SDPA layer spec, same weights and data):
- fork: this checkout's patched build of VERSION (default: `current`), its default MTP
  loss (sparse and chunked: logits only at the positions that count);
- upstream: pristine VERSION plus only the patches that make it run here (CPU/gloo,
  Python 3.11), i.e. upstream's own MTP loss branch (every position projected).
A step is the forward and backward of one micro-batch in calculate_per_token_loss mode,
with every position valid, or 30% valid (the leading 70% of each row masked, as an RL or
SFT prompt). Each side and D runs in its own long-lived process; the parent makes all six
take turns, one step at a time, so all see the same machine load, and prints medians, the
ratio fork / upstream for D = 0, 1 and 3, and the MTP overhead step(D) - step(0) of each
side with its ratio. Peak memory: the peak of live tensor memory during a step, from
torch.profiler's record of every CPU allocation and free (deterministic), one process per
side, D and vocabulary size, and the ratio.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
from benchmarks.common import SHAPE, build, peak_step_memory_mib, setup_process, step  # noqa: E402

def worker(depths: int, valid_fraction: float, vocab: int) -> None:
    """Answer "step" with one step's seconds, until "quit"."""
    setup_process()
    model, tokens = build(depths, vocab=vocab)
    step(model, tokens, valid_fraction)  # warm-up
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        start = time.perf_counter()
        step(model, tokens, valid_fraction)
        print(time.perf_counter() - start, flush=True)


def peak_memory(depths: int, vocab: int) -> None:
    setup_process()
    print(peak_step_memory_mib(*build(depths, vocab=vocab)))


def side_env(tree: Path) -> dict:
    return dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join([str(tree), str(REPO_ROOT)]))


def compare_step_time(trees: dict, depths: tuple, valid_fraction: float, vocab: int, rounds: int) -> dict:
    """{D: {side: median seconds}}: one process per side and D, all taking turns one step at
    a time, so that step(D) - step(0) subtracts steps measured under the same load."""
    procs = {(d, side): subprocess.Popen([sys.executable, __file__, "--worker", str(d), str(valid_fraction),
                                          str(vocab)], env=side_env(tree), stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for d in depths for side, tree in trees.items()}
    try:
        for proc in procs.values():
            assert proc.stdout.readline().strip() == "ready"
        times = {key: [] for key in procs}
        for _ in range(rounds):
            for key, proc in procs.items():
                proc.stdin.write("step\n")
                proc.stdin.flush()
                times[key].append(float(proc.stdout.readline()))
    finally:
        for proc in procs.values():
            proc.stdin.close()
            proc.wait(timeout=60)
    return {d: {side: statistics.median(times[(d, side)]) for side in trees} for d in depths}


def compare_peak_memory(trees: dict, depths: int, vocab: int) -> dict:
    peaks = {}
    for side, tree in trees.items():
        # torch.profiler's memory timeline sometimes asserts on its own records ("duplicate
        # outputs", tensor ids reused): measure again, the number itself is deterministic.
        for _ in range(3):
            run = subprocess.run([sys.executable, __file__, "--peak-memory", str(depths), str(vocab)],
                                 env=side_env(tree), capture_output=True, text=True)
            if run.returncode == 0 or "duplicate outputs" not in run.stderr:
                break
        if run.returncode:
            sys.exit(f"{side}, D={depths}, vocab {vocab}: peak-memory process failed:\n{run.stderr[-3000:]}")
        peaks[side] = float(run.stdout.split()[-1])
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", help="upstream version (default: current)")
    parser.add_argument("--rounds", type=int, default=10, help="alternating steps per side and D")
    parser.add_argument("--vocab", type=int, default=SHAPE["vocab"], help="vocabulary size of the step-time runs")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--peak-memory", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        return worker(int(args.worker[0]), float(args.worker[1]), int(args.worker[2]))
    if args.peak_memory is not None:
        return peak_memory(*args.peak_memory)

    from megatron_mtp.patched_core import build_tree, current_upstream_version, make_upstream_tree

    version = args.version or current_upstream_version()
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"fork": build_tree(version), "upstream": make_upstream_tree(version, Path(tmp))}
        print(f"megatron-core {version}, isolation off; shape {SHAPE}, vocab {args.vocab} in the step-time runs")
        for valid_fraction in (1.0, 0.3):
            print(f"step time, {valid_fraction:.0%} of positions valid (median of {args.rounds} alternating steps):")
            seconds = compare_step_time(trees, (0, 1, 3), valid_fraction, args.vocab, args.rounds)
            report("", {d: {side: t * 1000 for side, t in by_side.items()} for d, by_side in seconds.items()},
                   "ms", "MTP overhead step(D) - step(0)")
        print("peak live tensor memory of a step, all positions valid:")
        for vocab in (SHAPE["vocab"], 4 * SHAPE["vocab"]):
            report(f"vocab {vocab:6d}, ", {depths: compare_peak_memory(trees, depths, vocab) for depths in (0, 1, 3)},
                   "MiB", "MTP branch peak(D) - peak(0)")


def report(label: str, by_depth: dict, unit: str, mtp_part: str) -> None:
    """One line per D: both sides and their ratio; for D > 0 also what MTP adds to D = 0."""
    for depths, value in by_depth.items():
        line = (f"  {label}D={depths}: fork {value['fork']:7.1f} {unit}, upstream {value['upstream']:7.1f} {unit} "
                f"-> ratio {value['fork'] / value['upstream']:.3f}")
        if depths:
            added = {side: value[side] - by_depth[0][side] for side in value}
            line += (f"; {mtp_part}: fork {added['fork']:6.1f} {unit}, upstream {added['upstream']:6.1f} {unit} "
                     f"-> ratio {added['fork'] / added['upstream']:.3f}")
        print(line)

if __name__ == "__main__":
    main()
