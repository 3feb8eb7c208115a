# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Tensor names and layouts between megatron-core's model and Hugging Face's.

megatron-core: the state-dict names of GPTModel built with the trainer's local spec (one
process; serving.model.local_names turns a checkpoint's global tensors, at any layout, into
them), per layer:

    embedding.word_embeddings.weight                    [Vp, H]   (Vp: the padded vocabulary)
    decoder.layers.{i}.input_layernorm.weight, pre_mlp_layernorm.weight
    decoder.layers.{i}.self_attention.linear_qkv.weight [G*(R+2)*d, H]: per query group g, its R
                                                        query heads, then its key, then its value
      with an output gate (Qwen3-Next): [G*(2R+2)*d, H], per group its R query heads, their R gates, key, value
      Gated DeltaNet (Qwen3-Next's linear attention layers): self_attention.in_proj [2*Nk*dk + 2*Nv*dv + 2*Nv, H]
      (all queries, keys, values, output gates z, betas, alphas; value head j belongs to key head j // (Nv/Nk)),
      conv1d [2*Nk*dk + Nv*dv, 1, K] (queries, keys, values), A_log, dt_bias [Nv], out_norm [dv] (zero-centred
      like every norm of the model: it scales by 1 + w), out_proj [H, Nv*dv]
      multi-latent attention: linear_q_down_proj, q_layernorm, linear_q_up_proj [heads*(n+r), q_rank]
      (per head its n no-position dims, then its r rotary dims), linear_kv_down_proj [kv_rank+r, H]
      (the latent, then the shared rotary key), kv_layernorm, linear_kv_up_proj [heads*(n+v), kv_rank]
    decoder.layers.{i}.mlp.linear_fc1.weight            [2F, H]: [gate; up]
      experts: mlp.router.weight [E, H], mlp.router.expert_bias [E],
      mlp.experts.local_experts.{e}.linear_fc1 / fc2, mlp.shared_experts.linear_fc1 / fc2,
      mlp.shared_experts.gate_weight [1, H] (the shared expert's sigmoid gate)
    decoder.final_layernorm.weight, output_layer.weight (untied)
    mtp.layers.{k}.{enorm, hnorm, eh_proj, mtp_model_layer.*, final_layernorm}
                                                        eh_proj's input is [embedding, hidden]

Hugging Face: Llama / Qwen2 / Qwen3 names (q/k/v/o_proj, Qwen3's q_norm / k_norm = megatron-core's
q_layernorm / k_layernorm, gate/up/down_proj, input_layernorm,
post_attention_layernorm, model.norm, lm_head); Qwen3-MoE's experts (mlp.gate = the router,
mlp.experts.{e}.gate/up/down_proj); DeepSeek-V3's multi-latent attention (q_a_proj, q_a_layernorm,
q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj; both store the rotary dims
with pairs interleaved: megatron-core's MLA rotates them so) and experts (mlp.gate with
e_score_correction_bias = the expert bias, the shared expert under the family's prefix).
Gated attention (Qwen3-Next's): q_proj holds per head its query then its output gate. Gated DeltaNet
layers (linear_attn): the family's input projections (its in_proj_parts: which in_proj sections
each holds, grouped per key head or section by section); conv1d, A_log, dt_bias and out_proj are
the same tensors; linear_attn.norm scales by w where megatron-core's out_norm scales by 1 + w, so
it is shifted by one (the model's other norms are (1 + w) on both sides). The MTP depths: in the
layout an MtpLayout of serving.families describes (MiMo's, DeepSeek-V3's, Qwen3-Next's).
An MTP depth's inner layer is built as the last decoder layer (MoE when that one is), with full
attention.
"""

import functools
import re

import torch

from megatron_mtp.serving import ServingError, experts, families
from megatron_mtp.serving.config import ModelConfig

# Buffers some checkpoints carry that are recomputed from the config.
IGNORED_HF = re.compile(r".*rotary_emb\.inv_freq$")


# ---------------------------------------------------------------- one transformer layer

def _qkv_split(weight: torch.Tensor, cfg: ModelConfig):
    """linear_qkv -> q_proj (per head its query, then its output gate when the attention has one),
    k_proj, v_proj."""
    groups, per_group, d = cfg.num_query_groups, cfg.num_attention_heads // cfg.num_query_groups, cfg.head_dim
    gates, rest = per_group if cfg.attention_output_gate else 0, weight.shape[1:]
    grouped = weight.reshape(groups, per_group + gates + 2, d, *rest)
    q = grouped[:, :per_group]
    if gates:
        q = torch.stack([q, grouped[:, per_group:per_group + gates]], 2)
    return tuple(t.reshape(-1, *rest).contiguous() for t in (q, grouped[:, -2], grouped[:, -1]))


def _qkv_fuse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    groups, per_group, d = cfg.num_query_groups, cfg.num_attention_heads // cfg.num_query_groups, cfg.head_dim
    rest = q.shape[1:]
    heads = q.reshape(groups, per_group, 2 if cfg.attention_output_gate else 1, d, *rest)
    fused = torch.cat([heads[:, :, i] for i in range(heads.shape[2])]
                      + [k.reshape(groups, 1, d, *rest), v.reshape(groups, 1, d, *rest)], dim=1)
    return fused.reshape(-1, *rest).contiguous()


def _key_heads(cfg: ModelConfig):
    """Gated DeltaNet's key heads, key head size, value heads per key head, value head size."""
    g = cfg.gdn
    return (g["linear_num_key_heads"], g["linear_key_head_dim"],
            g["linear_num_value_heads"] // g["linear_num_key_heads"], g["linear_value_head_dim"])


def _in_proj_sections(cfg: ModelConfig) -> list:
    """The rows of megatron-core's in_proj: queries, keys, values, z, betas, alphas."""
    heads, dk, per_head, dv = _key_heads(cfg)
    return [heads * dk, heads * dk, heads * per_head * dv, heads * per_head * dv, heads * per_head, heads * per_head]


def _in_proj_groups(cfg: ModelConfig) -> int:
    """How many groups Hugging Face's Gated DeltaNet input projections hold the in_proj sections in:
    one per key head, or one (section by section)."""
    return cfg.gdn["linear_num_key_heads"] if cfg.adapter.in_proj_per_key_head else 1


def _in_proj_split(weight: torch.Tensor, cfg: ModelConfig) -> dict:
    """megatron-core's in_proj (section by section) -> Hugging Face's projections (the family's in_proj_parts)."""
    sections, hidden, heads = torch.split(weight, _in_proj_sections(cfg)), weight.shape[1], _in_proj_groups(cfg)
    return {name: torch.cat([sections[i].reshape(heads, -1, hidden) for i in held], 1).reshape(-1, hidden).contiguous()
            for name, held in cfg.adapter.in_proj_parts}


def _in_proj_fuse(layer: dict, cfg: ModelConfig) -> torch.Tensor:
    """Hugging Face's projections (the family's in_proj_parts) -> megatron-core's in_proj, section by section."""
    rows, heads = _in_proj_sections(cfg), _in_proj_groups(cfg)
    sections = {}
    for name, held in cfg.adapter.in_proj_parts:
        hidden = layer[name].shape[1]
        parts = torch.split(layer[name].reshape(heads, -1, hidden), [rows[i] // heads for i in held], 1)
        sections.update({i: part.reshape(-1, hidden) for i, part in zip(held, parts, strict=True)})
    return torch.cat([sections[i] for i in range(len(rows))]).contiguous()


# Gated DeltaNet's gated output norm: transformers' linear_attn.norm scales by w (initialized to
# ones), megatron-core's out_norm is zero-centred like every norm of the model and scales by 1 + w',
# so the import writes w' = w - 1 and the export w' + 1, the scale the model computes with
# (Megatron-Bridge shifts it so too). Both give w back bit for bit for every bf16 w with
# |w| >= 2^-16 and every fp32 w in [0.5, 2^24) (Sterbenz's lemma); fp32 cannot hold w - 1 for a
# smaller fp32 w, which comes back within half an ulp of w - 1 (<= 2^-24).
GATED_NORM, HF_GATED_NORM = "self_attention.out_norm.weight", "linear_attn.norm.weight"


MLA_NAMES = [("self_attention.linear_q_down_proj.weight", "self_attn.q_a_proj.weight"),
             ("self_attention.q_layernorm.weight", "self_attn.q_a_layernorm.weight"),
             ("self_attention.linear_q_up_proj.weight", "self_attn.q_b_proj.weight"),
             ("self_attention.linear_kv_down_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),
             ("self_attention.kv_layernorm.weight", "self_attn.kv_a_layernorm.weight"),
             ("self_attention.linear_kv_up_proj.weight", "self_attn.kv_b_proj.weight")]
GDN_NAMES = [("self_attention.conv1d.weight", "linear_attn.conv1d.weight"),
             ("self_attention.A_log", "linear_attn.A_log"), ("self_attention.dt_bias", "linear_attn.dt_bias"),
             ("self_attention.out_proj.weight", "linear_attn.out_proj.weight")]


def _mlp_names(cfg: ModelConfig, sparse: bool) -> list:
    """(megatron-core prefix, Hugging Face prefix) of each SwiGLU MLP of a layer."""
    if not sparse:
        return [("mlp.", "mlp.")]
    experts = [(f"mlp.experts.local_experts.{e}.", f"mlp.experts.{e}.") for e in range(cfg.moe["experts"])]
    return experts + ([("mlp.shared_experts.", cfg.adapter.hf_shared_expert)] if cfg.moe["shared_ffn"] else [])


def _renamed(cfg: ModelConfig, sparse: bool, linear: bool) -> list:
    """(megatron-core suffix, Hugging Face suffix) of a layer's tensors that only change name (the
    fused QKV, Gated DeltaNet's in_proj, [gate; up] are split and joined, the shifted norm shifted);
    `linear`: a Gated DeltaNet layer."""
    names = [("input_layernorm.weight", "input_layernorm.weight"),
             ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight")]
    if linear:
        names += GDN_NAMES
    else:
        names.append(("self_attention.linear_proj.weight", "self_attn.o_proj.weight"))
        if cfg.mla:
            names += MLA_NAMES
        elif cfg.qk_layernorm:
            names += [("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
                      ("self_attention.k_layernorm.weight", "self_attn.k_norm.weight")]
    if sparse:
        names.append(("mlp.router.weight", "mlp.gate.weight"))
        if cfg.moe["expert_bias"]:
            names.append(("mlp.router.expert_bias", "mlp.gate.e_score_correction_bias"))
        if cfg.moe["shared_gate"]:
            names.append(("mlp.shared_experts.gate_weight", cfg.adapter.hf_shared_expert[:-1] + "_gate.weight"))
    return names + [(ours + "linear_fc2.weight", hf + "down_proj.weight") for ours, hf in _mlp_names(cfg, sparse)]


def _qkv_kinds(cfg: ModelConfig, linear: bool) -> tuple:
    return () if cfg.mla or linear else ("weight", "bias") if cfg.qkv_bias else ("weight",)


def layer_to_hf(layer: dict, cfg: ModelConfig, sparse: bool = False, linear: bool = False) -> dict:
    """One megatron-core layer's tensors (suffix -> tensor) as Hugging Face suffixes; `sparse`: its
    MLP is the experts'; `linear`: a Gated DeltaNet layer."""
    out = {hf: layer[ours] for ours, hf in _renamed(cfg, sparse, linear)}
    for kind in _qkv_kinds(cfg, linear):
        q, k, v = _qkv_split(layer[f"self_attention.linear_qkv.{kind}"], cfg)
        out.update({f"self_attn.q_proj.{kind}": q, f"self_attn.k_proj.{kind}": k, f"self_attn.v_proj.{kind}": v})
    if linear:
        out.update(_in_proj_split(layer["self_attention.in_proj.weight"], cfg))
        out[HF_GATED_NORM] = layer[GATED_NORM] + 1
    for ours, hf in _mlp_names(cfg, sparse):
        gate, up = torch.chunk(layer[ours + "linear_fc1.weight"], 2, dim=0)
        out.update({hf + "gate_proj.weight": gate.contiguous(), hf + "up_proj.weight": up.contiguous()})
    return out


def layer_from_hf(layer: dict, cfg: ModelConfig, sparse: bool = False, linear: bool = False) -> dict:
    out = {ours: layer[hf] for ours, hf in _renamed(cfg, sparse, linear)}
    for kind in _qkv_kinds(cfg, linear):
        out[f"self_attention.linear_qkv.{kind}"] = _qkv_fuse(*(layer[f"self_attn.{x}_proj.{kind}"] for x in "qkv"), cfg)
    if linear:
        out["self_attention.in_proj.weight"] = _in_proj_fuse(layer, cfg)
        out[GATED_NORM] = layer[HF_GATED_NORM] - 1
    for ours, hf in _mlp_names(cfg, sparse):
        out[ours + "linear_fc1.weight"] = torch.cat([layer[hf + "gate_proj.weight"], layer[hf + "up_proj.weight"]], 0)
    return out


def hf_layer_shapes(cfg: ModelConfig, sparse: bool = False, linear: bool = False) -> dict:
    H, d = cfg.hidden_size, cfg.head_dim
    shapes = {"input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,)}
    if linear:
        heads, dk, per_head, dv = _key_heads(cfg)
        qk, v = heads * dk, heads * per_head * dv
        rows = _in_proj_sections(cfg)
        shapes.update({name: (sum(rows[i] for i in held), H) for name, held in cfg.adapter.in_proj_parts})
        shapes.update({"linear_attn.conv1d.weight": (2 * qk + v, 1, cfg.gdn["linear_conv_kernel_dim"]),
                       "linear_attn.A_log": (heads * per_head,), "linear_attn.dt_bias": (heads * per_head,),
                       "linear_attn.norm.weight": (dv,), "linear_attn.out_proj.weight": (H, v)})
    elif cfg.mla:
        m, heads = cfg.mla, cfg.num_attention_heads
        rotary = m["qk_rope_head_dim"]
        shapes.update({"self_attn.q_a_proj.weight": (m["q_lora_rank"], H),
                       "self_attn.q_a_layernorm.weight": (m["q_lora_rank"],),
                       "self_attn.q_b_proj.weight": (heads * (m["qk_nope_head_dim"] + rotary), m["q_lora_rank"]),
                       "self_attn.kv_a_proj_with_mqa.weight": (m["kv_lora_rank"] + rotary, H),
                       "self_attn.kv_a_layernorm.weight": (m["kv_lora_rank"],),
                       "self_attn.kv_b_proj.weight": (heads * (m["qk_nope_head_dim"] + m["v_head_dim"]),
                                                      m["kv_lora_rank"]),
                       "self_attn.o_proj.weight": (H, heads * m["v_head_dim"])})
    else:
        q, kv = cfg.num_attention_heads * d, cfg.num_query_groups * d
        gated = 2 if cfg.attention_output_gate else 1  # each head's output gate beside its query
        shapes.update({"self_attn.q_proj.weight": (gated * q, H), "self_attn.k_proj.weight": (kv, H),
                       "self_attn.v_proj.weight": (kv, H), "self_attn.o_proj.weight": (H, q)})
        if cfg.qkv_bias:
            shapes.update({"self_attn.q_proj.bias": (gated * q,), "self_attn.k_proj.bias": (kv,),
                           "self_attn.v_proj.bias": (kv,)})
        if cfg.qk_layernorm:
            shapes.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
    if sparse:
        shapes["mlp.gate.weight"] = (cfg.moe["experts"], H)
        if cfg.moe["expert_bias"]:
            shapes["mlp.gate.e_score_correction_bias"] = (cfg.moe["experts"],)
        if cfg.moe["shared_gate"]:
            shapes[cfg.adapter.hf_shared_expert[:-1] + "_gate.weight"] = (1, H)
    for ours, hf in _mlp_names(cfg, sparse):
        F = (cfg.ffn_hidden_size if not sparse else cfg.moe["shared_ffn"] if "shared" in ours else cfg.moe["ffn"])
        shapes.update({hf + "gate_proj.weight": (F, H), hf + "up_proj.weight": (F, H), hf + "down_proj.weight": (H, F)})
    return shapes


def sparse_layers(cfg: ModelConfig) -> list:
    """Whether each decoder layer's MLP is the experts' (none without experts)."""
    return [bool(x) for x in cfg.moe["layers"]] if cfg.moe else [False] * cfg.num_layers


def linear_layers(cfg: ModelConfig) -> list:
    """Whether each decoder layer is a Gated DeltaNet layer (none without them)."""
    return [bool(x) for x in cfg.gdn["layers"]] if cfg.gdn else [False] * cfg.num_layers


def layer_kinds(cfg: ModelConfig) -> list:
    """(sparse, linear) for each decoder layer, the two lists of one length (a config whose expert
    and Gated DeltaNet layer lists disagree must not lose layers)."""
    return list(zip(sparse_layers(cfg), linear_layers(cfg), strict=True))


def mtp_sparse(cfg: ModelConfig) -> bool:
    """An MTP depth's inner layer is built as the last decoder layer."""
    return sparse_layers(cfg)[-1]


def hf_shapes(cfg: ModelConfig, mtp_layout: str | None, mtp_depths: int) -> dict:
    """Every tensor name of the Hugging Face checkpoint and its shape (the loaders' names)."""
    V, H = cfg.vocab_size, cfg.hidden_size
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not cfg.tied:
        shapes["lm_head.weight"] = (V, H)
    for i, (sparse, linear) in enumerate(layer_kinds(cfg)):
        shapes.update({f"model.layers.{i}.{k}": s for k, s in hf_layer_shapes(cfg, sparse, linear).items()})
    layout = families.mtp_layout(mtp_layout) if mtp_layout else None
    for depth in range(mtp_depths if mtp_layout else 0):
        prefix = layout.prefix(cfg, depth)
        shapes.update({prefix + k: s for k, s in hf_layer_shapes(cfg, mtp_sparse(cfg)).items()})
        shapes.update(layout.shapes(cfg, prefix))
    return shapes


# ---------------------------------------------------------------- whole models

def _unpad(t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    return t[: cfg.vocab_size].contiguous()


def _pad(t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    if cfg.padded_vocab_size == t.shape[0]:
        return t
    return torch.cat([t, t.new_zeros(cfg.padded_vocab_size - t.shape[0], *t.shape[1:])], 0)


def _inner(tensors: dict, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


def hf_parts(cfg: ModelConfig, mtp_layout: str | None) -> list:
    """The Hugging Face export in parts, in the order written: (whether the part is an MTP depth's, the
    prefixes of the model's tensor names it reads, the part: those tensors -> its Hugging Face tensors).
    The weight stream gathers, maps and sends one part at a time; megatron_to_hf joins them all."""
    vocab = "embedding.word_embeddings.weight"
    head = vocab if cfg.tied else "output_layer.weight"

    def embedding(t):
        return {"model.embed_tokens.weight": _unpad(t[vocab], cfg)}

    def output_layer(t):  # none when tied: the embedding serves
        return {} if cfg.tied else {"lm_head.weight": _unpad(t[head], cfg)}

    def layer(t, i, sparse, linear):
        return {f"model.layers.{i}.{k}": v.contiguous()
                for k, v in layer_to_hf(_inner(t, f"decoder.layers.{i}."), cfg, sparse, linear).items()}

    def final(t):
        return {"model.norm.weight": t["decoder.final_layernorm.weight"], **output_layer(t)}

    def depth(t, d):
        source, prefix = f"mtp.layers.{0 if cfg.mtp_repeated else d}.", layout.prefix(cfg, d)
        # a layout that copies the embedding or the head into a depth reads them from these
        copied = {**embedding(t), **output_layer(t)} if layout.copies_shared else {}
        out = dict(copied)
        inner = _inner(t, source + "mtp_model_layer.")
        out.update({prefix + k: v for k, v in layer_to_hf(inner, cfg, mtp_sparse(cfg)).items()})
        layout.to_hf(t, source, prefix, d, cfg, out)
        return {k: v for k, v in out.items() if k not in copied}

    parts = [(False, (vocab,), embedding)]
    for i, (sparse, linear) in enumerate(layer_kinds(cfg)):
        parts.append((False, (f"decoder.layers.{i}.",), functools.partial(layer, i=i, sparse=sparse, linear=linear)))
    parts.append((False, ("decoder.final_layernorm.",) + (() if cfg.tied else (head,)), final))
    layout = families.mtp_layout(mtp_layout) if mtp_layout else None
    for d in range(cfg.mtp_num_layers if mtp_layout else 0):
        reads = (f"mtp.layers.{0 if cfg.mtp_repeated else d}.",) + ((vocab, head) if layout.copies_shared else ())
        parts.append((True, reads, functools.partial(depth, d=d)))
    return parts


def depths_differ(what: str, name: str) -> ServingError:
    """The refusal of a layout that holds one tensor for every MTP depth (Qwen3-Next's shared norms and
    fc) where the depths' tensors differ: the export's (join) and the weight stream's."""
    return ServingError(f"{what}: the MTP layout holds one {name} for all depths, and the depths' differ: use "
                        "--mtp-layout none (the backbone only), or train the depths as one --mtp-use-repeated-layer")


def join(out: dict, part: dict, what: str) -> None:
    """A part's tensors into `out`: a name an earlier part wrote (a layout that holds one tensor for
    every MTP depth) must come again with the same value."""
    for name, value in part.items():
        if name in out and not torch.equal(out[name], value):
            raise depths_differ(what, name)
        out.setdefault(name, value)


def megatron_to_hf(tensors: dict, cfg: ModelConfig, mtp_layout: str | None) -> dict:
    """megatron-core model tensors (state-dict names) -> Hugging Face tensors (MTP depths only
    with a layout)."""
    out = {}
    for _, _, part in hf_parts(cfg, mtp_layout):
        join(out, part(tensors), f"--mtp-layout {mtp_layout}")
    return out


def unwrap_vlm(config: dict, tensors: dict) -> tuple[dict, dict, int]:
    """A published VLM checkpoint (a family's vlm_wrapper, Qwen3.5's: model.language_model.*, lm_head and
    mtp.* beside the vision tower model.visual.*, the language model's config.json nested in
    text_config) as its text-only CausalLM's: (config, tensors, the vision tower's tensors left out).
    The trainer trains the language model alone; another checkpoint is returned as it is."""
    wrapper = next((a for a in config.get("architectures") or [] if a in families.VLM_WRAPPERS), None)
    if wrapper is None:
        return config, tensors, 0
    if not isinstance(config.get("text_config"), dict):
        raise ServingError(f"config.json: {wrapper} without a text_config (the language model's config)")
    # transformers' wrapper ties its lm_head by its own tie_word_embeddings (false when absent), not
    # text_config's; the token ids text_config lacks are the wrapper's
    text = dict(config["text_config"], architectures=[families.VLM_WRAPPERS[wrapper]],
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)))
    text.update({k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                 if k in config and k not in text})
    prefix, vision = "model.language_model.", "model.visual."
    if not any(name.startswith(prefix) for name in tensors):
        raise ServingError(f"config.json names {wrapper}, but no tensor is under {prefix}")
    out = {("model." + name[len(prefix):] if name.startswith(prefix) else name): value
           for name, value in tensors.items() if not name.startswith(vision)}
    return text, out, len(tensors) - len(out)


def detect_mtp(names, cfg: ModelConfig) -> tuple[str | None, int]:
    """The MTP layout and depth count of a Hugging Face checkpoint's names."""
    layouts = {name: layout.depths(names, cfg) for name, layout in families.MTP_LAYOUTS.items()}
    found = [(layout, depths) for layout, depths in layouts.items() if depths]
    if len(found) > 1:
        raise ServingError(f"the checkpoint holds MTP depths in "
                           f"{' and '.join(layout for layout, _ in found)}'s layouts")
    layout, depths = (found[0][0], max(found[0][1]) + 1) if found else (None, 0)
    if cfg.mtp_num_layers and depths and cfg.mtp_num_layers != depths:
        raise ServingError(f"config.json: {cfg.mtp_num_layers} MTP depths (num_nextn_predict_layers or "
                           f"mtp_num_hidden_layers), but the tensors hold {depths}")
    if cfg.mtp_num_layers and not depths:
        # the tensors are missing: the name check says which
        return default_mtp_layout(cfg), cfg.mtp_num_layers
    return layout, depths


def default_mtp_layout(cfg: ModelConfig) -> str:
    """The layout the family's engines read its MTP depths in."""
    return cfg.adapter.mtp_layout


def check_mtp(cfg: ModelConfig, layout: str | None, depths: int, written: bool) -> None:
    """The one check of `depths` MTP depths in `layout` (None: none) of the model `cfg`, refused in one
    line: the import's (the layout a checkpoint holds, the depths imported) and the export's (`written`:
    the layout written, with its engines' own refusals).

    A layout whose norms scale by 1 + w holds only a model whose norms do, and the others only the
    others (the family's own named). Written, the layout refuses what it cannot hold (MtpLayout.check)
    and the family what its engines do not read (Family.check_mtp_layout). An MTP depth's inner layer
    is built as the last decoder layer; Qwen3-Next's and Qwen3.5's (their engines') is a full-attention
    layer, so the last decoder layer must be one."""
    if layout:
        default = default_mtp_layout(cfg)
        if families.mtp_layout(layout).zero_centred != families.mtp_layout(default).zero_centred:
            raise ServingError(f"MTP depths in {layout}'s layout on a {cfg.family}-shaped model, whose engines read "
                               f"them in {default}'s (--mtp-layout {default})")
        if written:
            families.mtp_layout(layout).check(cfg)
            cfg.adapter.check_mtp_layout(layout)
    if depths and linear_layers(cfg)[-1]:
        raise ServingError(f"{depths} MTP depths on a model whose last layer is Gated DeltaNet: megatron-core builds "
                           "each depth's layer as the decoder's last, Qwen3-Next's and Qwen3.5's MTP layer is full "
                           "attention")


def check_hf(tensors: dict, cfg: ModelConfig, mtp_layout: str | None, depths: int) -> None:
    """Every expected name present with its shape, nothing else (one line naming the first problem)."""
    expected = hf_shapes(cfg, mtp_layout, depths)
    names = [n for n in tensors if not IGNORED_HF.match(n)]
    missing = [name for name in expected if name not in tensors]
    unexpected = [name for name in names if name not in expected]
    if unexpected:
        extra = " (config.json says tie_word_embeddings)" if unexpected[0] == "lm_head.weight" else ""
        instead = f"; missing {missing[0]}" if missing else ""
        raise ServingError(f"unexpected tensor {unexpected[0]}{extra}: not a {cfg.family} tensor of this "
                           f"config{instead}")
    if missing:
        raise ServingError(f"missing tensor {missing[0]}")
    for name in names:
        if tuple(tensors[name].shape) != tuple(expected[name]):
            raise ServingError(f"tensor {name} has shape {list(tensors[name].shape)}, config.json implies "
                               f"{list(expected[name])}")


def hf_to_megatron(tensors: dict, cfg: ModelConfig, mtp_layout: str | None, depths: int) -> dict:
    """Hugging Face tensors (checked) -> megatron-core model tensors (state-dict names), fp32 as the
    trainer holds them; the experts stored one per expert or stacked (serving.experts)."""
    tensors = experts.unstack(tensors, hf_shapes(cfg, mtp_layout, depths))
    check_hf(tensors, cfg, mtp_layout, depths)
    t = {k: v.float() for k, v in tensors.items() if not IGNORED_HF.match(k)}
    out = {"embedding.word_embeddings.weight": _pad(t["model.embed_tokens.weight"], cfg)}
    for i, (sparse, linear) in enumerate(layer_kinds(cfg)):
        layer = {k: t[f"model.layers.{i}.{k}"] for k in hf_layer_shapes(cfg, sparse, linear)}
        out.update({f"decoder.layers.{i}.{k}": v for k, v in layer_from_hf(layer, cfg, sparse, linear).items()})
    out["decoder.final_layernorm.weight"] = t["model.norm.weight"]
    if not cfg.tied:
        out["output_layer.weight"] = _pad(t["lm_head.weight"], cfg)
    layout = families.mtp_layout(mtp_layout) if depths else None
    for depth in range(depths):
        prefix = layout.prefix(cfg, depth)
        target = f"mtp.layers.{depth}."
        sparse = mtp_sparse(cfg)
        inner = layer_from_hf({k: t[prefix + k] for k in hf_layer_shapes(cfg, sparse)}, cfg, sparse)
        out.update({target + "mtp_model_layer." + k: v for k, v in inner.items()})
        out.update(layout.from_hf(t, prefix, target, cfg))
    return {k: v.contiguous() for k, v in out.items()}


def collapse_repeated(tensors: dict, depths: int) -> dict:
    """D identical MTP depths -> the one layer of --mtp-use-repeated-layer (refused if they differ)."""
    first = {k[len("mtp.layers.0."):]: v for k, v in tensors.items() if k.startswith("mtp.layers.0.")}
    for depth in range(1, depths):
        for suffix, value in first.items():
            if not torch.equal(tensors[f"mtp.layers.{depth}.{suffix}"], value):
                raise ServingError(f"--mtp-use-repeated-layer: MTP depth {depth} differs from depth 0 "
                                   f"({suffix}); import the depths as distinct layers")
    return {k: v for k, v in tensors.items() if not k.startswith("mtp.layers.") or k.startswith("mtp.layers.0.")}
