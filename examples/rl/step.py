# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The RL example's update: one exact optimizer step of the policy gradient on the step's rollouts.

The main loss is A_t * (-log pi(a_t)) through main_loss (megatron.core.fork.mtp.step), at token
level (divided by the step's response tokens) or sequence level (each response's token mean,
averaged over responses: GRPO's), on rows of one response each (padded) or on packed THD rows. One update per batch of
rollouts, so the importance ratio is 1 and its clipping does nothing (no KL term). The MTP heads
train on the same tokens with mtp_detach_heads: their loss never reaches the policy.
"""

from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist


@dataclass
class HeadMetrics:
    """One MTP depth's metrics of a step (the trainer's, on the step's rollout tokens)."""

    loss: float
    acceptance: float  # top-1, teacher-forced
    sampled_acceptance: float  # the mean of sum_v min(p, q)
    greedy_draft_acceptance: float  # the mean of p(argmax q)
    load_balancing_loss: float | None  # the depth's aux_loss, where it has experts


@dataclass
class StepMetrics:
    """What one optimizer step measured, the same on every rank."""

    main_loss: float  # the policy-gradient loss (the cross-entropy at advantage 1)
    heads: list[HeadMetrics]  # depth k at heads[k - 1]
    grad_norm: float
    mtp_grad_norm: float | None  # the MTP group's own norm (detached heads)

    @classmethod
    def of(cls, metrics: dict, depths: int) -> "StepMetrics":
        """From megatron_mtp.library.step.train_step's metrics, under the trainer's console names."""
        heads = [HeadMetrics(metrics[f"mtp_{k} loss"], metrics[f"mtp_{k} acceptance"],
                             metrics[f"mtp_{k} sampled acceptance"], metrics[f"mtp_{k} greedy-draft acceptance"],
                             metrics.get(f"mtp_{k} load balancing loss")) for k in range(1, depths + 1)]
        return cls(metrics["lm loss"], heads, metrics["grad norm"], metrics.get("mtp grad norm"))


def all_sum(values: list[float], group=None) -> list[float]:
    """Summed over the world's ranks (or `group`'s)."""
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, group=group)
    return tensor.tolist()


def replica_share(sequences: list, advantages: list, dp: int, dp_rank: int) -> tuple[list, list]:
    """Every engine's sequences and advantages (rank order: the step's prompt order), then this
    data-parallel replica's share (a replica's CP ranks train the same sequences)."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (sequences, advantages))
    sequences = [s for mine, _ in gathered for s in mine]
    advantages = [a for _, mine in gathered for a in mine]
    share = len(sequences) // dp
    return sequences[dp_rank * share:(dp_rank + 1) * share], advantages[dp_rank * share:(dp_rank + 1) * share]


def policy_gradient_loss(per_token_ce, advantages, loss_mask):
    """A_t * (-log pi(a_t)) per token, normalized by the running step (token or sequence level)."""
    from megatron.core.fork.mtp.step import main_loss

    return main_loss(per_token_ce * advantages, loss_mask)


def forward_step(data_iterator, model, positive_advantage_only=False):
    """Micro-batch = (tokens [b, s+1], loss_mask [b, s], advantages [b, s]). With
    positive_advantage_only the MTP depths see only the responses whose advantage is > 0. Under CP
    the advantages are cut as gpt_per_token_loss cuts the loss mask."""
    from megatron.core import parallel_state

    from megatron.core.fork.runtime import context_parallel
    from megatron_mtp.library.step import gpt_per_token_loss

    tokens, loss_mask, advantages = next(data_iterator)
    sample_mask = (advantages.sum(dim=1) > 0).float() if positive_advantage_only else None
    output, loss_mask = gpt_per_token_loss(model, tokens, loss_mask, sample_mask)
    advantages = advantages.to(loss_mask.device)
    if parallel_state.get_context_parallel_world_size() > 1:
        advantages = context_parallel.shard(advantages, 1, parallel_state.get_context_parallel_group())
    return output, partial(policy_gradient_loss, advantages=advantages, loss_mask=loss_mask)


def packed_forward_step(data_iterator, model, positive_advantage_only=False):
    """Micro-batch = one packed row (`packed_rows`); under CP this rank's pieces of its sequences
    (cut by the padded cu_seqlens), the MTP depths rolled within each sequence."""
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron.core.fork.runtime import context_parallel
    from megatron.core.fork.runtime import device as compute_device

    input_ids, loss_mask, weights, labels, positions, padded, unpadded = next(data_iterator)
    device = compute_device.current_device()
    model_mask = loss_mask * (weights > 0) if positive_advantage_only else loss_mask
    if positive_advantage_only and model.config.sparse_lm_loss:
        raise ValueError("an MTP-only sample mask needs the main head's dense loss: turn sparse_lm_loss off")
    row = [t.to(device) for t in (input_ids, labels, loss_mask, model_mask, weights, positions)]
    padded, unpadded = padded.to(device), unpadded.to(device)
    if parallel_state.get_context_parallel_world_size() > 1:
        group = parallel_state.get_context_parallel_group()
        row = [context_parallel.shard(t, 1, group, padded) for t in row]
    input_ids, labels, loss_mask, model_mask, weights, positions = row
    longest = int((padded[1:] - padded[:-1]).max())
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=unpadded, cu_seqlens_kv=unpadded,
                             cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded,
                             max_seqlen_q=longest, max_seqlen_kv=longest)
    output = model(input_ids, positions, None, labels=labels, loss_mask=model_mask, packed_seq_params=packed)
    return output, partial(policy_gradient_loss, advantages=weights, loss_mask=loss_mask)


def packed_rows(sequences, advantages, task, args) -> list:
    """THD rows of --micro-batch-size sequences each, as RL frameworks pack: every sequence its own
    segment (its tokens the inputs, each target the next token of the same sequence, the last none),
    padded to a multiple of 2 x CP (context parallelism's split; the padding masked), the row's
    last segment padded to the row's fixed length. Per row: (input ids, loss mask, per-token
    advantages, labels, positions from 0 in every sequence [1, T]; padded and real cu_seqlens)."""
    step = 2 * args.context_parallel_size
    length = args.micro_batch_size * -(-task.sequence_length // step) * step
    rows = []
    for first in range(0, len(sequences), args.micro_batch_size):
        input_ids, labels, positions = (torch.zeros(1, length, dtype=torch.long) for _ in range(3))
        loss_mask, weights = torch.zeros(1, length), torch.zeros(1, length)
        padded, real = [0], [0]
        chunk = slice(first, first + args.micro_batch_size)
        for sequence, advantage in zip(sequences[chunk], advantages[chunk], strict=True):
            start, n = padded[-1], len(sequence)
            end = start + -(-n // step) * step
            input_ids[0, start:start + n] = torch.tensor(sequence)
            labels[0, start:start + n - 1] = torch.tensor(sequence[1:])
            loss_mask[0, start + task.prompt_length - 1:start + n - 1] = 1.0  # the positions predicting the response
            weights[0, start:end] = advantage
            positions[0, start:end] = torch.arange(end - start)
            padded.append(end)
            real.append(real[-1] + n)
        padded[-1] = length
        rows.append((input_ids, loss_mask, weights * loss_mask, labels, positions,
                     torch.tensor(padded, dtype=torch.int32), torch.tensor(real, dtype=torch.int32)))
    return rows


def train_step(chunks, optimizer, sequences, advantages, task, args) -> StepMetrics:
    """One exact step over this replica's sequences (prompt + response, responses of any length up to
    the answer's) and per-sequence advantages: one per row (padded), or packed."""
    from megatron.core import parallel_state

    from megatron_mtp.library import step

    depths = chunks[0].module.config.mtp_num_layers or 0

    if len(sequences) != len(advantages):
        raise ValueError(f"{len(sequences)} sequences, {len(advantages)} advantages")
    if args.rows == "packed":
        level = args.main_loss_level
        if level == "sequence":
            # The step counts a packed row as one sequence; GRPO's mean over responses of each one's token
            # mean is the token-level loss with response i's tokens weighted A_i / n_i x N_tok / N_seq.
            lengths = [len(s) - task.prompt_length for s in sequences]  # its predicted tokens
            tokens, responses = all_sum([sum(lengths), len(lengths)], parallel_state.get_data_parallel_group())
            advantages = [a / n * tokens / responses for a, n in zip(advantages, lengths, strict=True)]
            level = "token"
        rows = packed_rows(sequences, advantages, task, args)
        return StepMetrics.of(step.train_step(chunks, optimizer, rows, rows[0][0].size(1), level,
                                              forward_step=partial(packed_forward_step,
                                                                   positive_advantage_only=args.mtp_positive_advantage)),
                              depths)
    tokens = torch.zeros(len(sequences), task.sequence_length, dtype=torch.long)
    loss_mask = torch.zeros(len(sequences), task.sequence_length - 1)
    for row, sequence in enumerate(sequences):
        tokens[row, :len(sequence)] = torch.tensor(sequence)
        loss_mask[row, task.prompt_length - 1:len(sequence) - 1] = 1.0  # the positions predicting the response
    per_token = torch.tensor(advantages, dtype=torch.float32).unsqueeze(1) * loss_mask
    size = args.micro_batch_size
    microbatches = [(tokens[i:i + size], loss_mask[i:i + size], per_token[i:i + size])
                    for i in range(0, tokens.size(0), size)]
    return StepMetrics.of(step.train_step(chunks, optimizer, microbatches, tokens.size(1) - 1, args.main_loss_level,
                                          forward_step=partial(forward_step,
                                                               positive_advantage_only=args.mtp_positive_advantage)),
                          depths)
