# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Side-by-side cost of the MTP draft objectives (spec section 12) against ``ce``, on CPU.

    .venv/bin/python -m benchmarks.draft_objectives_bench [--rounds 8] [--depths 2]

Every variant (no MTP; isolated MTP heads with ce, kl, tv and e2e_tv; ce without the
sampled-acceptance metrics, --no-mtp-sampled-acceptance) is built once and
the variants take turns one step at a time, at 100% and at 30% valid positions (the
leading 70% of every row masked); medians. MTP step = step(objective) - step(no MTP) at
the same valid fraction; the ratio divides it by ce's. Peak live tensor memory of one step
of each objective (benchmarks.common), against ce's: the objectives keep one [rows, hidden]
gradient like ce, and no [tokens, vocab] tensor outlives its chunk.
"""

import argparse
import statistics
import time
import warnings

warnings.filterwarnings("ignore")

from benchmarks.common import SHAPE, build, peak_step_memory_mib, setup_process, step

OBJECTIVES = ("ce", "kl", "tv", "e2e_tv")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--depths", type=int, default=2)
    args = parser.parse_args()
    setup_process()
    print(f"shape: {SHAPE}, D = {args.depths}, isolation on, {args.rounds} rounds")
    variants = {"no MTP": build(0)}
    variants.update({objective: build(args.depths, True, mtp_loss_type=objective) for objective in OBJECTIVES})
    # ce without the sampled-acceptance metrics: what their extra projection costs ce
    variants["ce, no sampled"] = build(args.depths, True, mtp_sampled_acceptance=False)
    for fraction in (1.0, 0.3):
        for model, tokens in variants.values():
            step(model, tokens, fraction)  # warm-up
        times = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, (model, tokens) in variants.items():
                start = time.perf_counter()
                step(model, tokens, fraction)
                times[name].append(time.perf_counter() - start)
        median = {name: statistics.median(t) for name, t in times.items()}
        base = median.pop("no MTP")
        print(f"{fraction:.0%} valid: no MTP {base * 1000:.1f} ms/step")
        for name, value in median.items():
            mtp, ce_mtp = value - base, median["ce"] - base
            print(f"  {name:15s} {value * 1000:8.1f} ms/step, MTP step {mtp * 1000:7.1f} ms, "
                  f"/ ce's MTP step {mtp / ce_mtp:.3f}")
    print("peak live tensor memory of one step (100% valid):")
    peaks = {objective: peak_step_memory_mib(*variants[objective]) for objective in OBJECTIVES}
    for objective, peak in peaks.items():
        print(f"  {objective:7s} {peak:8.1f} MiB, - ce's {peak - peaks['ce']:+.1f} MiB")


if __name__ == "__main__":
    main()
