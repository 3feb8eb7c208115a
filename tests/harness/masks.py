# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The effective loss mask of spec section 3, as the tests build their batches' masks."""

from typing import Optional

import torch


def effective_mask(token_mask: torch.Tensor, sample_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """m_t * s: token mask [b, s] times sample mask [b] (0 drops a sample), as float.

    Build it before micro-batches are formed or sequences packed.
    """
    if token_mask.dim() != 2:
        raise ValueError(f"token mask must be [batch, seq], got shape {tuple(token_mask.shape)}")
    mask = token_mask.float()
    if sample_mask is None:
        return mask
    if sample_mask.shape != (token_mask.size(0),):
        raise ValueError(
            f"sample mask must be [batch] = [{token_mask.size(0)}], got shape {tuple(sample_mask.shape)}"
        )
    return mask * sample_mask.to(mask.dtype).unsqueeze(1)
