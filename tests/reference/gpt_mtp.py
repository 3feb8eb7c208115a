# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""A plain-PyTorch GPT with DeepSeek-V3-style MTP, written from the spec (no megatron-core).

It is the independent oracle of the MTP tests. Parameter names equal megatron-core's
state-dict keys (local layer spec, TP=1), so `load_state_dict` takes a megatron model's
weights. Everything is [batch, seq, hidden]. Spec sections 1-4:

    e^k_t  = E[x_{t+k}]          (0 past the end of the row or packed segment)
    u^k_t  = eh_proj(concat(enorm(e^k_t), hnorm(h^{k-1}_t)))
    h^k    = final_norm_k(TransformerLayer_k(u^k))
    logits^k_t = h^k_t @ W_out^T                       predicts x_{t+k+1}
    L = sum_main CE * m / N_tok + (lambda / D) * sum_k S_k / N_tok

with isolation: h^0 detached into depth 1 only, E detached at every depth, W_out
detached for MTP logits.

Draft objectives (spec section 12), on the whole [b, s, V] softmaxes: p^k_t from the main
logits at t + k of the same segment (detached), q^k_t from depth k's, both at temperature
tau; alpha = sum_v min(p, q) (torch.minimum); kl = KL(p || q); tv = 1 - alpha; e2e_tv =
D * sum over anchors valid at every depth of 1 - mean_j prod_{i<=j} alpha^i (so that the
common lambda / D gives the spec's lambda * sum_t e_t). Greedy drafts (section 12.1): beta =
p at the lowest token id where depth k's logits are largest (torch.where over the maximum).

Attention variants (`Attention`): multi-head / grouped-query attention, optionally with a
norm of each head's query and key before RoPE (q/k layernorm, Qwen3); and multi-latent
attention (DeepSeek-V2/V3): queries from a low-rank latent (q-LoRA, normed), keys and values
from a shared latent (kv-LoRA, normed) plus one RoPE key shared by all heads, the RoPE part
of each head's query and key taken with DeepSeek's even/odd de-interleave, and YaRN frequencies
(written from the YaRN paper and DeepSeek-V3's rounded correction range). Mixers of linear
attention (`GatedDeltaNet`, Qwen3-Next's layers): the Gated DeltaNet paper's recurrence, one
token at a time. MLPs: GeLU, or SwiGLU.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def norm(kind, size):
    """"LayerNorm" or "RMSNorm" (torch's), or with "1p" (Megatron-LM's --apply-layernorm-1p) the
    zero-centred form written out here."""
    if kind.endswith("1p"):
        return OnePlusNorm(kind[:-2], size)
    return nn.RMSNorm(size, eps=1e-5) if kind == "RMSNorm" else nn.LayerNorm(size, eps=1e-5)


class OnePlusNorm(nn.Module):
    """x normalized (LayerNorm: centred, over the standard deviation; RMSNorm: over the root mean
    square), times (1 + w), plus b for LayerNorm: the scale stored as its offset from one."""

    def __init__(self, kind, size, eps=1e-5):
        super().__init__()
        self.kind, self.eps = kind, eps
        self.weight = nn.Parameter(torch.zeros(size))
        if kind == "LayerNorm":
            self.bias = nn.Parameter(torch.zeros(size))

    def forward(self, x):
        if self.kind == "LayerNorm":
            centred = x - x.mean(-1, keepdim=True)
            return (centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)
                    + self.bias)
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)


def causal_within_segments(scores, segments):
    s = segments.size(1)
    allowed = (segments[:, :, None] == segments[:, None, :]) & torch.ones(s, s, dtype=torch.bool).tril()
    return scores.masked_fill(~allowed[:, None], float("-inf"))


class SelfAttention(nn.Module):
    """Grouped-query attention; `output_gate`: each head's output times sigmoid of a gate projected
    beside its query (Qwen3-Next's gated attention); `rotary_percent`: RoPE on that leading
    fraction of each head's dimensions, the rest passed through."""

    def __init__(self, hidden, heads, groups, qk_norm=None, output_gate=False, rotary_percent=1.0):
        super().__init__()
        self.heads, self.groups, self.head_dim = heads, groups, hidden // heads
        self.output_gate, self.rotary_dim = output_gate, int(self.head_dim * rotary_percent)
        query_rows = (2 if output_gate else 1) * heads  # per group: queries, then their gates, then k, v
        self.linear_qkv = nn.Linear(hidden, (query_rows + 2 * groups) * self.head_dim)
        self.linear_proj = nn.Linear(hidden, hidden)
        if qk_norm:
            self.q_layernorm, self.k_layernorm = norm(qk_norm, self.head_dim), norm(qk_norm, self.head_dim)
        self.qk_norm = qk_norm

    def forward(self, x, positions, segments):
        b, s, _ = x.shape
        per_group = self.heads // self.groups
        queries = (2 if self.output_gate else 1) * per_group
        qkv = self.linear_qkv(x).view(b, s, self.groups, (queries + 2) * self.head_dim)
        sizes = [per_group * self.head_dim] * (queries // per_group) + [self.head_dim, self.head_dim]
        q, *gate, k, v = qkv.split(sizes, dim=-1)
        q = q.reshape(b, s, self.heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        k = k.repeat_interleave(per_group, dim=2)
        v = v.repeat_interleave(per_group, dim=2)
        angles = rope_table(positions, self.rotary_dim)
        r = self.rotary_dim
        q = torch.cat([apply_rope(q[..., :r], angles), q[..., r:]], dim=-1)
        k = torch.cat([apply_rope(k[..., :r], angles), k[..., r:]], dim=-1)
        scores = causal_within_segments(torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(self.head_dim), segments)
        out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(dim=-1), v).reshape(b, s, -1)
        if self.output_gate:
            out = out * torch.sigmoid(gate[0].reshape(b, s, -1))
        return self.linear_proj(out)


@dataclass(frozen=True)
class Latent:
    """Multi-latent attention's sizes; `yarn` = (scaling factor, original context, beta_fast,
    beta_slow, mscale, mscale_all_dim), or None for plain RoPE."""
    q_lora_rank: int
    kv_lora_rank: int
    qk_head_dim: int
    rope_head_dim: int
    v_head_dim: int
    yarn: tuple | None = None


def yarn_frequencies(dim, base, factor, original, beta_fast, beta_slow):
    """YaRN's per-pair frequencies: a pair that turns fewer than beta_slow times over the original
    context is interpolated (theta / factor), one that turns more than beta_fast times is kept,
    linearly blended between, over the dimension indices where those turn counts fall (rounded
    outwards, as DeepSeek-V3's released code does)."""
    theta = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))

    def index_turning(times):  # the dimension index i whose pair turns `times` over `original`
        return dim * math.log(original / (times * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(index_turning(beta_fast)), 0), min(math.ceil(index_turning(beta_slow)), dim - 1)
    high = high if high != low else high + 0.001
    kept = 1.0 - ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return theta / factor * (1 - kept) + theta * kept


def yarn_attention_factor(factor, mscale):
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class MLASelfAttention(nn.Module):
    def __init__(self, hidden, heads, latent: Latent, qk_norm=None):
        super().__init__()
        self.heads, self.latent = heads, latent
        q_dim = latent.qk_head_dim + latent.rope_head_dim
        self.linear_q_down_proj = nn.Linear(hidden, latent.q_lora_rank, bias=False)
        self.linear_q_up_proj = nn.Linear(latent.q_lora_rank, heads * q_dim, bias=False)
        self.linear_kv_down_proj = nn.Linear(hidden, latent.kv_lora_rank + latent.rope_head_dim, bias=False)
        self.linear_kv_up_proj = nn.Linear(latent.kv_lora_rank, heads * (latent.qk_head_dim + latent.v_head_dim),
                                           bias=False)
        self.linear_proj = nn.Linear(heads * latent.v_head_dim, hidden)
        if qk_norm:
            self.q_layernorm, self.kv_layernorm = norm(qk_norm, latent.q_lora_rank), norm(qk_norm, latent.kv_lora_rank)
        self.qk_norm = qk_norm
        self.scale = 1.0 / math.sqrt(q_dim)
        if latent.yarn:
            factor, _, _, _, _, mscale_all_dim = latent.yarn
            self.scale *= yarn_attention_factor(factor, mscale_all_dim) ** 2

    def rope(self, x, positions):
        """x [b, s, h, r]: DeepSeek's RoPE, pairs (x_0, x_1), (x_2, x_3), ... rotated."""
        dim = self.latent.rope_head_dim
        if self.latent.yarn:
            factor, original, beta_fast, beta_slow, mscale, mscale_all_dim = self.latent.yarn
            theta = yarn_frequencies(dim, 10000.0, factor, original, beta_fast, beta_slow)
            magnitude = yarn_attention_factor(factor, mscale) / yarn_attention_factor(factor, mscale_all_dim)
        else:
            theta, magnitude = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), 1.0
        angles = positions.float()[..., None] * theta  # [b, s, r/2]
        cos, sin = angles.cos()[:, :, None] * magnitude, angles.sin()[:, :, None] * magnitude
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)

    def forward(self, x, positions, segments):
        b, s, _ = x.shape
        lat, h = self.latent, self.heads
        q_latent = self.linear_q_down_proj(x)
        kv_latent, k_rope = self.linear_kv_down_proj(x).split([lat.kv_lora_rank, lat.rope_head_dim], dim=-1)
        if self.qk_norm:
            q_latent, kv_latent = self.q_layernorm(q_latent), self.kv_layernorm(kv_latent)
        q = self.linear_q_up_proj(q_latent).view(b, s, h, lat.qk_head_dim + lat.rope_head_dim)
        q_content, q_rope = q.split([lat.qk_head_dim, lat.rope_head_dim], dim=-1)
        kv = self.linear_kv_up_proj(kv_latent).view(b, s, h, lat.qk_head_dim + lat.v_head_dim)
        k_content, v = kv.split([lat.qk_head_dim, lat.v_head_dim], dim=-1)
        q = torch.cat([q_content, self.rope(q_rope, positions)], dim=-1)
        k_rope = self.rope(k_rope[:, :, None], positions).expand(b, s, h, lat.rope_head_dim)
        k = torch.cat([k_content, k_rope], dim=-1)
        scores = causal_within_segments(torch.einsum("bqhd,bkhd->bhqk", q, k) * self.scale, segments)
        out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(dim=-1), v)
        return self.linear_proj(out.reshape(b, s, -1))


def attention(hidden, heads, groups, qk_norm, latent, output_gate=False, rotary_percent=1.0):
    if latent:
        return MLASelfAttention(hidden, heads, latent, qk_norm)
    return SelfAttention(hidden, heads, groups, qk_norm, output_gate, rotary_percent)


@dataclass(frozen=True)
class DeltaNet:
    """A Gated DeltaNet mixer's sizes: query/key heads of `key_dim`, value heads of `value_dim`
    (a multiple of the key heads, which are repeated over them), a causal convolution `conv` wide."""
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv: int = 4


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet (Yang, Kautz, Hatamizadeh, "Gated Delta Networks", ICLR 2025) in its
    recurrent form, one token at a time: with a per-head state S (key_dim x value_dim),

        S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T q_t / sqrt(key_dim)

    where alpha_t = exp(g_t), g_t = -exp(A_log) softplus(a_t + dt_bias), beta_t = sigmoid(b_t),
    q and k L2-normalized per head after a causal depthwise convolution and SiLU over [q, k, v];
    the output is norm(o_t) * SiLU(z_t) per value head, then projected (Qwen3-Next's layer).
    Packed rows: every segment is a sequence of its own, its state zero at its first token and its
    convolution zero before it (flash-linear-attention's cu_seqlens semantics).
    Parameter names and the input projection's layout [q, k, v, z, b, a] are megatron-core's."""

    def __init__(self, hidden, spec: DeltaNet, normalization):
        super().__init__()
        self.spec = spec
        qk, v = spec.key_heads * spec.key_dim, spec.value_heads * spec.value_dim
        self.sections = [qk, qk, v, v, spec.value_heads, spec.value_heads]
        self.in_proj = nn.Linear(hidden, sum(self.sections), bias=False)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(2 * qk + v, 1, spec.conv))
        self.dt_bias = nn.Parameter(torch.empty(spec.value_heads))
        self.A_log = nn.Parameter(torch.empty(spec.value_heads))
        self.out_norm = norm(normalization, spec.value_dim)
        self.out_proj = nn.Linear(v, hidden, bias=False)

    def causal_convolution(self, x, segments):
        """out[t, c] = sum_j w[c, j] x[t - (width - 1) + j, c], zero before the token's segment starts."""
        width, s = self.spec.conv, x.size(1)
        weight = self.conv1d.weight[:, 0]  # [channels, width]
        out = 0
        for lag in range(width):  # tap width - 1 - lag reads token t - lag
            same = torch.zeros_like(segments, dtype=torch.bool)
            same[:, lag:] = segments[:, lag:] == segments[:, :s - lag]
            earlier = F.pad(x, (0, 0, lag, 0))[:, :s]
            out = out + weight[:, width - 1 - lag] * earlier * same[..., None]
        return out

    def forward(self, x, positions, segments):
        spec, (b, s, _) = self.spec, x.shape
        q, k, v, z, beta, a = self.in_proj(x).split(self.sections, dim=-1)
        q, k, v = F.silu(self.causal_convolution(torch.cat([q, k, v], dim=-1), segments)).split(self.sections[:3],
                                                                                                  dim=-1)
        repeat = spec.value_heads // spec.key_heads

        def heads(t, count, dim):
            return t.reshape(b, s, count, dim)

        def unit(t):
            return t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6)

        q = unit(heads(q, spec.key_heads, spec.key_dim)).repeat_interleave(repeat, dim=2) / math.sqrt(spec.key_dim)
        k = unit(heads(k, spec.key_heads, spec.key_dim)).repeat_interleave(repeat, dim=2)
        v = heads(v, spec.value_heads, spec.value_dim)
        alpha = torch.exp(-self.A_log.exp() * F.softplus(a + self.dt_bias))  # [b, s, value heads]
        beta = beta.sigmoid()
        state = x.new_zeros(b, spec.value_heads, spec.key_dim, spec.value_dim)
        eye = torch.eye(spec.key_dim)
        outputs = []
        for t in range(s):
            if t:  # a segment's first token starts from the zero state
                state = state * (segments[:, t] == segments[:, t - 1])[:, None, None, None]
            k_t, v_t, beta_t = k[:, t], v[:, t], beta[:, t, :, None, None]
            erase = eye - beta_t * k_t[..., :, None] * k_t[..., None, :]  # I - beta k k^T
            state = alpha[:, t, :, None, None] * (erase @ state) + beta_t * k_t[..., :, None] * v_t[..., None, :]
            outputs.append((state * q[:, t, ..., None]).sum(-2))  # S^T q
        o = torch.stack(outputs, dim=1)  # [b, s, value heads, value_dim]
        gated = self.out_norm(o) * F.silu(heads(z, spec.value_heads, spec.value_dim))
        return self.out_proj(gated.reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, hidden, ffn, swiglu=False):
        super().__init__()
        self.swiglu = swiglu
        self.linear_fc1 = nn.Linear(hidden, 2 * ffn if swiglu else ffn)
        self.linear_fc2 = nn.Linear(ffn, hidden)

    def forward(self, x):
        if self.swiglu:  # megatron-core's order: the gate's half first
            gate, up = self.linear_fc1(x).chunk(2, dim=-1)
            return self.linear_fc2(F.silu(gate) * up)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


@dataclass(frozen=True)
class Architecture:
    """What a layer is made of: the norm of every layer and head (LayerNorm or RMSNorm), q/k
    norms of that kind, multi-latent attention (`latent`) instead of grouped-query (which may
    gate its output, `output_gate`, and rotate a leading fraction of each head, `rotary_percent`),
    a SwiGLU MLP, and Gated DeltaNet mixers (`delta_net`) in the decoder layers `linear_layers`
    (the others, and the MTP depths' layers, attend)."""
    normalization: str = "LayerNorm"
    qk_norm: bool = False
    latent: Latent | None = None
    output_gate: bool = False
    rotary_percent: float = 1.0
    swiglu: bool = False
    delta_net: DeltaNet | None = None
    linear_layers: frozenset = frozenset()


class TransformerLayer(nn.Module):
    def __init__(self, hidden, heads, groups, ffn, arch=Architecture(), linear=False):
        super().__init__()
        self.input_layernorm = norm(arch.normalization, hidden)
        self.self_attention = GatedDeltaNet(hidden, arch.delta_net, arch.normalization) if linear else \
            attention(hidden, heads, groups, arch.normalization if arch.qk_norm else None, arch.latent,
                      arch.output_gate, arch.rotary_percent)
        self.pre_mlp_layernorm = norm(arch.normalization, hidden)
        self.mlp = MLP(hidden, ffn, arch.swiglu)

    def forward(self, x, positions, segments):
        x = x + self.self_attention(self.input_layernorm(x), positions, segments)
        return x + self.mlp(self.pre_mlp_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, layers, hidden, heads, groups, ffn, arch=Architecture()):
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(hidden, heads, groups, ffn, arch, i in arch.linear_layers)
                                    for i in range(layers))
        self.final_layernorm = norm(arch.normalization, hidden)

    def forward(self, x, positions, segments):
        for layer in self.layers:
            x = layer(x, positions, segments)
        return self.final_layernorm(x)


class MTPLayer(nn.Module):
    def __init__(self, hidden, heads, groups, ffn, inner_name, arch=Architecture()):
        super().__init__()
        self.enorm = norm(arch.normalization, hidden)
        self.hnorm = norm(arch.normalization, hidden)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.inner_name = inner_name
        setattr(self, inner_name, TransformerLayer(hidden, heads, groups, ffn, arch))
        self.final_layernorm = norm(arch.normalization, hidden)

    def forward(self, embedded, hidden, positions, segments):
        u = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        return self.final_layernorm(getattr(self, self.inner_name)(u, positions, segments))


class Embedding(nn.Module):
    def __init__(self, vocab, hidden):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)


class MTPBlock(nn.Module):
    def __init__(self, layers, hidden, heads, groups, ffn, inner_name, arch=Architecture()):
        super().__init__()
        self.layers = nn.ModuleList(MTPLayer(hidden, heads, groups, ffn, inner_name, arch) for _ in range(layers))


def mtp_inner_layer_name(state_dict) -> str:
    """The MTP layer's transformer layer is `transformer_layer` in megatron-core 0.16 and
    `mtp_model_layer` from 0.17 on; the reference takes the name of the weights it loads."""
    return "mtp_model_layer" if any(".mtp_model_layer." in k for k in state_dict) else "transformer_layer"


def positions_within_segments(segments):
    """Position of each token inside its segment: RoPE restarts at every packed segment."""
    b, s = segments.shape
    idx = torch.arange(s).expand(b, s)
    starts = torch.zeros_like(segments)
    starts[:, 1:] = (segments[:, 1:] != segments[:, :-1]).long()
    first = torch.where(starts.bool() | (idx == 0), idx, torch.zeros_like(idx))
    return idx - torch.cummax(first, dim=1).values


def rope_table(positions, head_dim, base=10000.0):
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    return torch.cat([freqs, freqs], dim=-1)  # [b, s, head_dim]


def apply_rope(x, angles):
    cos, sin = angles.cos()[:, :, None], angles.sin()[:, :, None]
    half = x.size(-1) // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def shift_left(tensor, k, segments):
    """tensor[t + k] within the same segment, else 0."""
    s = tensor.size(1)
    out = torch.zeros_like(tensor)
    if k < s:
        same = segments[:, k:] == segments[:, :-k] if k else torch.ones_like(segments, dtype=torch.bool)
        out[:, :s - k] = torch.where(same, tensor[:, k:], torch.zeros_like(tensor[:, k:]))
    return out


class ReferenceGPT(nn.Module):
    def __init__(self, vocab, hidden, heads, layers, mtp_depths, groups=None, ffn=None,
                 tied=False, repeated=False, detach_heads=False, mtp_loss_scaling_factor=0.1,
                 mtp_inner_name="transformer_layer", arch=Architecture(), mtp_loss_type="ce",
                 mtp_draft_temperature=1.0):
        super().__init__()
        groups, ffn = groups or heads, ffn or 4 * hidden
        self.heads, self.hidden, self.depths = heads, hidden, mtp_depths
        self.tied, self.repeated, self.detach_heads = tied, repeated, detach_heads
        self.mtp_loss_scaling_factor = mtp_loss_scaling_factor
        self.mtp_loss_type, self.mtp_draft_temperature = mtp_loss_type, mtp_draft_temperature  # defaults
        self.embedding = Embedding(vocab, hidden)
        self.decoder = Decoder(layers, hidden, heads, groups, ffn, arch)
        if not tied:
            self.output_layer = nn.Module()
            self.output_layer.weight = nn.Parameter(torch.empty(vocab, hidden))
        if mtp_depths:
            self.mtp = MTPBlock(1 if repeated else mtp_depths, hidden, heads, groups, ffn, mtp_inner_name, arch)

    def output_weight(self):
        return self.embedding.word_embeddings.weight if self.tied else self.output_layer.weight

    def forward(self, input_ids, segments=None):
        """Returns main logits [b, s, V] and per-depth MTP logits (list of [b, s, V])."""
        if segments is None:
            segments = torch.zeros_like(input_ids)
        positions = positions_within_segments(segments)
        embed = self.embedding.word_embeddings
        h = self.decoder(embed(input_ids), positions, segments)
        logits = h @ self.output_weight().t()
        mtp_logits = []
        hidden = h.detach() if self.detach_heads else h
        for k in range(1, self.depths + 1):
            tokens_k = shift_left(input_ids, k, segments)
            e = embed(tokens_k).detach() if self.detach_heads else embed(tokens_k)
            layer = self.mtp.layers[0 if self.repeated else k - 1]
            hidden = layer(e, hidden, positions, segments)
            weight = self.output_weight().detach() if self.detach_heads else self.output_weight()
            mtp_logits.append(hidden @ weight.t())
        return logits, mtp_logits

    def losses(self, input_ids, labels, loss_mask, segments=None):
        """Per-position main CE [b, s] and per-depth (CE [b, s], mask [b, s], labels [b, s])."""
        if segments is None:
            segments = torch.zeros_like(input_ids)
        logits, mtp_logits = self(input_ids, segments)
        main = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
        per_depth = []
        for k, lg in enumerate(mtp_logits, start=1):
            labels_k = shift_left(labels, k, segments)
            mask_k = shift_left(loss_mask, k, segments)
            ce = F.cross_entropy(lg.transpose(1, 2), labels_k, reduction="none")
            per_depth.append((ce, mask_k, labels_k, lg))
        return logits, main, per_depth

    def objective_sums(self, input_ids, labels, loss_mask, segments=None, objective=None, temperature=None):
        """sum(main CE * m) + (lambda / D) * sum_k S_k; divided by N_tok it is the spec's L.
        `objective`, `temperature`: the draft objective (default: the model's)."""
        objective = objective or self.mtp_loss_type
        temperature = temperature or self.mtp_draft_temperature
        logits, main, per_depth = self.losses(input_ids, labels, loss_mask, segments)
        total = (main * loss_mask).sum()
        if not per_depth:
            return total
        mtp = draft_objective_sum(objective, logits, per_depth, segments, temperature)
        return total + self.mtp_loss_scaling_factor / self.depths * mtp


def main_distributions(logits, depths, segments, temperature):
    """p^k_t for k = 1..D, each [b, s, V]: softmax of the main logits at t + k of the same
    segment divided by tau (0 where t + k leaves it; such positions are masked), detached."""
    if segments is None:
        segments = torch.zeros(logits.shape[:2], dtype=torch.long)
    b, s, _ = logits.shape
    probabilities = []
    for k in range(1, depths + 1):
        p = torch.zeros_like(logits)
        for t in range(s - k):
            same = segments[:, t] == segments[:, t + k]
            p[same, t] = torch.softmax(logits[same, t + k].detach() / temperature, dim=-1)
        probabilities.append(p)
    return probabilities


def acceptances(logits, per_depth, segments, temperature):
    """alpha^k_t = sum_v min(p, q) for k = 1..D, each [b, s]."""
    ps = main_distributions(logits, len(per_depth), segments, temperature)
    return [torch.minimum(p, torch.softmax(lg / temperature, dim=-1)).sum(dim=-1)
            for p, (_, _, _, lg) in zip(ps, per_depth, strict=True)]


def greedy_draft_acceptances(logits, per_depth, segments, temperature):
    """beta^k_t = p^k_t(d), d the lowest token id where depth k's logits are largest, for
    k = 1..D, each [b, s] (spec section 12.1)."""
    ps = main_distributions(logits, len(per_depth), segments, temperature)
    acceptances = []
    for p, (_, _, _, lg) in zip(ps, per_depth, strict=True):
        ids = torch.arange(lg.shape[-1]).expand_as(lg)
        draft = torch.where(lg == lg.max(dim=-1, keepdim=True).values, ids, lg.shape[-1]).min(dim=-1).values
        acceptances.append(p.gather(-1, draft.unsqueeze(-1)).squeeze(-1))
    return acceptances


def draft_terms(objective, logits, per_depth, segments, temperature):
    """Each depth's per-position term [b, s]: CE, KL(p || q), 1 - alpha, or e2e_tv's prefix
    1 - prod_{i<=k} alpha^i."""
    if objective == "ce":
        return [ce for ce, _, _, _ in per_depth]
    if objective == "kl":
        ps = main_distributions(logits, len(per_depth), segments, temperature)
        return [(p * (torch.log(p.clamp(min=1e-30)) - torch.log_softmax(lg / temperature, dim=-1))).sum(dim=-1)
                for p, (_, _, _, lg) in zip(ps, per_depth, strict=True)]
    alphas = acceptances(logits, per_depth, segments, temperature)
    if objective == "tv":
        return [1.0 - alpha for alpha in alphas]
    if objective != "e2e_tv":
        raise ValueError(objective)
    terms, running = [], 1.0
    for alpha in alphas:
        running = running * alpha
        terms.append(1.0 - running)
    return terms


def draft_objective_sum(objective, logits, per_depth, segments, temperature):
    """sum_k S_k of a draft objective. e2e_tv: D * sum_t e_t over anchors valid at every depth,
    e_t = 1 - (1/D) sum_j prod_{i<=j} alpha^i = (1/D) sum_j (1 - prod_{i<=j} alpha^i)."""
    terms = draft_terms(objective, logits, per_depth, segments, temperature)
    if objective == "e2e_tv":
        chain = torch.stack([mask_k != 0 for _, mask_k, _, _ in per_depth]).all(dim=0)
        return sum((term * chain).sum() for term in terms)
    return sum((term * mask_k).sum() for term, (_, mask_k, _, _) in zip(terms, per_depth, strict=True))
