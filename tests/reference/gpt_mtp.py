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
"""

import math

import torch
import torch.nn.functional as F
from torch import nn


class SelfAttention(nn.Module):
    def __init__(self, hidden, heads, groups):
        super().__init__()
        self.heads, self.groups, self.head_dim = heads, groups, hidden // heads
        self.linear_qkv = nn.Linear(hidden, (heads + 2 * groups) * self.head_dim)
        self.linear_proj = nn.Linear(hidden, hidden)

    def forward(self, x, rope, segments):
        b, s, _ = x.shape
        per_group = self.heads // self.groups
        qkv = self.linear_qkv(x).view(b, s, self.groups, (per_group + 2) * self.head_dim)
        q, k, v = qkv.split([per_group * self.head_dim, self.head_dim, self.head_dim], dim=-1)
        q = q.reshape(b, s, self.heads, self.head_dim)
        k = k.repeat_interleave(per_group, dim=2)
        v = v.repeat_interleave(per_group, dim=2)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(self.head_dim)
        allowed = segments[:, :, None] == segments[:, None, :]
        allowed = allowed & torch.ones(s, s, dtype=torch.bool).tril()
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(dim=-1), v)
        return self.linear_proj(out.reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, hidden, ffn):
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden, ffn)
        self.linear_fc2 = nn.Linear(ffn, hidden)

    def forward(self, x):
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class TransformerLayer(nn.Module):
    def __init__(self, hidden, heads, groups, ffn):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden, eps=1e-5)
        self.self_attention = SelfAttention(hidden, heads, groups)
        self.pre_mlp_layernorm = nn.LayerNorm(hidden, eps=1e-5)
        self.mlp = MLP(hidden, ffn)

    def forward(self, x, rope, segments):
        x = x + self.self_attention(self.input_layernorm(x), rope, segments)
        return x + self.mlp(self.pre_mlp_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, layers, hidden, heads, groups, ffn):
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(hidden, heads, groups, ffn) for _ in range(layers))
        self.final_layernorm = nn.LayerNorm(hidden, eps=1e-5)

    def forward(self, x, rope, segments):
        for layer in self.layers:
            x = layer(x, rope, segments)
        return self.final_layernorm(x)


class MTPLayer(nn.Module):
    def __init__(self, hidden, heads, groups, ffn, inner_name):
        super().__init__()
        self.enorm = nn.LayerNorm(hidden, eps=1e-5)
        self.hnorm = nn.LayerNorm(hidden, eps=1e-5)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.inner_name = inner_name
        setattr(self, inner_name, TransformerLayer(hidden, heads, groups, ffn))
        self.final_layernorm = nn.LayerNorm(hidden, eps=1e-5)

    def forward(self, embedded, hidden, rope, segments):
        u = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        return self.final_layernorm(getattr(self, self.inner_name)(u, rope, segments))


class Embedding(nn.Module):
    def __init__(self, vocab, hidden):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)


class MTPBlock(nn.Module):
    def __init__(self, layers, hidden, heads, groups, ffn, inner_name):
        super().__init__()
        self.layers = nn.ModuleList(MTPLayer(hidden, heads, groups, ffn, inner_name) for _ in range(layers))


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
                 mtp_inner_name="transformer_layer"):
        super().__init__()
        groups, ffn = groups or heads, ffn or 4 * hidden
        self.heads, self.hidden, self.depths = heads, hidden, mtp_depths
        self.tied, self.repeated, self.detach_heads = tied, repeated, detach_heads
        self.mtp_loss_scaling_factor = mtp_loss_scaling_factor
        self.embedding = Embedding(vocab, hidden)
        self.decoder = Decoder(layers, hidden, heads, groups, ffn)
        if not tied:
            self.output_layer = nn.Module()
            self.output_layer.weight = nn.Parameter(torch.empty(vocab, hidden))
        if mtp_depths:
            self.mtp = MTPBlock(1 if repeated else mtp_depths, hidden, heads, groups, ffn, mtp_inner_name)

    def output_weight(self):
        return self.embedding.word_embeddings.weight if self.tied else self.output_layer.weight

    def forward(self, input_ids, segments=None):
        """Returns main logits [b, s, V] and per-depth MTP logits (list of [b, s, V])."""
        if segments is None:
            segments = torch.zeros_like(input_ids)
        rope = rope_table(positions_within_segments(segments), self.hidden // self.heads)
        embed = self.embedding.word_embeddings
        h = self.decoder(embed(input_ids), rope, segments)
        logits = h @ self.output_weight().t()
        mtp_logits = []
        hidden = h.detach() if self.detach_heads else h
        for k in range(1, self.depths + 1):
            tokens_k = shift_left(input_ids, k, segments)
            e = embed(tokens_k).detach() if self.detach_heads else embed(tokens_k)
            layer = self.mtp.layers[0 if self.repeated else k - 1]
            hidden = layer(e, hidden, rope, segments)
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

    def objective_sums(self, input_ids, labels, loss_mask, segments=None):
        """sum(main CE * m) + (lambda / D) * sum_k S_k; divided by N_tok it is the spec's L."""
        _, main, per_depth = self.losses(input_ids, labels, loss_mask, segments)
        total = (main * loss_mask).sum()
        for ce, mask_k, _, _ in per_depth:
            total = total + self.mtp_loss_scaling_factor / self.depths * (ce * mask_k).sum()
        return total
