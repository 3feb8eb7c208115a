# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Collectives that NCCL has and gloo lacks, for the CPU path.

megatron-core exchanges uneven pieces along the first dimension when tokens are routed
to experts under tensor parallelism (the alltoall dispatcher with expert-tensor
parallelism): an all-gather of differently sized pieces and a reduce-scatter into them.
NCCL takes such lists; gloo gathers equal shapes only and has no list reduce-scatter.
With CUDA these call torch.distributed exactly as upstream does; without it they move
the same values through the collectives gloo has.
"""

import torch
import torch.distributed as dist

from megatron.core.fork.runtime import device as compute_device


def all_gather_uneven(outputs: list, input_: torch.Tensor, group) -> None:
    """``dist.all_gather(outputs, input_)`` where the pieces' first dimensions differ."""
    if compute_device.cuda_available():
        dist.all_gather(outputs, input_, group=group)
        return
    # Pad every piece to the longest, gather equal shapes, keep each piece's own rows.
    longest = max(piece.size(0) for piece in outputs)
    padded = input_.new_zeros((longest, *input_.shape[1:]))
    padded[: input_.size(0)] = input_
    gathered = [torch.empty_like(padded) for _ in outputs]
    dist.all_gather(gathered, padded, group=group)
    for piece, received in zip(outputs, gathered, strict=True):
        piece.copy_(received[: piece.size(0)])


def reduce_scatter_uneven(output: torch.Tensor, inputs: list, group) -> None:
    """``dist.reduce_scatter(output, inputs)`` where the pieces' first dimensions differ."""
    if compute_device.cuda_available():
        dist.reduce_scatter(output, inputs, group=group)
        return
    # Sum the whole tensor over the group, keep this rank's piece.
    total = torch.cat([piece.contiguous() for piece in inputs])
    dist.all_reduce(total, group=group)
    start = sum(piece.size(0) for piece in inputs[: group.rank()])
    output.copy_(total[start : start + output.size(0)])
