# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""An independent check of a rejection-sampling verifier: what its conditional acceptance should have been,
from a teacher-forced recompute of the text it decoded (runner.teacher_forced: the trained chain), at the
positions it drafted at (tests/test_rejection_sampling.py; the library's own prediction, along any chain,
is megatron_mtp.serving.engine_replay)."""

import torch

from megatron_mtp.serving import speculative


def drafted_acceptance(runner, prompt: list[int], output: list[int], steps: list, stats: speculative.Stats,
                       temperature: float, draft_sample_method: str = "probabilistic") -> None:
    """A verify step drafting at t that reached depth k (its drafts 1 .. k - 1 accepted, so the text holds
    them) accepts depth k's draft with probability sum_v min(p, q) (greedy drafts: p(argmax q)), p and q
    the main head's and depth k's distributions there: the teacher-forced ones at t on prompt + output.
    `steps` are speculative.speculative's; a verify step's t is the position before the token it verifies
    from. A step counts at depth k only where the text holds x_{t+k+1}."""
    speculative.check_draft_sample_method(draft_sample_method)
    rate = speculative.greedy_draft_acceptance if draft_sample_method == "greedy" else speculative.sampled_overlap
    main, per_depth = runner.teacher_forced(torch.tensor([prompt + output]), depths=stats.depths)
    rates = [rate(main, logits, k, temperature) for k, logits in enumerate(per_depth, start=1)]
    t = len(prompt) - 2
    for drafts, tokens in steps:
        accepted = len(tokens) - 1
        for k in range(1, min(accepted + 1, stats.depths) + 1 if drafts else 0):  # the depths this step reached
            if k > len(rates) or t >= rates[k - 1].shape[0]:
                break
            stats.drafted(k - 1, float(rates[k - 1][t]), accepted >= k)
        t += len(tokens)
