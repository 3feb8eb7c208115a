# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Gated DeltaNet's three kernels in PyTorch, for machines without flash-linear-attention (FLA).

megatron-core's GatedDeltaNet computes with FLA's ``causal_conv1d``, ``l2norm`` and
``chunk_gated_delta_rule`` (CUDA/Triton). Where FLA is not installed and there is no CUDA
device, the runtime part of the series gives it these instead, with FLA's signatures:

- ``causal_conv1d``: torch's depthwise ``conv1d`` padded on the left, then the activation
  (upstream calls it only with SiLU);
- ``l2norm``: x / sqrt(sum(x^2) + eps), FLA's formula and default eps;
- ``chunk_gated_delta_rule``: upstream's own ``torch_chunk_gated_delta_rule`` (its
  deterministic-mode kernel), which takes no packed rows: the trainer refuses those with
  Gated DeltaNet layers before anything is built (``refuse_packed_rows``).

On a machine with CUDA nothing here is used: upstream's FLA requirement stands.
"""

import torch
import torch.nn.functional as F

PACKED_ROWS_REFUSAL = ("Gated DeltaNet layers without flash-linear-attention compute with upstream's "
                       "torch_chunk_gated_delta_rule, which takes no packed rows (cu_seqlens): drop "
                       "--reset-position-ids / packed sequences, or install flash-linear-attention on a GPU")


def causal_conv1d(x, weight, bias=None, activation=None, initial_state=None, output_final_state=False,
                  cu_seqlens=None, **_):
    """FLA's causal_conv1d on [batch, sequence, channels] input with a [channels, width] weight."""
    if cu_seqlens is not None or initial_state is not None or output_final_state:
        raise NotImplementedError(PACKED_ROWS_REFUSAL)
    width = weight.shape[-1]
    out = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=width - 1, groups=weight.shape[0])
    out = out[..., : x.shape[1]].transpose(1, 2)
    if activation in ("silu", "swish"):
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"causal_conv1d: activation {activation!r} (FLA's takes silu/swish)")
    return out, None


def l2norm(x, dim: int = -1, eps: float = 1e-6, **_):
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, **_):
    """FLA's chunk_gated_delta_rule through upstream's torch kernel (scale 1/sqrt(head dim), as
    GatedDeltaNet calls it)."""
    from megatron.core.ssm.gated_delta_net.common import torch_chunk_gated_delta_rule

    if cu_seqlens is not None:
        raise NotImplementedError(PACKED_ROWS_REFUSAL)
    if scale is not None and scale != q.shape[-1] ** -0.5:
        raise ValueError(f"chunk_gated_delta_rule: scale {scale} (the torch kernel uses 1/sqrt(head dim))")
    return torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                        output_final_state=output_final_state,
                                        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
