# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Side-by-side cost of the MTP model options on CPU (one process, gloo world of one).

    .venv/bin/python -m benchmarks.mtp_model_bench

Step time (forward + backward of one micro-batch) is measured in one run with the
variants interleaved round by round, and reported as medians and ratios:
isolation on vs off (distinct layers, D = 2) and repeated vs distinct (isolation on).
Peak live tensor memory of a step for D = 0, 1 and 3 (benchmarks.common), and what one
more depth adds.
"""

import statistics
import time
import warnings

warnings.filterwarnings("ignore")

from benchmarks.common import SHAPE, build, peak_step_memory_mib, setup_process, step


def timing(rounds=8):
    variants = {
        "attached, distinct": build(2, False, False),
        "isolated, distinct": build(2, True, False),
        "isolated, repeated": build(2, True, True),
    }
    for model, tokens in variants.values():
        step(model, tokens)  # warm-up
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, (model, tokens) in variants.items():
            start = time.perf_counter()
            step(model, tokens)
            times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(t) for name, t in times.items()}
    for name, value in med.items():
        print(f"  {name:20s} {value * 1000:8.1f} ms/step (median of {rounds})")
    print(f"  ratio isolation on / off (distinct, D=2):   {med['isolated, distinct'] / med['attached, distinct']:.3f}")
    print(f"  ratio repeated / distinct (isolated, D=2):  {med['isolated, repeated'] / med['isolated, distinct']:.3f}")


def main():
    setup_process()
    print(f"shape: {SHAPE}")
    print("step time:")
    timing()
    logits_mb = SHAPE["batch"] * SHAPE["seq"] * SHAPE["vocab"] * 4 / 2**20
    print(f"peak live tensor memory of one step (one depth's fp32 logits: {logits_mb:.0f} MiB):")
    peaks = {depths: peak_step_memory_mib(*build(depths, depths > 0)) for depths in (0, 1, 3)}
    for depths, peak in peaks.items():
        print(f"  D={depths}: {peak:8.1f} MiB")
    print(f"  per extra depth (D=3 vs D=1, divided by 2): {(peaks[3] - peaks[1]) / 2:.1f} MiB")


if __name__ == "__main__":
    main()
