# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Gradient isolation of the MTP heads in megatron-core 0.16.1 (``mtp_detach_heads``): what
megatron-core 0.19's MTP block and GPTModel do upstream. The rest of isolation, for every
version, is megatron.core.fork.mtp.isolation."""

import torch

from megatron.core.fork.mtp.isolation import MTP_GRAD_NORM_GROUP


def backbone_boundary(hidden_states: torch.Tensor, config) -> torch.Tensor:
    """h^0 as it enters depth 1."""
    if not config.mtp_detach_heads:
        return hidden_states
    detached = hidden_states.detach()
    if config.recompute_granularity is not None:
        # A recomputed block whose tensor inputs all lack requires_grad produces outputs
        # without a graph, and its parameters would get no gradient. Make h^0 a leaf that
        # asks for one; its gradient stops here.
        detached.requires_grad_(True)
    return detached


def depth_embedding(embedding, input_ids: torch.Tensor, position_ids: torch.Tensor, config) -> torch.Tensor:
    """e^k = E[x_{t+k}]; under isolation computed without gradient (E gets none from MTP)."""
    if not config.mtp_detach_heads:
        return embedding(input_ids=input_ids, position_ids=position_ids)
    with torch.no_grad():
        return embedding(input_ids=input_ids, position_ids=position_ids)


def tag_mtp_parameters(model) -> None:
    """Under isolation the MTP parameters form their own gradient-norm group (spec section 6).
    (megatron-core 0.17+ tags them upstream, with the same attribute and name.)"""
    if model.config.mtp_detach_heads and model.mtp_process:
        for param in model.mtp.parameters():
            param.grad_norm_group = MTP_GRAD_NORM_GROUP
