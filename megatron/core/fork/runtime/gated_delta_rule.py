# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Gated DeltaNet's kernels in PyTorch, for machines without flash-linear-attention (FLA).

megatron-core's GatedDeltaNet computes with FLA's ``causal_conv1d``, ``l2norm`` and
``chunk_gated_delta_rule`` (CUDA/Triton). Where FLA is not installed and there is no CUDA
device, the runtime part of the series gives it these instead, with FLA's signatures:

- ``causal_conv1d``: torch's depthwise ``conv1d`` padded on the left, then the activation
  (upstream calls it only with SiLU);
- ``l2norm``: x / sqrt(sum(x^2) + eps), FLA's formula and default eps;
- ``chunk_gated_delta_rule``: upstream's own ``torch_chunk_gated_delta_rule`` (its
  deterministic-mode kernel);
- ``fused_recurrent_gated_delta_rule``: the same rule token by token (FLA's recurrent form,
  which Megatron-LM main's GatedDeltaNet decodes with).

Packed rows (THD). Upstream's GatedDeltaNet hands both kernels the packed row's ``cu_seqlens``:
megatron-core 0.19.2's ``ssm/gated_delta_net/gdn.py`` forward, lines 95-127, resolves them with
``_resolve_cu_seqlens`` (``common.py`` lines 448-472: ``cu_seqlens_q_padded`` where given, so a
sequence's alignment padding belongs to it; under CP every length a multiple of CP), lines
145-160 permute the row sequence by sequence for CP's all-to-all, and lines 214-222 and 242-252
pass ``cu_seqlens=cu_seqlens_q`` to ``causal_conv1d`` and to the rule (Megatron-LM main's
``common.py`` ``_resolve_cu_seqlens``, lines 469-493, is the same). FLA's semantics, followed
here (flash-linear-attention at 0315a70): the row is one batch entry, and every sequence
[cu_seqlens[i], cu_seqlens[i + 1]) is computed as a row of its own. The rule starts each from the
zero state (or its own ``initial_state[i]``, [N, H, K, V]) and returns one final state per
sequence (``fla/ops/gated_delta_rule/chunk.py``, ``chunk_gated_delta_rule``'s docstring and
checks: batch 1 with ``cu_seqlens``, N initial states); the convolution reads zeros before each
sequence's first token (``fla/modules/convolution.py``, ``causal_conv1d_fwd_kernel``: with
``IS_VARLEN`` it reads from ``bos``, rows before it load as 0). Both forms here compute sequence
by sequence, so nothing crosses a boundary by construction.

On a machine with CUDA nothing here is used: upstream's FLA requirement stands.
"""

import torch
import torch.nn.functional as F

CONV_STATE_REFUSAL = ("causal_conv1d without flash-linear-attention takes no initial_state or final state "
                      "(upstream's GatedDeltaNet passes neither in training)")


def sequences(cu_seqlens, batch: int, length: int) -> list:
    """The [start, end) of each packed sequence, FLA's convention checked: one row, cu_seqlens
    strictly increasing from 0 to the row's length."""
    if batch != 1:
        raise ValueError(f"cu_seqlens: the batch is {batch}; packed rows are one row (FLA's convention)")
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != length or \
            any(end <= start for start, end in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"cu_seqlens {bounds}: not strictly increasing from 0 to the row's {length} tokens")
    return list(zip(bounds[:-1], bounds[1:]))


def _per_sequence(compute, cu_seqlens, batch: int, length: int, initial_state, output_final_state: bool, *rows):
    """`compute(*slices, state)` -> (output [1, n, ...], final state [1, ...]) on each packed sequence
    of `rows` ([1, T, ...]) from its own initial state; outputs joined, final states stacked [N, ...]."""
    spans = sequences(cu_seqlens, batch, length)
    if initial_state is not None and initial_state.shape[0] != len(spans):
        raise ValueError(f"initial_state holds {initial_state.shape[0]} states for {len(spans)} packed sequences")
    outputs, finals = [], []
    for i, (start, end) in enumerate(spans):
        state = None if initial_state is None else initial_state[i:i + 1]
        out, final = compute(*(row[:, start:end] for row in rows), state)
        outputs.append(out)
        finals.append(final)
    return torch.cat(outputs, dim=1), torch.cat(finals, dim=0) if output_final_state else None


def _convolve(x, weight, bias):
    width = weight.shape[-1]
    out = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=width - 1, groups=weight.shape[0])
    return out[..., : x.shape[1]].transpose(1, 2)


def causal_conv1d(x, weight, bias=None, activation=None, initial_state=None, output_final_state=False,
                  cu_seqlens=None, **_):
    """FLA's causal_conv1d on [batch, sequence, channels] input with a [channels, width] weight;
    with cu_seqlens each packed sequence is convolved on its own (zeros before its first token)."""
    if initial_state is not None or output_final_state:
        raise NotImplementedError(CONV_STATE_REFUSAL)
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"causal_conv1d: activation {activation!r} (FLA's takes silu/swish)")
    if cu_seqlens is None:
        out = _convolve(x, weight, bias)
    else:
        out = torch.cat([_convolve(x[:, start:end], weight, bias)
                         for start, end in sequences(cu_seqlens, x.shape[0], x.shape[1])], dim=1)
    return (out if activation is None else F.silu(out)), None


def l2norm(x, dim: int = -1, eps: float = 1e-6, **_):
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, **_):
    """FLA's chunk_gated_delta_rule through upstream's torch kernel (scale 1/sqrt(head dim), as
    GatedDeltaNet calls it); with cu_seqlens, the kernel on each packed sequence."""
    from megatron.core.ssm.gated_delta_net.common import torch_chunk_gated_delta_rule

    if scale is not None and scale != q.shape[-1] ** -0.5:
        raise ValueError(f"chunk_gated_delta_rule: scale {scale} (the torch kernel uses 1/sqrt(head dim))")

    def chunked(q, k, v, g, beta, state):
        return torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state,
                                            output_final_state=output_final_state or cu_seqlens is not None,
                                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

    if cu_seqlens is None:
        return chunked(q, k, v, g, beta, initial_state)
    return _per_sequence(chunked, cu_seqlens, q.shape[0], q.shape[1], initial_state, output_final_state,
                         q, k, v, g, beta)


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                     use_qk_l2norm_in_kernel=False, cu_seqlens=None, **_):
    """FLA's recurrent form: per head, S_t = exp(g_t) S_{t-1} + k_t beta_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,
    o_t = S_t^T q_t scale, on q, k [B, T, H, K], v [B, T, H, V], g, beta [B, T, H] (in float32);
    with cu_seqlens, from each packed sequence's own state."""
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)

    def recurrent(q, k, v, g, beta, state):
        dtype = q.dtype
        q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
        b, t, h, dk = k.shape
        state = k.new_zeros(b, h, dk, v.shape[-1]) if state is None else state.float()
        outputs = []
        for i in range(t):
            state = state * g[:, i].exp()[..., None, None]
            delta = (v[:, i] - torch.einsum("bhkv,bhk->bhv", state, k[:, i])) * beta[:, i][..., None]
            state = state + torch.einsum("bhk,bhv->bhkv", k[:, i], delta)
            outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, i] * scale))
        return torch.stack(outputs, dim=1).to(dtype), state

    if cu_seqlens is None:
        out, final = recurrent(q, k, v, g, beta, initial_state)
        return out, final if output_final_state else None
    return _per_sequence(recurrent, cu_seqlens, q.shape[0], q.shape[1], initial_state, output_final_state,
                         q, k, v, g, beta)
