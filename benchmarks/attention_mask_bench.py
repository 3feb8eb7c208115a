#!/usr/bin/env python3
# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""One training step with and without the dataloader's attention mask, side by side.

    .venv/bin/python -m benchmarks.attention_mask_bench --rounds 2 --iters 8

pretrain_gpt_mtp.py on 2 CPU ranks with TP=2 (the mask is built on tensor rank 0 and
broadcast to the other), a tiny model on mock data. The two settings take turns, one whole
run each per round (the trainer's default, no mask; then --create-attention-mask-in-dataloader,
Megatron-LM's default); each run's step time is the median of Megatron-LM's "elapsed time
per iteration" over its iterations after the first two (warm-up).
"""

import argparse
import statistics
import sys

from tests.harness.trainer import train

MODEL = ("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--micro-batch-size", "4",
         "--global-batch-size", "8", "--log-interval", "1", "--eval-iters", "0", "--lr-warmup-iters", "0",
         "--lr", "1e-3", "--mtp-num-layers", "1", "--tensor-model-parallel-size", "2",
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512")
SIDES = {"no mask (trainer default)": (), "mask (--create-attention-mask-in-dataloader)":
         ("--create-attention-mask-in-dataloader",)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=256)
    args = parser.parse_args()
    seq = ("--seq-length", str(args.seq_length), "--max-position-embeddings", str(args.seq_length))
    times = {side: [] for side in SIDES}
    for _ in range(args.rounds):
        for side, extra in SIDES.items():
            run = train(2, *MODEL, *seq, "--train-iters", str(args.iters), *extra, timeout=1200)
            times[side] += [v["elapsed time per iteration (ms)"] for i, v in run.iterations.items() if i > 2]
    base = statistics.median(times["no mask (trainer default)"])
    print(f"| dataloader | step (median of {len(times[next(iter(SIDES))])}) | ratio |\n| --- | --- | --- |")
    for side, values in times.items():
        print(f"| {side} | {statistics.median(values):.1f} ms | {statistics.median(values) / base:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
