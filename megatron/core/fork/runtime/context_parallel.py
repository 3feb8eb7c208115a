# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Context parallelism (CP) without Transformer Engine: the layout, the data split, the exact
roll of MTP targets across CP ranks, and the key/value gather of the CP core attention.

Layout (upstream's, ``get_batch_on_this_cp_rank``): a sequence of length S is cut into 2*CP
equal chunks and CP rank r holds chunks r and 2*CP-1-r, so that every rank has the same
causal attention work. A packed (THD) row is cut sequence by sequence, each padded sequence
(``cu_seqlens_q_padded``, a multiple of 2*CP) on its own, as Transformer Engine's
``thd_get_partitioned_indices`` does. Everything here is expressed by one map, the global
positions a rank holds (``local_positions``), so that the data split, the roll and the
attention mask cannot disagree about the layout.

The MTP roll (``roll_left``) is exact at any length: the rank's piece of the row is
gathered over the CP group (token ids, labels, masks and positions: integers and a few
floats per token), rolled in global order inside each (padded) sequence with the vacated
last position zero-filled, and cut again. Upstream's ``roll_tensor`` swaps boundary
tokens with isend/irecv on the WORLD group (Megatron-LM #6746) and, for packed rows, maps
boundaries with the unpadded ``cu_seqlens`` (#4494): both are replaced by this.
"""

from itertools import pairwise
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from megatron.core.fork.runtime import device as compute_device


def _size_rank(group) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _segment_bounds(total: int, cu_seqlens_padded: Optional[Tensor]) -> list[tuple[int, int]]:
    """(start, end) of each sequence of a global row of `total` positions (one sequence
    unless packed)."""
    if cu_seqlens_padded is None:
        return [(0, total)]
    bounds = [int(x) for x in cu_seqlens_padded.flatten().tolist()]
    if bounds[0] != 0 or bounds[-1] != total or any(b < a for a, b in pairwise(bounds)):
        raise ValueError(f"packed row of {total} positions does not match cu_seqlens_padded {bounds}")
    return list(pairwise(bounds))


def local_positions(total: int, cp_size: int, cp_rank: int, cu_seqlens_padded: Optional[Tensor] = None,
                    device=None) -> Tensor:
    """Global positions (long, ascending within each chunk) of the tokens CP rank `cp_rank`
    holds of a row of `total` positions: of every sequence, chunks cp_rank and
    2*cp_size-1-cp_rank of 2*cp_size equal ones."""
    pieces = []
    for start, end in _segment_bounds(total, cu_seqlens_padded):
        length = end - start
        if length % (2 * cp_size):
            raise ValueError(
                f"a sequence of {length} positions does not split into 2 x context_parallel_size = "
                f"{2 * cp_size} equal chunks: pad every sequence to a multiple of {2 * cp_size}")
        chunk = length // (2 * cp_size)
        for index in (cp_rank, 2 * cp_size - 1 - cp_rank):
            pieces.append(torch.arange(start + index * chunk, start + (index + 1) * chunk))
    positions = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
    return positions.to(device) if device is not None else positions


def shard(tensor: Tensor, dim: int, cp_group, cu_seqlens_padded: Optional[Tensor] = None) -> Tensor:
    """This CP rank's piece of a full row along `dim` (the data split)."""
    cp_size, cp_rank = _size_rank(cp_group)
    if cp_size == 1:
        return tensor
    index = local_positions(tensor.size(dim), cp_size, cp_rank, cu_seqlens_padded, tensor.device)
    return tensor.index_select(dim, index)


def _gather_pieces(local: Tensor, cp_group) -> list[Tensor]:
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(cp_group))]
    dist.all_gather(pieces, local.contiguous(), group=cp_group)
    return pieces


def unshard(local: Tensor, dim: int, cp_group, cu_seqlens_padded: Optional[Tensor] = None) -> Tensor:
    """The full row along `dim` from every CP rank's piece (no gradient: for token ids, labels,
    masks and positions)."""
    cp_size, _ = _size_rank(cp_group)
    if cp_size == 1:
        return local
    pieces = _gather_pieces(local.detach(), cp_group)
    total = local.size(dim) * cp_size
    full = local.new_empty(local.shape[:dim] + (total,) + local.shape[dim + 1:])
    for rank, piece in enumerate(pieces):
        index = local_positions(total, cp_size, rank, cu_seqlens_padded, local.device)
        full.index_copy_(dim, index, piece)
    return full


def _roll_left_in_segments(full: Tensor, dim: int, bounds: list[tuple[int, int]]) -> Tensor:
    rolled = torch.zeros_like(full)
    for start, end in bounds:
        if end - start > 1:
            rolled.narrow(dim, start, end - start - 1).copy_(full.narrow(dim, start + 1, end - start - 1))
    return rolled


def roll_left(tensor: Tensor, shifts: int, dims: int, cp_group, packed_seq_params=None) -> tuple[Tensor, Tensor]:
    """Upstream ``roll_tensor``'s contract (the tensor rolled left by one along the sequence
    dimension, the last position of every sequence zero, and its sum) for a CP rank's piece
    of the row and for packed rows (sequences as laid out: ``cu_seqlens_q_padded`` when
    given), exact at any sequence length."""
    if shifts != -1:
        raise ValueError(f"the MTP roll moves targets left by one position (shifts=-1), got shifts={shifts}")
    dim = dims % tensor.dim()
    cu_seqlens = None
    if packed_seq_params is not None:
        cu_seqlens = packed_seq_params.cu_seqlens_q_padded
        if cu_seqlens is None:
            cu_seqlens = packed_seq_params.cu_seqlens_q
    full = unshard(tensor, dim, cp_group, cu_seqlens)
    rolled = _roll_left_in_segments(full, dim, _segment_bounds(full.size(dim), cu_seqlens))
    local = shard(rolled, dim, cp_group, cu_seqlens)
    return local, local.sum()


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over the CP group (rank order); the backward pass sums every
    rank's gradient of the gathered tensor and keeps this rank's rows."""

    @staticmethod
    def forward(ctx, local: Tensor, cp_group) -> Tensor:
        ctx.cp_group = cp_group
        ctx.rows = local.size(0)
        return torch.cat(_gather_pieces(local, cp_group), dim=0)

    @staticmethod
    def backward(ctx, grad: Tensor):
        cp_group, rows = ctx.cp_group, ctx.rows
        if compute_device.cuda_available():
            local = grad.new_empty((rows,) + grad.shape[1:])
            dist.reduce_scatter_tensor(local, grad.contiguous(), group=cp_group)
            return local, None
        # gloo has no reduce-scatter: sum the whole gradient, keep this rank's rows.
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=cp_group)
        start = dist.get_rank(cp_group) * rows
        return grad[start:start + rows].clone(), None


def gather_sequence(local: Tensor, cp_group) -> Tensor:
    """[s/CP, ...] -> [s, ...]: every CP rank's rows in rank order (differentiable: keys and
    values of the CP core attention). The global position of each gathered row is
    ``gathered_positions``'s."""
    return _GatherSequence.apply(local, cp_group)


def gathered_positions(local_rows: int, cp_group, cu_seqlens_padded: Optional[Tensor] = None, device=None) -> Tensor:
    """Global positions of the rows ``gather_sequence`` returns, in its (rank) order."""
    cp_size, _ = _size_rank(cp_group)
    total = local_rows * cp_size
    return torch.cat([local_positions(total, cp_size, rank, cu_seqlens_padded, device) for rank in range(cp_size)])
