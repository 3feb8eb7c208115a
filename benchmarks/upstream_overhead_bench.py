# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The fork's MTP step against pristine upstream, side by side in one run (isolation off).

    .venv/bin/python -m benchmarks.upstream_overhead_bench [--version 0.19.2] [--rounds 10] [--vocab 8192]
        [--moe | --architecture mla_moe|delta_net] [--threads N] [--mtp-loss-type ce kl tv e2e_tv]

Four sides build the same GPT (SDPA layer spec, same weights and data):
- fork, library: this checkout's patched build of VERSION (default: `current`), its default MTP
  loss (sparse and chunked: logits only at the positions that count), as a framework calling
  GPTModel gets it: the library's defaults, nothing set;
- fork: the same as a training step that training_log does not print runs it: the step drivers'
  switch, megatron.core.fork.mtp.statistics.STEP_STATISTICS.reporting, set off;
- fork, logged: the same as a printed step (or an evaluation, or a library step asked with
  metrics=True) runs it, the switch set on: the sampled and greedy-draft acceptances at every MTP
  row, against the main head at t + k;
- upstream: pristine VERSION plus only the patches that make it run here (CPU/gloo,
  Python 3.11), i.e. upstream's own MTP loss branch (every position projected).
A step is the forward and backward of one micro-batch in calculate_per_token_loss mode,
with every position valid, or 30% valid (the leading 70% of each row masked, as an RL or
SFT prompt). Each side and D runs in its own long-lived process; the parent makes all twelve
take turns, one step at a time, so all see the same machine load, and prints medians, the
ratio of each fork side to upstream for D = 0, 1 and 3, and the MTP overhead step(D) - step(0)
of each side with its ratio, in wall-clock time and in the processes' CPU time (less sensitive
to other load on the machine; the step's own work with --threads 1). Peak memory: the peak of
live tensor memory during a step of each side, from torch.profiler's record of
every CPU allocation and free (deterministic), one process per side, D and vocabulary size, and
the ratio. Its run time: benchmarks/README.md.

--moe: the same with the MoE layers of benchmarks.common.MOE (the backbone's last three
layers and the MTP layer; seq_aux_loss and z-loss), D = 0 and 1, peak memory at the
step-time vocabulary only. The fork's MoE MTP layer keeps its dense last-depth MLP
(megatron/core/fork/mtp/last_depth.py): what it saves at 30% valid is the sparse loss.

--mtp-loss-type: the objectives the fork sides train (default ce): ce gives the two sides
above; each draft objective (spec section 12; with isolation, which it needs) one side more,
"fork, OBJECTIVE", whose every step measures the metrics (a draft objective trains on the main
head at t + k). Upstream trains its ce as always, so one run prints each draft objective's step
beside the fork's ce step as users get it and beside upstream's.

--architecture: likewise (D = 0 and 1) on an architecture of benchmarks.common.ARCHITECTURES:
mla_moe (DeepSeek-V3's multi-latent attention with YaRN and q/k norms, the MoE layers of
--moe) or delta_net (Qwen3-Next's: a HybridModel of Gated DeltaNet and gated attention, with
upstream's PyTorch Gated DeltaNet kernels on CPU from the runtime patches on both sides).
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
from benchmarks.common import ARCHITECTURES, MOE, SHAPE, build, peak_step_memory_mib, setup_process, step

VARIANTS = {"dense": {}, "moe": MOE, **ARCHITECTURES}  # the model's TransformerConfig fields beside SHAPE

# ce: side -> whether its steps measure the metrics (None: as the library's defaults say, nothing set)
FORK_SIDES = {"fork, library": None, "fork": False, "fork, logged": True}
METRICS_ARGUMENT = {None: "default", False: "0", True: "1"}  # a worker's command-line form


def fork_sides(objectives) -> dict:
    """side -> (whether its steps measure the metrics, the objective it trains)."""
    sides = {}
    for objective in objectives:
        if objective == "ce":
            sides.update({side: (metrics, "ce") for side, metrics in FORK_SIDES.items()})
        else:
            sides[f"fork, {objective}"] = (True, objective)
    return sides


def worker(depths: int, valid_fraction: float, vocab: int, variant: str, threads: int, metrics: bool | None,
           objective: str) -> None:
    """Answer "step" with one step's wall-clock and CPU seconds, until "quit"."""
    import torch

    # the answers on stdout, anything megatron-core prints (a deprecation warning, HybridModel's
    # layer allocation) on stderr
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    setup_process()
    if threads:
        torch.set_num_threads(threads)
    draft = {"mtp_loss_type": objective, "detach": True} if objective != "ce" and depths else {}
    model, tokens = build(depths, vocab=vocab, **VARIANTS[variant], **draft)
    as_step(metrics)
    step(model, tokens, valid_fraction)  # warm-up
    print("ready", file=answers)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        start, cpu_start = time.perf_counter(), time.process_time()
        step(model, tokens, valid_fraction)
        print(time.perf_counter() - start, time.process_time() - cpu_start, file=answers)


def as_step(metrics: bool | None) -> None:
    """What a step driver sets for a step whose metrics a line prints (True) or no line prints
    (False); None: nothing (the library's defaults, and upstream's tree, which has no such metrics)."""
    if metrics is not None:
        from megatron.core.fork.mtp.statistics import STEP_STATISTICS

        STEP_STATISTICS.reporting = metrics


def peak_memory(depths: int, vocab: int, variant: str, metrics: bool | None) -> None:
    setup_process()
    model, tokens = build(depths, vocab=vocab, **VARIANTS[variant])
    as_step(metrics)
    print(peak_step_memory_mib(model, tokens))


def side_env(tree: Path) -> dict:
    return dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join([str(tree), str(REPO_ROOT)]))


def compare_step_time(trees: dict, depths: tuple, valid_fraction: float, vocab: int, rounds: int,
                      variant: str = "dense", threads: int = 0, objectives=("ce",)) -> tuple:
    """({D: {side: median wall seconds}}, {D: {side: median CPU seconds}}): one process per
    side and D, all taking turns one step at a time, so that step(D) - step(0) subtracts steps
    measured under the same load. CPU seconds (the process's, all its threads) depend less
    on what else runs on the machine; with one thread (--threads 1) they are the step's work."""
    sides = {side: (trees["fork"], metrics, objective) for side, (metrics, objective) in fork_sides(objectives).items()}
    sides["upstream"] = (trees["upstream"], None, "ce")
    procs = {(d, side): subprocess.Popen([sys.executable, __file__, "--worker", str(d), str(valid_fraction),
                                          str(vocab), variant, str(threads), METRICS_ARGUMENT[metrics], loss],
                                         env=side_env(tree), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, text=True)
             for d in depths for side, (tree, metrics, loss) in sides.items()}
    try:
        for proc in procs.values():
            assert proc.stdout.readline().strip() == "ready"
        times = {key: [] for key in procs}
        for _ in range(rounds):
            for key, proc in procs.items():
                proc.stdin.write("step\n")
                proc.stdin.flush()
                times[key].append([float(x) for x in proc.stdout.readline().split()])
    finally:
        for proc in procs.values():
            proc.stdin.close()
            proc.wait(timeout=60)
    return tuple({d: {side: statistics.median(t[i] for t in times[(d, side)]) for side in sides} for d in depths}
                 for i in (0, 1))


def compare_peak_memory(trees: dict, depths: int, vocab: int, variant: str = "dense") -> dict:
    peaks = {}
    sides = {side: (trees["fork"], metrics) for side, metrics in FORK_SIDES.items()}
    sides["upstream"] = (trees["upstream"], None)
    for side, (tree, metrics) in sides.items():
        # torch.profiler's memory timeline sometimes asserts on its own records ("duplicate
        # outputs", tensor ids reused): measure again, the number itself is deterministic.
        for _ in range(3):
            run = subprocess.run([sys.executable, __file__, "--peak-memory", str(depths), str(vocab), variant,
                                  METRICS_ARGUMENT[metrics]], env=side_env(tree), capture_output=True, text=True)
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
    parser.add_argument("--moe", action="store_true", help="the MoE model of benchmarks.common.MOE, D = 0 and 1")
    parser.add_argument("--architecture", choices=sorted(ARCHITECTURES),
                        help="an architecture of benchmarks.common.ARCHITECTURES, D = 0 and 1")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads of each step-time process (default: torch's own)")
    parser.add_argument("--mtp-loss-type", nargs="+", default=["ce"], choices=("ce", "kl", "tv", "e2e_tv"),
                        help="the objectives of the fork sides (draft objectives with isolation); upstream trains ce")
    parser.add_argument("--worker", nargs=7, help=argparse.SUPPRESS)
    parser.add_argument("--peak-memory", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    metrics_of = {argument: metrics for metrics, argument in METRICS_ARGUMENT.items()}
    if args.worker is not None:
        return worker(int(args.worker[0]), float(args.worker[1]), int(args.worker[2]), args.worker[3],
                      int(args.worker[4]), metrics_of[args.worker[5]], args.worker[6])
    if args.peak_memory is not None:
        return peak_memory(int(args.peak_memory[0]), int(args.peak_memory[1]), args.peak_memory[2],
                           metrics_of[args.peak_memory[3]])
    if args.moe and args.architecture:
        parser.error("--moe and --architecture: give one")
    variant = args.architecture or ("moe" if args.moe else "dense")
    from megatron_mtp.patched_core import build_tree, current_upstream_version
    from tools.fork_tool.series import make_upstream_tree

    version = args.version or current_upstream_version()
    depths = (0, 1, 3) if variant == "dense" else (0, 1)
    memory_vocabs = (SHAPE["vocab"], 4 * SHAPE["vocab"]) if variant == "dense" else (args.vocab,)
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"fork": build_tree(version), "upstream": make_upstream_tree(version, Path(tmp))}
        drafts = [objective for objective in args.mtp_loss_type if objective != "ce"]
        fork_loss = "isolation off" + (f" (ce), with isolation ({', '.join(drafts)}), upstream ce" if drafts else "")
        print(f"megatron-core {version}, {fork_loss}; shape {SHAPE}, vocab {args.vocab} in the step-time runs"
              + (f"; {variant} {VARIANTS[variant]}" if VARIANTS[variant] else "")
              + (f"; {args.threads} torch thread(s)" if args.threads else ""))
        for valid_fraction in (1.0, 0.3):
            print(f"step time, {valid_fraction:.0%} of positions valid (median of {args.rounds} alternating steps):")
            for kind, seconds in zip(("wall", "CPU"), compare_step_time(
                    trees, depths, valid_fraction, args.vocab, args.rounds, variant, args.threads,
                    dict.fromkeys(args.mtp_loss_type))):
                print(f" {kind} time:")
                report("", {d: {side: t * 1000 for side, t in by_side.items()} for d, by_side in seconds.items()},
                       "ms", "MTP overhead step(D) - step(0)")
        if "ce" not in args.mtp_loss_type:
            return  # the objectives' memory: benchmarks.draft_objectives_bench
        print("peak live tensor memory of a step, all positions valid:")
        for vocab in memory_vocabs:
            report(f"vocab {vocab:6d}, ",
                   {d: compare_peak_memory(trees, d, vocab, variant) for d in depths},
                   "MiB", "MTP branch peak(D) - peak(0)")


def report(label: str, by_depth: dict, unit: str, mtp_part: str) -> None:
    """One line per D and fork side: that side, upstream and their ratio; for D > 0 also what
    MTP adds to D = 0."""
    for depths, value in by_depth.items():
        for side in (name for name in value if name != "upstream"):
            line = (f"  {label}D={depths}: {side:<13} {value[side]:7.1f} {unit}, upstream "
                    f"{value['upstream']:7.1f} {unit} -> ratio {value[side] / value['upstream']:.3f}")
            if depths:
                added = {name: value[name] - by_depth[0][name] for name in (side, "upstream")}
                line += (f"; {mtp_part}: {added[side]:6.1f} {unit}, upstream {added['upstream']:6.1f} {unit} "
                         f"-> ratio {added[side] / added['upstream']:.3f}")
            print(line)

if __name__ == "__main__":
    main()
