# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Core attention on ``torch.nn.functional.scaled_dot_product_attention``.

Upstream's local ``DotProductAttention`` takes its score buffer from the global
CUDA memory buffer and cannot handle packed (THD) rows; Transformer Engine needs
a GPU. This module is a drop-in ``core_attention`` for layer specs that runs on
any device, handles causal and padding masks, grouped-query attention and packed
rows (a block-diagonal causal mask built from ``cu_seqlens``), and keeps
attention dropout under the tensor-parallel RNG tracker as upstream does.

With context parallelism each rank attends with its own queries to every rank's keys and
values, all-gathered over the CP group (megatron.core.fork.runtime.context_parallel: upstream's
load-balanced layout; the causal and packed masks by global position). Transformer
Engine's CP attention (p2p, a2a, all-gather) stays the GPU path; this one needs no kernel.
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide
from torch import Tensor

from megatron.core.fork.runtime import context_parallel


def causal_mask(q_positions: Tensor, k_positions: Tensor, cu_seqlens: Optional[Tensor] = None) -> Tensor:
    """[queries, keys] bool mask, True where attention is allowed: a key at or before the
    query's global position, and with ``cu_seqlens`` (packed rows) in the same sequence."""
    allowed = k_positions[None, :] <= q_positions[:, None]
    if cu_seqlens is not None:
        boundaries = cu_seqlens.to(device=q_positions.device, dtype=torch.long)[1:]
        same = (torch.bucketize(q_positions, boundaries, right=True)[:, None]
                == torch.bucketize(k_positions, boundaries, right=True)[None, :])
        allowed = allowed & same
    return allowed


class SDPACoreAttention(MegatronModule):
    """Same constructor and forward signature as upstream ``DotProductAttention``."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
    ):
        super().__init__(config=config)
        if config.softmax_type != "vanilla":
            raise ValueError(f"SDPACoreAttention supports softmax_type='vanilla' only, got {config.softmax_type!r}")
        if config.window_size is not None:
            raise ValueError("SDPACoreAttention does not support sliding-window attention")
        if pg_collection is None:
            required = ['tp', 'cp'] if config.context_parallel_size > 1 else ['tp']
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=required)
        tp_size = pg_collection.tp.size()
        self.cp_group = getattr(pg_collection, 'cp', None) if config.context_parallel_size > 1 else None
        self.attn_mask_type = attn_mask_type
        # Multi-latent attention gives its query/key and value head dimensions (k_channels,
        # v_channels), as to Transformer Engine's attention; the others have kv_channels. The
        # output's head dimension is that of the value it is given (MLA pads it to the query's
        # on packed rows), so v_channels is taken for the signature only.
        k_channels = config.kv_channels if k_channels is None else k_channels
        self.heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.query_groups_per_partition = divide(config.num_query_groups, tp_size)
        self.softmax_scale = 1.0 / math.sqrt(k_channels) if softmax_scale is None else softmax_scale
        # apply_query_key_layer_scaling needs no handling: upstream divides the scale by the
        # layer number and multiplies it back inside its fp32 softmax, a net factor of one.
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> Tensor:
        if attention_bias is not None:
            raise ValueError("SDPACoreAttention does not support attention_bias")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == 'thd'
        cu_seqlens = None
        if packed:
            cu_seqlens = packed_seq_params.cu_seqlens_q_padded
            if cu_seqlens is None:
                cu_seqlens = packed_seq_params.cu_seqlens_q
        # Global positions of the queries and keys (CP: this rank's chunks, every rank's keys).
        local_rows = query.size(0)
        if self.cp_group is not None:
            key = context_parallel.gather_sequence(key, self.cp_group)
            value = context_parallel.gather_sequence(value, self.cp_group)
            total = key.size(0)
            q_positions = context_parallel.local_positions(
                total, self.cp_group.size(), self.cp_group.rank(), cu_seqlens, query.device)
            k_positions = context_parallel.gathered_positions(local_rows, self.cp_group, cu_seqlens, query.device)
        else:
            q_positions = k_positions = None
        if packed:
            # THD: [t, np, hn] -> one row of length t.
            query, key, value = (x.unsqueeze(1) for x in (query, key, value))

        # [s, b, n, h] -> [b, n, s, h]
        query, key, value = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        groups = self.heads_per_partition // self.query_groups_per_partition
        if groups > 1:
            key = key.repeat_interleave(groups, dim=1)
            value = value.repeat_interleave(groups, dim=1)

        # bool, True where a query may attend to a key. As in upstream's softmax, an explicit
        # mask (True marks positions to exclude) wins over the causal default.
        if q_positions is None and (packed or mask_type == AttnMaskType.causal):
            q_positions = torch.arange(query.size(2), device=query.device)
            k_positions = torch.arange(key.size(2), device=query.device) - (key.size(2) - query.size(2))
        if packed:
            allowed = causal_mask(q_positions, k_positions, cu_seqlens)
        elif attention_mask is not None:
            # CP: the data split cut the mask's query rows; its keys are in global order.
            allowed = ~(attention_mask.bool() if self.cp_group is None else attention_mask.bool()[..., k_positions])
        elif mask_type == AttnMaskType.causal:
            allowed = causal_mask(q_positions, k_positions)
        else:
            allowed = None

        dropout_p = self.dropout_p if self.training else 0.0
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = self._attend(query, key, value, allowed, dropout_p)
        else:
            context = self._attend(query, key, value, allowed, dropout_p)

        # [b, n, s, h] -> [s, b, n*h]
        context = context.permute(2, 0, 1, 3).contiguous()
        context = context.view(context.size(0), context.size(1), -1)
        if packed:
            context = context.squeeze(1)
        return context

    def _attend(self, query, key, value, allowed, dropout_p):
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=allowed, dropout_p=dropout_p, scale=self.softmax_scale
        )
