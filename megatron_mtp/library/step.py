# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""One optimizer step of the trainer: a split step (megatron.core.fork.mtp.step.split) with one chunk.

The step's batch is known, so its global counts (valid main tokens and sequences) are
all-reduced once up front and every loss branch is seeded with its exact global scale
(spec section 4). An RL or SFT controller drives the same SplitStep with several chunks.
"""

from functools import partial

import torch
from megatron.core import parallel_state

from megatron.core.fork.mtp.step import SplitStep, StepCounts, main_loss, step_counts
from megatron.core.fork.runtime import context_parallel
from megatron.core.fork.runtime import device as compute_device


def gpt_per_token_loss(model, tokens, loss_mask, mtp_sample_mask=None):
    """The model's per-token cross-entropy [b, s] on tokens [b, s+1] (targets: the tokens shifted
    by one) and loss_mask [b, s], both moved to the compute device: (loss, loss_mask there).
    With context parallelism both are this CP rank's pieces of the sequences (upstream's
    load-balanced split, megatron.core.fork.runtime.context_parallel).

    mtp_sample_mask [b]: spec section 12's MTP-only sample mask r (for example advantage > 0).
    It multiplies the masks of the MTP depths and nothing else: the model is given
    loss_mask * r, from which it derives the depths' masks, while the returned loss_mask, which
    the main loss and the step's N_tok count, stays the caller's. The main head's dense loss
    does not read the model's mask; its sparse form does, so the two are refused together."""
    device = compute_device.current_device()
    tokens, loss_mask = tokens.to(device), loss_mask.to(device)
    model_mask = loss_mask
    if mtp_sample_mask is not None:
        if model.config.sparse_lm_loss:
            raise ValueError("an MTP-only sample mask needs the main head's dense loss: sparse_lm_loss would "
                             "compute the main loss only where the MTP mask is set; turn sparse_lm_loss off")
        if mtp_sample_mask.shape != (loss_mask.size(0),):
            raise ValueError(f"the MTP-only sample mask must be [batch] = [{loss_mask.size(0)}], "
                             f"got shape {tuple(mtp_sample_mask.shape)}")
        model_mask = loss_mask * mtp_sample_mask.to(device=device, dtype=loss_mask.dtype).unsqueeze(1)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(inputs.size(1), device=device).unsqueeze(0).expand_as(inputs)
    if parallel_state.get_context_parallel_world_size() > 1:
        cp_group = parallel_state.get_context_parallel_group()
        inputs, labels, loss_mask, model_mask, positions = (
            context_parallel.shard(t, 1, cp_group) for t in (inputs, labels, loss_mask, model_mask, positions))
    return model(inputs, positions, None, labels=labels, loss_mask=model_mask), loss_mask


def gpt_forward_step(data_iterator, model):
    """Micro-batch = (tokens [b, s+1], loss_mask [b, s]); targets are tokens shifted by one.
    The main loss's level is the running step's (main_loss reads it)."""
    tokens, loss_mask = next(data_iterator)
    output, loss_mask = gpt_per_token_loss(model, tokens, loss_mask)
    return output, partial(main_loss, loss_mask=loss_mask)


def global_counts(microbatches: list) -> tuple[StepCounts, int]:
    """The step's counts over all data-parallel ranks, and its routed tokens (every input
    position: the MoE router losses' T): one small all-reduce. A micro-batch is (tokens,
    loss_mask, ...) of whole sequences, the same on every context-parallel rank of a
    data-parallel replica, so the reduce is over data-parallel ranks only."""
    return step_counts([batch[1] for batch in microbatches], group=parallel_state.get_data_parallel_group())


def train_step(chunks, optimizer, microbatches: list, seq_length: int, main_loss_level: str = "token",
               counts_up_front: bool = True, forward_step=gpt_forward_step, metrics: bool = True) -> dict:
    """Forward/backward over this rank's micro-batches, then one optimizer step; the step's
    exact metrics (see SplitStep.finish), the same on every rank. `forward_step` reads the
    micro-batches (tokens, loss_mask, ...): gpt_forward_step, or a controller's own loss on the
    same forward (examples/rl/step.py's policy gradient). `metrics`: the project's steps report
    every metric (their callers print each step's); False skips the sampled and greedy-draft
    acceptances' work (SplitStep.begin)."""
    step = SplitStep(chunks, optimizer, forward_step, seq_length=seq_length,
                     micro_batch_size=microbatches[0][0].size(0), main_loss=main_loss_level)
    counts, routed_tokens = global_counts(microbatches)
    step.begin(counts if counts_up_front else None, routed_tokens=routed_tokens, metrics=metrics)
    step.accumulate(microbatches)
    return step.finish()
