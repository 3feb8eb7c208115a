# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Mixture-of-experts MLP and router losses in plain PyTorch, written from the spec (section 11)
and upstream's documented formulas (no megatron-core); an extension of tests/reference/gpt_mtp.

A token x (the pre-MLP-normed hidden state) is routed by

    logits = x @ router.weight^T                      (no bias, float32)
    softmax scores: top-k of the logits, probs = softmax over those k (post-softmax), or with
                    pre-softmax: probs = top-k of softmax(logits)
    sigmoid scores: s = sigmoid(logits); top-k of s + expert_bias (the bias chooses, it is not
                    a weight: DeepSeek-V3); probs = s[top-k] / sum s[top-k] (when k > 1)
    probs *= moe_router_topk_scaling_factor (when set)
    y = sum_k probs_k * expert_{i_k}(x) + shared_expert(x)       no capacity, no token dropped

An expert (and the shared expert) is fc2(act(fc1(x))), act = SwiGLU (fc1's output halves
[gate; up]: silu(gate) * up) or GELU, without biases when add_bias_linear is off.

Router losses of one MoE layer call (every position of the batch routes; T = the step's
positions, Q its sequences of length s, E experts, the scores p_t of the losses are
softmax(logits), or with sigmoid the sigmoid scores normalized over all E experts, and the
counts c are those of the top-k of p_t, without the expert bias):

    z-loss        coeff * sum_t logsumexp(logits_t)^2 / T
    seq_aux_loss  coeff * sum_q l_q / Q,   l_q = E / (k s^2) * sum_i (sum_{t in q} p_ti) c_qi
    aux_loss      coeff * sum_mb (T_mb / T) * l_mb,   l_mb the same over a micro-batch's T_mb
                  tokens (the micro-batches: consecutive groups of `micro_batch` rows)

Each call counts once: a repeated MTP layer applied at D depths adds D terms (spec: the
depth's router losses count once each). The expert-bias update of a step is
sign(mean(c) - c) * rate over the counts of the actual (biased) routing of all the step's
tokens through that router (all depths of a repeated layer).
"""

import torch
import torch.nn.functional as F
from torch import nn

from tests.reference.gpt_mtp import MLP, ReferenceGPT


def _linear(d_in, d_out, bias):
    return nn.Linear(d_in, d_out, bias=bias)


class Expert(nn.Module):
    def __init__(self, hidden, ffn, swiglu, bias):
        super().__init__()
        self.swiglu = swiglu
        self.linear_fc1 = _linear(hidden, 2 * ffn if swiglu else ffn, bias)
        self.linear_fc2 = _linear(ffn, hidden, bias)

    def forward(self, x):
        h = self.linear_fc1(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        return self.linear_fc2(h)


class Router(nn.Module):
    def __init__(self, hidden, experts, expert_bias):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(experts))
        else:
            self.expert_bias = None


class Experts(nn.Module):
    def __init__(self, n, hidden, ffn, swiglu, bias):
        super().__init__()
        self.local_experts = nn.ModuleList(Expert(hidden, ffn, swiglu, bias) for _ in range(n))


class MoE(nn.Module):
    """One MoE MLP; `losses` (a list shared with the model) receives one entry per call."""

    def __init__(self, hidden, options, losses):
        super().__init__()
        o = self.options = options
        self.router = Router(hidden, o["num_moe_experts"], o["moe_router_enable_expert_bias"])
        self.experts = Experts(o["num_moe_experts"], hidden, o["moe_ffn_hidden_size"], o["swiglu"],
                               o["add_bias_linear"])
        if o.get("moe_shared_expert_intermediate_size"):
            self.shared_experts = Expert(hidden, o["moe_shared_expert_intermediate_size"], o["swiglu"],
                                         o["add_bias_linear"])
        self.counts = torch.zeros(o["num_moe_experts"], dtype=torch.float64)  # biased routing, all calls
        self._losses = [losses]  # (a list, not a submodule or parameter)

    def route(self, logits):
        """(probs [N, k], indices [N, k]) of the routing that dispatches tokens."""
        o, k = self.options, self.options["moe_router_topk"]
        if o["moe_router_score_function"] == "softmax":
            if o.get("moe_router_pre_softmax"):
                probs, idx = torch.softmax(logits, dim=-1).topk(k, dim=-1)
            else:
                top, idx = logits.topk(k, dim=-1)
                probs = torch.softmax(top, dim=-1)
        elif o["moe_router_score_function"] == "sigmoid":
            scores = torch.sigmoid(logits)
            choose = scores if self.router.expert_bias is None else scores + self.router.expert_bias
            _, idx = choose.topk(k, dim=-1)
            probs = scores.gather(1, idx)
            if k > 1:
                probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            raise ValueError(o["moe_router_score_function"])
        if o.get("moe_router_topk_scaling_factor"):
            probs = probs * o["moe_router_topk_scaling_factor"]
        return probs, idx

    def loss_scores(self, logits):
        """The scores and top-k counts [N, E] the balance losses use (no expert bias)."""
        k = self.options["moe_router_topk"]
        if self.options["moe_router_score_function"] == "softmax":
            p = torch.softmax(logits, dim=-1)
        else:
            p = torch.sigmoid(logits)
            p = p / (p.sum(dim=-1, keepdim=True) + 1e-20)
        chosen = torch.zeros_like(p).scatter(1, p.topk(k, dim=-1).indices, 1.0)
        return p, chosen

    def forward(self, x):
        b, s, h = x.shape
        flat = x.reshape(-1, h)
        logits = flat @ self.router.weight.t()
        probs, idx = self.route(logits)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts.local_experts):
            rows, slot = (idx == e).nonzero(as_tuple=True)
            if rows.numel():
                out = out.index_add(0, rows, expert(flat[rows]) * probs[rows, slot, None])
        with torch.no_grad():
            self.counts += torch.bincount(idx.reshape(-1), minlength=self.counts.numel()).double()
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(flat)
        p, chosen = self.loss_scores(logits)
        self._losses[0].append(dict(
            z=torch.logsumexp(logits, dim=-1).pow(2).reshape(b, s),
            p=p.reshape(b, s, -1), chosen=chosen.reshape(b, s, -1),
        ))
        return out.reshape(b, s, h)


def balance_loss(p, chosen, k):
    """Switch balance loss of one group of tokens: E / (k T^2) * sum_i (sum_t p_ti) c_i."""
    tokens, experts = p.shape
    return experts / (k * tokens * tokens) * (p.sum(dim=0) * chosen.sum(dim=0)).sum()


def router_loss_terms(entries, options, micro_batch):
    """The step's router-loss terms of spec section 11 over a whole global batch's calls:
    {"z": ..., "seq_aux_loss": ..., "aux_loss": ...} (each a scalar tensor, coefficients in)."""
    kinds = options["moe_router_load_balancing_type"]
    coeffs = options["moe_aux_loss_coeff"]
    kinds = list(kinds) if isinstance(kinds, (list, tuple)) else [kinds]
    coeffs = list(coeffs) if isinstance(coeffs, (list, tuple)) else [coeffs] * len(kinds)
    assert len(kinds) == len(coeffs), (kinds, coeffs)
    k = options["moe_router_topk"]
    terms = {}
    zero = torch.zeros(())
    if options.get("moe_z_loss_coeff"):
        terms["z"] = sum((options["moe_z_loss_coeff"] * e["z"].sum() / e["z"].numel() for e in entries), zero)
    for kind, coeff in zip(kinds, coeffs):
        if not coeff:
            continue
        total = zero
        for e in entries:
            b, s, _ = e["p"].shape
            if kind == "seq_aux_loss":
                total = total + coeff * sum(
                    balance_loss(e["p"][q], e["chosen"][q], k) for q in range(b)) / b
            elif kind == "aux_loss":
                assert b % micro_batch == 0, (b, micro_batch)
                for start in range(0, b, micro_batch):
                    rows = slice(start, start + micro_batch)
                    group_p = e["p"][rows].reshape(-1, e["p"].size(-1))
                    group_c = e["chosen"][rows].reshape(-1, e["p"].size(-1))
                    total = total + coeff * (micro_batch / b) * balance_loss(group_p, group_c, k)
            else:
                raise ValueError(f"no reference for {kind}")
        terms[kind] = total
    return terms


def moe_layer_pattern(freq, layers):
    """Which backbone layers are MoE (upstream's moe_layer_freq: an int period or a 0/1 list)."""
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(layers)]
    assert len(freq) == layers, (freq, layers)
    return [bool(f) for f in freq]


class ReferenceMoEGPT(ReferenceGPT):
    """ReferenceGPT with MoE MLPs where the options put them (the MTP layer is MoE when the
    backbone's last layer is, as upstream builds it) and linear biases as add_bias_linear. A
    repeated MTP layer's router losses count at every depth it runs (spec section 11)."""

    def __init__(self, vocab, hidden, heads, layers, mtp_depths, options, **kwargs):
        super().__init__(vocab, hidden, heads, layers, mtp_depths, **kwargs)
        self.options = options
        self.router_entries = []
        pattern = moe_layer_pattern(options.get("moe_layer_freq", 1), layers)
        targets = [layer for layer, moe in zip(self.decoder.layers, pattern) if moe]
        mtp_targets = [getattr(m, m.inner_name) for m in self.mtp.layers] if mtp_depths and pattern[-1] else []
        for layer in targets + mtp_targets:
            layer.mlp = MoE(hidden, options, self.router_entries)
        if not options.get("add_bias_linear", True):
            for module in self.modules():
                if isinstance(module, nn.Linear) and module.bias is not None:
                    module.bias = None
        if options.get("swiglu"):  # dense MLPs are SwiGLU too
            for module in list(self.modules()):
                if isinstance(module, MLP):
                    raise NotImplementedError("dense SwiGLU MLPs: use MoE on every layer")

    def moe_layers(self) -> dict:
        return {name: m for name, m in self.named_modules() if isinstance(m, MoE)}

    def step_objective(self, tokens, loss_mask, micro_batch):
        """The spec's step objective on the whole global batch (tokens [B, S+1], mask [B, S]):
        (main + MTP sums) / N_tok + the router-loss terms, and the terms by kind."""
        self.router_entries.clear()
        for m in self.moe_layers().values():
            m.counts.zero_()
        input_ids, labels = tokens[:, :-1], tokens[:, 1:]
        sums = self.objective_sums(input_ids, labels, loss_mask)
        terms = router_loss_terms(self.router_entries, self.options, micro_batch)
        return sums / loss_mask.sum() + sum(terms.values(), torch.zeros(())), terms

    def updated_expert_bias(self) -> dict:
        """{buffer name: expert bias after the step's update} (needs step_objective first)."""
        rate = self.options["moe_router_bias_update_rate"]
        out = {}
        for name, m in self.moe_layers().items():
            if m.router.expert_bias is not None:
                c = m.counts
                out[f"{name}.router.expert_bias"] = m.router.expert_bias + torch.sign(c.mean() - c).float() * rate
        return out
