# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The [rows, vocabulary shard] buffers that the chunks of one chunked projection share.

Each chunk of the sparse losses (megatron.core.fork.mtp.sparse_cross_entropy) writes its logits
and, where it reads the main head at t + k (megatron.core.fork.mtp.draft_objectives), the main
head's rows there and both distributions into buffers allocated at the first chunk and reused by
every other. On a GPU a tensor of its own per chunk would cost no more (the caching allocator
hands back the last chunk's memory); on the CPU each is fresh pages from the kernel, whose faults
cost more than the pass that fills them: a fresh [1024, 8192] float32 softmax measured 4x the one
written into a buffer, and such faults were most of what the acceptances cost a step.
"""

import torch


class ChunkBuffers:
    """Named [rows, columns] buffers of one dtype and device, each allocated at its first use."""

    def __init__(self, rows: int, columns: int, dtype: torch.dtype, device):
        self.shape, self.dtype, self.device = (rows, columns), dtype, device
        self.buffers = {}

    def take(self, name: str, rows: int) -> torch.Tensor:
        """The first `rows` rows of buffer `name`, whatever they held (the caller overwrites them)."""
        if name not in self.buffers:
            self.buffers[name] = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return self.buffers[name][:rows]


def product(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """a @ b written into `out`, in out's dtype (through a product of a's dtype where it differs)."""
    if a.dtype == out.dtype:
        return torch.matmul(a, b, out=out)
    return out.copy_(torch.matmul(a, b))


def gathered_rows(source: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """source's rows at `index` written into `out`, in out's dtype."""
    if source.dtype == out.dtype:
        return torch.index_select(source, 0, index, out=out)
    return out.copy_(source.index_select(0, index))
