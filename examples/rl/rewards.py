# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The RL example's rewards: the task's exact reward of each response (examples/rl/task.py), and GRPO's
group-normalized advantage A = (r - mean_group) / (std_group + 1e-6), given to every token of the
response."""

import statistics
from dataclasses import dataclass


@dataclass
class Scored:
    """One step's responses on this rank, scored: the sequences the step trains on (prompt + response),
    each one's reward and advantage."""

    sequences: list
    rewards: list[float]
    advantages: list[float]


def advantages_of(rewards: list[float], group: int) -> list[float]:
    out = []
    for i in range(0, len(rewards), group):
        r = rewards[i:i + group]
        mean, std = statistics.fmean(r), statistics.pstdev(r)
        out += [(x - mean) / (std + 1e-6) for x in r]
    return out


def score(task, prompts: list, responses: list, group: int) -> Scored:
    """G responses per prompt, in prompt order."""
    expanded = [p for p in prompts for _ in range(group)]
    if len(expanded) != len(responses):
        raise RuntimeError(f"{len(responses)} responses for {len(expanded)} prompt samples")
    rewards = [task.reward(p, r) for p, r in zip(expanded, responses, strict=True)]
    return Scored([p + r for p, r in zip(expanded, responses, strict=True)], rewards, advantages_of(rewards, group))
