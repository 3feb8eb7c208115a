# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Context parallelism's cost: the CP = 2 step against CP = 1 at the same global batch, side by
side in one run, and the peak memory per rank.

    .venv/bin/torchrun --nproc-per-node 2 -m benchmarks.context_parallel_bench [--seq 4096] [--rounds 5]

Two ranks, the benchmarks' GPT (common.SHAPE: hidden 256, 4 layers, 8 heads, vocabulary
8192) with 2 MTP depths, a global batch of two sequences of --seq tokens. CP = 1: the two
ranks are data-parallel, one sequence each. CP = 2: both sequences on both ranks, each rank
holding half of every sequence (upstream's load-balanced chunks), its attention over every
rank's keys and values (megatron.core.fork.runtime.context_parallel). Both models are built once
(the same weights) and their steps alternate; step = forward and backward of the rank's
share (the gradient all-reduce, the same size in both layouts, is left out). Rank 0 prints
median step times, their ratio and, for each rank, the peak growth of its heap during a
step (common.peak_step_heap_mib: torch.profiler's memory timeline cannot follow gloo's
collectives).
"""

import argparse
import statistics
import time
import warnings

warnings.filterwarnings("ignore")

from benchmarks import common


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_mtp.library.initialize import initialize_model_parallel

    dist.init_process_group("gloo")
    if dist.get_world_size() != 2:
        raise SystemExit("run it on 2 ranks: torchrun --nproc-per-node 2 -m benchmarks.context_parallel_bench")
    rank = dist.get_rank()
    models = {}
    for cp in (1, 2):  # each model keeps the process groups it was built with
        initialize_model_parallel(1, 1, None, 1234, cp=cp)
        model, tokens = common.build(2, seq=args.seq, batch=2, context_parallel_size=cp)
        group = parallel_state.get_context_parallel_group() if cp > 1 else None
        share = tokens if cp > 1 else tokens[rank:rank + 1]  # the same global batch of two sequences
        models[cp] = (model, share, group)
        parallel_state.destroy_model_parallel()

    def timed(cp) -> float:
        model, share, group = models[cp]
        dist.barrier()
        start = time.perf_counter()
        common.step(model, share, cp_group=group)
        dist.barrier()
        return time.perf_counter() - start

    for cp in (1, 2):
        timed(cp)  # warm-up
    times = {1: [], 2: []}
    for _ in range(args.rounds):
        for cp in (1, 2):
            times[cp].append(timed(cp))
    peaks = {cp: common.peak_step_heap_mib(lambda cp=cp: common.step(models[cp][0], models[cp][1],
                                                                      cp_group=models[cp][2]))
             for cp in (1, 2)}
    every_rank = [None] * 2
    dist.all_gather_object(every_rank, peaks)
    if rank == 0:
        step = {cp: statistics.median(t) * 1e3 for cp, t in times.items()}
        print(f"seq {args.seq}, global batch 2 sequences, D = 2, {args.rounds} rounds (medians)")
        print(f"step: CP=1 {step[1]:.0f} ms, CP=2 {step[2]:.0f} ms, ratio {step[2] / step[1]:.3f}")
        for r, peak in enumerate(every_rank):
            print(f"peak memory rank {r}: CP=1 {peak[1]:.0f} MiB, CP=2 {peak[2]:.0f} MiB, "
                  f"ratio {peak[2] / peak[1]:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
