# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Global batches for library use: every data-parallel rank takes its own contiguous slice of a
step's global batch, cut into micro-batches."""

import torch
from megatron.core import parallel_state


def rank_microbatches(tokens: torch.Tensor, loss_mask: torch.Tensor, micro_batch_size: int) -> list:
    """This data-parallel rank's contiguous share of the global batch, in micro-batches."""
    dp_size = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    per_rank = tokens.size(0) // dp_size
    if per_rank * dp_size != tokens.size(0) or per_rank % micro_batch_size:
        raise ValueError(
            f"global batch {tokens.size(0)} must split into {dp_size} data-parallel ranks "
            f"of whole micro-batches of {micro_batch_size}"
        )
    tokens = tokens[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    loss_mask = loss_mask[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    return [
        (tokens[i:i + micro_batch_size], loss_mask[i:i + micro_batch_size])
        for i in range(0, per_rank, micro_batch_size)
    ]
