# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Gated DeltaNet layers over the decoding cache: each layer's convolution inputs and recurrent
state per position, so that a forward from a later position continues from them.

megatron-core's GatedDeltaNet (0.19.2) computes a whole sequence from a zero state and refuses
an inference context. A layer's output at position t depends on the positions before it through
two things only: the causal convolution's inputs at t - K + 1 .. t - 1 (the kernel's width K) and
the recurrent state S_t, the [heads, key dim, value dim] matrix the gated delta rule carries
(S_{t+1} = exp(g_t) S_t + k_t beta_t (v_t - exp(g_t) S_t^T k_t)^T, output q_t^T S_{t+1} with q
scaled by 1 / sqrt(key dim)). `Entry` holds both: the inputs of the positions the next forward may
start from, and the state at each position of the last forward, so a verify step keeps the
state at every drafted position and the decoder continues from the accepted one (the others are
dropped when the next forward names its start; nothing is recomputed).

A forward from position 0 (the prefill, or a whole-sequence recompute) runs upstream's own
chunked kernel and keeps its final state; a forward from a later position runs the recurrence
token by token from the state held there, which gives the state after each of its positions. A
stream whose next forward may start before the end of a forward from 0 (an MTP depth's: its
positions that read drafts run again) names how many positions before: the recurrence runs those
last positions from the kernel's state there, keeping the state at each.
"""

import torch
import torch.nn.functional as F


class Entry:
    """One layer's state for one stream: `inputs` the convolution's pre-activation inputs [b, n, C]
    of positions first .. first + n - 1, `states` position p -> the recurrent state before p."""

    def __init__(self):
        self.first, self.inputs, self.states = 0, None, {0: None}  # None: the zero state

    def check(self, start: int) -> None:
        if start and start not in self.states:  # (position 0 starts from the zero state)
            raise ValueError(f"no Gated DeltaNet state at position {start}: a forward continues from a position of "
                             f"the last forward ({', '.join(map(str, sorted(self.states)))})")

    def cut(self, start: int) -> None:
        """Keep what a forward from `start` reads: the state there and the inputs before it."""
        self.check(start)
        self.states = {start: self.states[start] if start else None}
        if self.inputs is not None:
            self.inputs = self.inputs[:, : max(start - self.first, 0)]

    def tail(self, start: int, width: int, like: torch.Tensor) -> torch.Tensor:
        """The inputs of positions start - width .. start - 1, zeros before position 0."""
        held = like.new_zeros(like.shape[0], 0, like.shape[2]) if self.inputs is None else self.inputs
        held = held[:, max(held.shape[1] - width, 0):]
        return torch.cat([like.new_zeros(like.shape[0], width - held.shape[1], like.shape[2]), held], 1)

    def hold(self, start: int, inputs: torch.Tensor, states: dict, width: int) -> None:
        """After a forward from `start`: its inputs appended (keeping the `width` before `start`) and
        the states it computed."""
        before = self.tail(start, width, inputs)[:, max(width - start, 0):] if width else inputs[:, :0]
        self.first, self.inputs = start - before.shape[1], torch.cat([before, inputs], 1)
        self.states.update(states)


def recurrence(query, key, value, g, beta, state):
    """The gated delta rule token by token: q, k [b, s, h, dk], v [b, s, h, dv], g, beta [b, s, h],
    state [b, h, dk, dv] or None -> (output [b, s, h, dv], the state after each position, s of them)."""
    b, s, h, dk = key.shape
    query, key, value, g, beta = (x.float() for x in (query, key, value, g, beta))
    query = query * dk ** -0.5
    state = key.new_zeros(b, h, dk, value.shape[-1]) if state is None else state
    outputs, states = [], []
    for t in range(s):
        state = state * g[:, t].exp()[..., None, None]
        remembered = torch.einsum("bhkv,bhk->bhv", state, key[:, t])
        delta = (value[:, t] - remembered) * beta[:, t][..., None]
        state = state + torch.einsum("bhk,bhv->bhkv", key[:, t], delta)
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, query[:, t]))
        states.append(state)
    return torch.stack(outputs, 1), states


def forward(module, entry: Entry, start: int, hidden_states: torch.Tensor, keep: int = 0) -> torch.Tensor:
    """GatedDeltaNet's forward (one process: no tensor, context or sequence parallelism, unpacked
    rows) over positions start .. start + s - 1 of hidden_states [s, b, H], from `entry`'s state,
    which it updates; returns (output, bias) as the module does. A forward from position 0 also
    keeps the states at its last `keep` positions (the next forward may start there)."""
    if module.activation not in ("silu", "swish"):
        raise ValueError(f"Gated DeltaNet's convolution activation {module.activation!r} (upstream's is SiLU)")
    seq_len, batch, _ = hidden_states.shape
    qkvzba, _ = module.in_proj(hidden_states)
    qkv, gate, beta, alpha = torch.split(qkvzba.transpose(0, 1), module.feat_dim_split, dim=-1)
    gate = gate.reshape(batch, seq_len, -1, module.value_head_dim)
    weight = module.conv1d.weight  # [C, 1, K]
    width = weight.shape[-1] - 1
    window = torch.cat([entry.tail(start, width, qkv), qkv], 1)
    conv = F.conv1d(window.transpose(1, 2), weight, module.conv1d.bias if module.conv_bias else None,
                    groups=weight.shape[0])
    mixed = F.silu(conv).transpose(1, 2)
    query, key, value, gate, beta, alpha = module._prepare_input_for_gated_delta_rule(
        mixed, gate, batch, seq_len, beta, alpha)
    g, beta = module._compute_g_and_beta(module.A_log, module.dt_bias, alpha, beta)
    head = seq_len - min(keep, seq_len) if start == 0 else 0  # the positions upstream's kernel runs
    state, cores, states = entry.states[start], [], {}
    if head:  # from position 0: upstream's kernel, its final state
        core, state = module.gated_delta_rule(query[:, :head], key[:, :head], value[:, :head], g=g[:, :head],
                                              beta=beta[:, :head], initial_state=None, output_final_state=True,
                                              use_qk_l2norm_in_kernel=False)
        cores.append(core)
        states[head] = state
    if head < seq_len:  # token by token: the state after each position
        core, after = recurrence(*(x[:, head:] for x in (query, key, value, g, beta)), state)
        cores.append(core.to(query.dtype))
        states.update({start + head + 1 + t: held for t, held in enumerate(after)})
    core = torch.cat(cores, 1)
    entry.hold(start, qkv, states, width)
    out, bias = module.out_proj(module._gated_norm_and_a2a(core, gate, None, batch, seq_len))
    return out, bias
