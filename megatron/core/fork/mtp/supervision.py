# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""What each MTP depth is trained to predict (spec section 3).

Depth k at position t predicts x_{t+k+1}: its labels are the next-token labels rolled
left by k and its mask is the effective mask rolled by k, zero wherever the target
would cross the end of the row or of a packed (THD) segment. Rolling uses upstream's
``roll_tensor``, which zero-fills the vacated positions and respects ``cu_seqlens``.
"""

from typing import Iterator

import torch
from megatron.core.transformer.multi_token_prediction import roll_tensor


def next_token_labels(input_ids: torch.Tensor, packed_seq_params=None, cp_group=None):
    """Labels = input ids rolled left by one, with a mask that is zero where no next token exists."""
    labels, _ = roll_tensor(input_ids, shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=packed_seq_params)
    ones = torch.ones_like(input_ids, dtype=torch.float)
    has_next, _ = roll_tensor(ones, shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=packed_seq_params)
    return labels, has_next


def check_shapes(reference_name: str, reference: torch.Tensor, **tensors) -> None:
    """Every given tensor must have the shape of `reference` ([batch, seq])."""
    for name, tensor in tensors.items():
        if tensor is not None and tensor.shape != reference.shape:
            raise ValueError(
                f"{name} must have the shape of {reference_name} {tuple(reference.shape)}, "
                f"got {tuple(tensor.shape)}"
            )


def labels_and_mask(model, input_ids, labels, loss_mask, packed_seq_params=None):
    """The (labels, loss mask) [b, s] the MTP depths are derived from, or None when nothing
    is supervised (generation: no labels, not training). Without labels they are the input
    ids rolled left by one (0.16.1's GPTModel cannot derive them; this version does)."""
    if labels is None:
        if not model.training:
            return None
        check_shapes("input_ids", input_ids, loss_mask=loss_mask)
        labels, has_next = next_token_labels(input_ids, packed_seq_params, model.cp_group)
        return labels, has_next if loss_mask is None else loss_mask.float() * has_next
    check_shapes("labels", labels, loss_mask=loss_mask)
    return labels, torch.ones_like(labels, dtype=torch.float) if loss_mask is None else loss_mask


def depth_targets(labels: torch.Tensor, loss_mask: torch.Tensor, depths: int,
                  packed_seq_params=None, cp_group=None) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Yield (k, labels_k, mask_k) for k = 1..depths; each roll builds on the previous one."""
    for k in range(1, depths + 1):
        labels, _ = roll_tensor(labels, shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=packed_seq_params)
        loss_mask, _ = roll_tensor(loss_mask, shifts=-1, dims=-1, cp_group=cp_group,
                                   packed_seq_params=packed_seq_params)
        yield k, labels, loss_mask


def rolled_by_depth(rows: torch.Tensor, depths: int, packed_seq_params=None, cp_group=None):
    """``rows`` [s, b, n] (the whole sequence) at t + k for k = 1..depths, each [s, b, n], detached:
    h^0's rows, from which the main head's distribution p^k_t is projected, or the positions
    whose main-head logits it reads. Each roll builds on the previous one; a position whose
    t + k leaves its sequence gets zeros (it is masked at depth k)."""
    rolled, rows = [], rows.detach().permute(1, 2, 0)  # [b, n, s]: 0.16.1 rolls packed rows on the last dim
    for _ in range(depths):
        rows, _ = roll_tensor(rows, shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=packed_seq_params)
        rolled.append(rows.permute(2, 0, 1))
    return rolled
