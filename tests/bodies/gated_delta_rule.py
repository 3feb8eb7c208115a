# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The fork's CPU Gated DeltaNet kernels (megatron/core/fork/runtime/gated_delta_rule.py) on packed rows:
each packed sequence against the same kernel on that sequence alone as a row of its own
(FLA's cu_seqlens semantics: nothing crosses a boundary), for the chunked form, the recurrent
form and the causal convolution; outputs, final states and input gradients."""

import torch

from megatron.core.fork.runtime import gated_delta_rule as kernels

LENGTHS = (5, 1, 70, 3)  # odd lengths, a single token, one past the chunked kernel's chunk of 64
HEADS, KEY, VALUE, CHANNELS, WIDTH = 2, 4, 3, 6, 4


def _rule_inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)
    q = torch.randn(1, total, HEADS, KEY, generator=g)
    k = kernels.l2norm(torch.randn(1, total, HEADS, KEY, generator=g))
    v = torch.randn(1, total, HEADS, VALUE, generator=g)
    decay = -torch.rand(1, total, HEADS, generator=g) * 0.1  # slow decay: the state matters over many tokens
    beta = torch.rand(1, total, HEADS, generator=g)
    states = torch.randn(len(LENGTHS), HEADS, KEY, VALUE, generator=g)
    return [t.requires_grad_() for t in (q, k, v, decay, beta)], states


def _cu_seqlens():
    return torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)


def _grads(tensors, output):
    weight = torch.randn(output.shape, generator=torch.Generator().manual_seed(7))
    return torch.autograd.grad((output * weight).sum(), tensors)


def _max_err(got, want) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))


def rule(form: str, with_states: bool) -> dict:
    """`form` ("chunk" or "recurrent") on the packed row against each sequence alone; the
    relative errors of outputs, final states and gradients, and how far the packed output is
    from the whole row's (no cu_seqlens), which shows the row crosses boundaries."""
    fn = kernels.chunk_gated_delta_rule if form == "chunk" else kernels.fused_recurrent_gated_delta_rule
    inputs, states = _rule_inputs(3)
    initial = states if with_states else None
    out, finals = fn(*inputs, initial_state=initial, output_final_state=True, cu_seqlens=_cu_seqlens())
    got_grads = _grads(inputs, out)
    bounds = _cu_seqlens().tolist()
    want, want_finals = [], []
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        alone = fn(*(t[:, start:end] for t in inputs), initial_state=None if initial is None else initial[i:i + 1],
                   output_final_state=True)
        want.append(alone[0])
        want_finals.append(alone[1])
    want, want_finals = torch.cat(want, 1), torch.cat(want_finals, 0)
    whole, _ = fn(*inputs, initial_state=None)
    return {"out": _max_err(out, want), "finals": _max_err(finals, want_finals),
            "grads": max(_max_err(a, b) for a, b in zip(got_grads, _grads(inputs, want), strict=True)),
            "shapes": [list(out.shape), list(finals.shape)],
            "whole_row_differs": _max_err(out, whole.detach()) if not with_states else None}


def chunk_against_recurrent() -> float:
    """The two forms on the same packed row (the chunked kernel's arithmetic against the recurrence)."""
    inputs, _ = _rule_inputs(4)
    chunk, _ = kernels.chunk_gated_delta_rule(*inputs, cu_seqlens=_cu_seqlens())
    recurrent, _ = kernels.fused_recurrent_gated_delta_rule(*inputs, cu_seqlens=_cu_seqlens())
    return max(_max_err(chunk, recurrent),
               max(_max_err(a, b) for a, b in zip(_grads(inputs, chunk), _grads(inputs, recurrent), strict=True)))


def convolution() -> dict:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, sum(LENGTHS), CHANNELS, generator=g, requires_grad=True)
    weight = torch.randn(CHANNELS, WIDTH, generator=g, requires_grad=True)
    bias = torch.randn(CHANNELS, generator=g, requires_grad=True)
    out, _ = kernels.causal_conv1d(x, weight, bias, activation="silu", cu_seqlens=_cu_seqlens())
    bounds = _cu_seqlens().tolist()
    want = torch.cat([kernels.causal_conv1d(x[:, a:b], weight, bias, activation="silu")[0]
                      for a, b in zip(bounds[:-1], bounds[1:], strict=True)], 1)
    single = bounds[1]  # the sequence of one token: its window holds itself only
    alone = torch.nn.functional.silu(x[0, single] * weight[:, -1] + bias)
    whole, _ = kernels.causal_conv1d(x, weight, bias, activation="silu")
    params = (x, weight, bias)
    return {"out": _max_err(out, want), "single_token": _max_err(out[0, single], alone),
            "grads": max(_max_err(a, b) for a, b in zip(_grads(params, out), _grads(params, want), strict=True)),
            "whole_row_differs": _max_err(out, whole.detach())}


def refusals() -> list:
    """The one-line errors of packed inputs that break FLA's convention."""
    inputs, states = _rule_inputs(6)
    two_rows = [torch.cat([t, t]) for t in inputs]
    cases = [lambda: kernels.chunk_gated_delta_rule(*two_rows, cu_seqlens=_cu_seqlens()),
             lambda: kernels.fused_recurrent_gated_delta_rule(*inputs, cu_seqlens=torch.tensor([0, 5, 5, 79])),
             lambda: kernels.chunk_gated_delta_rule(*inputs, cu_seqlens=torch.tensor([0, 5, 70])),
             lambda: kernels.chunk_gated_delta_rule(*inputs, initial_state=states[:2], cu_seqlens=_cu_seqlens()),
             lambda: kernels.causal_conv1d(inputs[0].flatten(2), torch.ones(8, 4), cu_seqlens=torch.tensor([1, 79]))]
    out = []
    for case in cases:
        try:
            case()
            out.append(None)
        except ValueError as error:
            out.append(str(error))
    return out


def checks() -> dict:
    torch.manual_seed(0)
    return {"chunk": rule("chunk", False), "chunk_states": rule("chunk", True),
            "recurrent": rule("recurrent", False), "recurrent_states": rule("recurrent", True),
            "chunk_vs_recurrent": chunk_against_recurrent(), "conv": convolution(), "refusals": refusals()}
