"""The fork's MTP step against pristine upstream, side by side in one run (isolation off).

    .venv/bin/python benchmarks/upstream_overhead_bench.py [--version 0.19.2] [--rounds 10]

Two sides build the same GPT with MTP (SDPA layer spec, same weights and data):
- fork: this checkout's patched build of VERSION (default: `current`);
- upstream: pristine VERSION plus only the patches that make it run here (CPU/gloo,
  Python 3.11), i.e. upstream's own MTP loss branch.
A step is the forward and backward of one micro-batch in calculate_per_token_loss mode,
all positions valid. Each side runs in its own long-lived process; the parent makes them
take turns, one step at a time, so both see the same machine load, and prints medians
and the ratio fork / upstream for D = 1 and 3. Peak memory: the peak of live tensor
memory during a step, from torch.profiler's record of every CPU allocation and free
(deterministic), one process per side and D, and the ratio.
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

def worker(depths: int) -> None:
    """Answer "step" with one step's seconds, until "quit"."""
    setup_process()
    model, tokens = build(depths)
    step(model, tokens)  # warm-up
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        start = time.perf_counter()
        step(model, tokens)
        print(time.perf_counter() - start, flush=True)


def peak_memory(depths: int) -> None:
    setup_process()
    print(peak_step_memory_mib(*build(depths)))


def side_env(tree: Path) -> dict:
    return dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join([str(tree), str(REPO_ROOT)]))


def compare_step_time(trees: dict, depths: int, rounds: int) -> dict:
    procs = {side: subprocess.Popen([sys.executable, __file__, "--worker", str(depths)], env=side_env(tree),
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                    text=True)
             for side, tree in trees.items()}
    try:
        for proc in procs.values():
            assert proc.stdout.readline().strip() == "ready"
        times = {side: [] for side in procs}
        for _ in range(rounds):
            for side, proc in procs.items():
                proc.stdin.write("step\n")
                proc.stdin.flush()
                times[side].append(float(proc.stdout.readline()))
    finally:
        for proc in procs.values():
            proc.stdin.close()
            proc.wait(timeout=60)
    return {side: statistics.median(t) for side, t in times.items()}


def compare_peak_memory(trees: dict, depths: int) -> dict:
    return {side: float(subprocess.run([sys.executable, __file__, "--peak-memory", str(depths)], env=side_env(tree),
                                       capture_output=True, text=True, check=True).stdout.split()[-1])
            for side, tree in trees.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", help="upstream version (default: current)")
    parser.add_argument("--rounds", type=int, default=10, help="alternating steps per side and D")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--peak-memory", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        return worker(args.worker)
    if args.peak_memory is not None:
        return peak_memory(args.peak_memory)

    from megatron_mtp.patched_core import build_tree, current_upstream_version, make_upstream_tree

    version = args.version or current_upstream_version()
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"fork": build_tree(version), "upstream": make_upstream_tree(version, Path(tmp))}
        print(f"megatron-core {version}, isolation off, all positions valid; shape {SHAPE}")
        for depths in (1, 3):
            time_med = compare_step_time(trees, depths, args.rounds)
            memory = compare_peak_memory(trees, depths)
            print(f"D={depths}: step fork {time_med['fork'] * 1000:.1f} ms, upstream {time_med['upstream'] * 1000:.1f} ms "
                  f"(median of {args.rounds} alternating) -> ratio {time_med['fork'] / time_med['upstream']:.3f}; "
                  f"peak step memory fork {memory['fork']:.1f} MiB, upstream {memory['upstream']:.1f} MiB "
                  f"-> ratio {memory['fork'] / memory['upstream']:.3f}")


if __name__ == "__main__":
    main()
