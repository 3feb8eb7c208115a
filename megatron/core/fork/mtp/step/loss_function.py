# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The main loss a step's forward step returns (megatron-core's calculate_per_token_loss mode).

A loss function has no handle on its model: ``main_loss`` reads the step open in this process
(megatron.core.fork.mtp.step.running: one at a time) for its level and its scale. Outside a step
it is the token level, unscaled.
"""

import torch
import torch.distributed as dist

from megatron.core.fork.mtp.step import running
from megatron.core.fork.mtp.step.normalization import TOKEN


def _context_parallel_group():
    """The CP group when context parallelism is on, else None."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    if parallel_state.get_context_parallel_world_size() == 1:
        return None
    return parallel_state.get_context_parallel_group()


def main_loss(per_token_loss: torch.Tensor, loss_mask: torch.Tensor):
    """A loss function for megatron-core's calculate_per_token_loss mode.

    Args:
        per_token_loss (Tensor): the main head's cross-entropy per position [b, s] (or [s, b]
            flattened alike with the mask; under CP this rank's piece).
        loss_mask (Tensor): 1 where a position's target counts, same shape.

    Returns:
        tuple[Tensor, Tensor, dict]: the tensor to backpropagate, the raw main-loss sum at the
        open step's level (token: the masked cross-entropy summed; sequence: each sequence's
        token mean summed over sequences with valid targets; the token level outside a step, and
        in a step that does not normalize without a level of its own) times the step's main scale;
        the micro-batch's main count (int); and {"main loss sums": [main sum, valid tokens, valid
        sequences]}, the sums that reduce exactly into metrics.
    """
    step = running.active()
    normalization = step.normalization if step is not None else None
    if normalization is not None and normalization.seeds_mtp:
        raise ValueError("main_loss in a framework's step (exact_mtp_step): the framework's main loss is its "
                         "own; drive a SplitStep to take main_loss")
    level = (step.main_loss_level if step is not None else None) or TOKEN
    mask = loss_mask.reshape(loss_mask.size(0), -1).float()
    losses = per_token_loss.float().reshape(mask.shape) * mask
    per_sequence_tokens = mask.sum(dim=1)
    tokens = per_sequence_tokens.sum()
    cp_group = _context_parallel_group()
    if cp_group is not None:
        # Each context-parallel rank holds a piece of every sequence: a sequence's mean divides
        # by all its valid targets, and it is counted once (by CP rank 0) in the step's sums.
        per_sequence_tokens = per_sequence_tokens.detach().clone()
        dist.all_reduce(per_sequence_tokens, group=cp_group)
    sequences = (per_sequence_tokens > 0).sum().to(tokens.dtype)
    if cp_group is not None and dist.get_rank(cp_group) != 0:
        sequences = torch.zeros_like(sequences)
    if level == TOKEN:
        raw, count = losses.sum(), tokens
    else:
        raw, count = (losses.sum(dim=1) / per_sequence_tokens.clamp(min=1)).sum(), sequences
    scale = normalization.main_scale() if normalization is not None else 1.0
    report = torch.stack([raw.detach(), tokens, sequences])
    return raw * scale, count.to(torch.int), {"main loss sums": report}
