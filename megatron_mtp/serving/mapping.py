"""Tensor names and layouts between megatron-core's model and Hugging Face's.

megatron-core: the state-dict names of GPTModel built with the trainer's local spec (one
process; serving.model.local_names turns a checkpoint's global tensors, at any layout, into
them), per layer:

    embedding.word_embeddings.weight                    [Vp, H]   (Vp: the padded vocabulary)
    decoder.layers.{i}.input_layernorm.weight, pre_mlp_layernorm.weight
    decoder.layers.{i}.self_attention.linear_qkv.weight [G*(R+2)*d, H]: per query group g, its R
                                                        query heads, then its key, then its value
      multi-latent attention: linear_q_down_proj, q_layernorm, linear_q_up_proj [heads*(n+r), q_rank]
      (per head its n no-position dims, then its r rotary dims), linear_kv_down_proj [kv_rank+r, H]
      (the latent, then the shared rotary key), kv_layernorm, linear_kv_up_proj [heads*(n+v), kv_rank]
    decoder.layers.{i}.mlp.linear_fc1.weight            [2F, H]: [gate; up]
      experts: mlp.router.weight [E, H], mlp.router.expert_bias [E],
      mlp.experts.local_experts.{e}.linear_fc1 / fc2, mlp.shared_experts.linear_fc1 / fc2
    decoder.final_layernorm.weight, output_layer.weight (untied)
    mtp.layers.{k}.{enorm, hnorm, eh_proj, mtp_model_layer.*, final_layernorm}
                                                        eh_proj's input is [embedding, hidden]

Hugging Face: Llama / Qwen2 / Qwen3 names (q/k/v/o_proj, Qwen3's q_norm / k_norm = megatron-core's
q_layernorm / k_layernorm, gate/up/down_proj, input_layernorm,
post_attention_layernorm, model.norm, lm_head); Qwen3-MoE's experts (mlp.gate = the router,
mlp.experts.{e}.gate/up/down_proj); DeepSeek-V3's multi-latent attention (q_a_proj, q_a_layernorm,
q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj; both store the rotary dims
with pairs interleaved: megatron-core's MLA rotates them so) and experts (mlp.gate with e_score_correction_bias = the expert
bias, mlp.shared_experts); the MTP depths in MiMo's layout
(model.mtp_layers.{k}: token_layernorm = enorm, hidden_layernorm = hnorm, input_proj over
[hidden, embedding], i.e. eh_proj with its halves swapped, final_layernorm) or DeepSeek-V3's
(model.layers.{L+k}: enorm, hnorm, eh_proj over [embedding, hidden], shared_head.norm =
final_layernorm, and the copies shared_head.head = the output weight, embed_tokens = the embedding).
An MTP depth's inner layer is built as the last decoder layer (MoE when that one is).
"""

import re

import torch

from megatron_mtp.serving import ServingError
from megatron_mtp.serving.config import ModelConfig

MTP_LAYOUTS = ("mimo", "deepseek_v3")
# Buffers some checkpoints carry that are recomputed from the config.
IGNORED_HF = re.compile(r".*rotary_emb\.inv_freq$")


# ---------------------------------------------------------------- one transformer layer

def _qkv_split(weight: torch.Tensor, cfg: ModelConfig):
    groups, per_group, d = cfg.num_query_groups, cfg.num_attention_heads // cfg.num_query_groups, cfg.head_dim
    grouped = weight.reshape(groups, per_group + 2, d, *weight.shape[1:])
    q = grouped[:, :per_group].reshape(groups * per_group * d, *weight.shape[1:])
    k = grouped[:, per_group].reshape(groups * d, *weight.shape[1:])
    v = grouped[:, per_group + 1].reshape(groups * d, *weight.shape[1:])
    return q.contiguous(), k.contiguous(), v.contiguous()


def _qkv_fuse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    groups, per_group, d = cfg.num_query_groups, cfg.num_attention_heads // cfg.num_query_groups, cfg.head_dim
    rest = q.shape[1:]
    fused = torch.cat([q.reshape(groups, per_group, d, *rest), k.reshape(groups, 1, d, *rest),
                       v.reshape(groups, 1, d, *rest)], dim=1)
    return fused.reshape(groups * (per_group + 2) * d, *rest).contiguous()


MLA_NAMES = [("self_attention.linear_q_down_proj.weight", "self_attn.q_a_proj.weight"),
             ("self_attention.q_layernorm.weight", "self_attn.q_a_layernorm.weight"),
             ("self_attention.linear_q_up_proj.weight", "self_attn.q_b_proj.weight"),
             ("self_attention.linear_kv_down_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),
             ("self_attention.kv_layernorm.weight", "self_attn.kv_a_layernorm.weight"),
             ("self_attention.linear_kv_up_proj.weight", "self_attn.kv_b_proj.weight")]


def _mlp_names(cfg: ModelConfig, sparse: bool) -> list:
    """(megatron-core prefix, Hugging Face prefix) of each SwiGLU MLP of a layer."""
    if not sparse:
        return [("mlp.", "mlp.")]
    experts = [(f"mlp.experts.local_experts.{e}.", f"mlp.experts.{e}.") for e in range(cfg.moe["experts"])]
    return experts + ([("mlp.shared_experts.", "mlp.shared_experts.")] if cfg.moe["shared_ffn"] else [])


def _renamed(cfg: ModelConfig, sparse: bool) -> list:
    """(megatron-core suffix, Hugging Face suffix) of a layer's tensors that only change name (the
    fused QKV and [gate; up] are split and joined)."""
    names = [("input_layernorm.weight", "input_layernorm.weight"),
             ("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
             ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight")]
    if cfg.mla:
        names += MLA_NAMES
    elif cfg.qk_layernorm:
        names += [("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
                  ("self_attention.k_layernorm.weight", "self_attn.k_norm.weight")]
    if sparse:
        names.append(("mlp.router.weight", "mlp.gate.weight"))
        if cfg.moe["expert_bias"]:
            names.append(("mlp.router.expert_bias", "mlp.gate.e_score_correction_bias"))
    return names + [(ours + "linear_fc2.weight", hf + "down_proj.weight") for ours, hf in _mlp_names(cfg, sparse)]


def _qkv_kinds(cfg: ModelConfig) -> tuple:
    return () if cfg.mla else ("weight", "bias") if cfg.qkv_bias else ("weight",)


def layer_to_hf(layer: dict, cfg: ModelConfig, sparse: bool = False) -> dict:
    """One megatron-core layer's tensors (suffix -> tensor) as Hugging Face suffixes; `sparse`: its
    MLP is the experts'."""
    out = {hf: layer[ours] for ours, hf in _renamed(cfg, sparse)}
    for kind in _qkv_kinds(cfg):
        q, k, v = _qkv_split(layer[f"self_attention.linear_qkv.{kind}"], cfg)
        out.update({f"self_attn.q_proj.{kind}": q, f"self_attn.k_proj.{kind}": k, f"self_attn.v_proj.{kind}": v})
    for ours, hf in _mlp_names(cfg, sparse):
        gate, up = torch.chunk(layer[ours + "linear_fc1.weight"], 2, dim=0)
        out.update({hf + "gate_proj.weight": gate.contiguous(), hf + "up_proj.weight": up.contiguous()})
    return out


def layer_from_hf(layer: dict, cfg: ModelConfig, sparse: bool = False) -> dict:
    out = {ours: layer[hf] for ours, hf in _renamed(cfg, sparse)}
    for kind in _qkv_kinds(cfg):
        out[f"self_attention.linear_qkv.{kind}"] = _qkv_fuse(*(layer[f"self_attn.{x}_proj.{kind}"] for x in "qkv"), cfg)
    for ours, hf in _mlp_names(cfg, sparse):
        out[ours + "linear_fc1.weight"] = torch.cat([layer[hf + "gate_proj.weight"], layer[hf + "up_proj.weight"]], 0)
    return out


def hf_layer_shapes(cfg: ModelConfig, sparse: bool = False) -> dict:
    H, d = cfg.hidden_size, cfg.head_dim
    if cfg.mla:
        m, heads = cfg.mla, cfg.num_attention_heads
        rotary = m["qk_rope_head_dim"]
        shapes = {"input_layernorm.weight": (H,), "self_attn.q_a_proj.weight": (m["q_lora_rank"], H),
                  "self_attn.q_a_layernorm.weight": (m["q_lora_rank"],),
                  "self_attn.q_b_proj.weight": (heads * (m["qk_nope_head_dim"] + rotary), m["q_lora_rank"]),
                  "self_attn.kv_a_proj_with_mqa.weight": (m["kv_lora_rank"] + rotary, H),
                  "self_attn.kv_a_layernorm.weight": (m["kv_lora_rank"],),
                  "self_attn.kv_b_proj.weight": (heads * (m["qk_nope_head_dim"] + m["v_head_dim"]), m["kv_lora_rank"]),
                  "self_attn.o_proj.weight": (H, heads * m["v_head_dim"])}
    else:
        q, kv = cfg.num_attention_heads * d, cfg.num_query_groups * d
        shapes = {"input_layernorm.weight": (H,), "self_attn.q_proj.weight": (q, H), "self_attn.k_proj.weight": (kv, H),
                  "self_attn.v_proj.weight": (kv, H), "self_attn.o_proj.weight": (H, q)}
        if cfg.qkv_bias:
            shapes.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                           "self_attn.v_proj.bias": (kv,)})
        if cfg.qk_layernorm:
            shapes.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
    shapes["post_attention_layernorm.weight"] = (H,)
    if sparse:
        shapes["mlp.gate.weight"] = (cfg.moe["experts"], H)
        if cfg.moe["expert_bias"]:
            shapes["mlp.gate.e_score_correction_bias"] = (cfg.moe["experts"],)
    for ours, hf in _mlp_names(cfg, sparse):
        F = (cfg.ffn_hidden_size if not sparse else cfg.moe["shared_ffn"] if "shared" in ours else cfg.moe["ffn"])
        shapes.update({hf + "gate_proj.weight": (F, H), hf + "up_proj.weight": (F, H), hf + "down_proj.weight": (H, F)})
    return shapes


def sparse_layers(cfg: ModelConfig) -> list:
    """Whether each decoder layer's MLP is the experts' (none without experts)."""
    return [bool(x) for x in cfg.moe["layers"]] if cfg.moe else [False] * cfg.num_layers


def mtp_sparse(cfg: ModelConfig) -> bool:
    """An MTP depth's inner layer is built as the last decoder layer."""
    return sparse_layers(cfg)[-1]


def mtp_prefix(layout: str, cfg: ModelConfig, depth: int) -> str:
    return f"model.mtp_layers.{depth}." if layout == "mimo" else f"model.layers.{cfg.num_layers + depth}."


def hf_shapes(cfg: ModelConfig, mtp_layout: str | None, mtp_depths: int) -> dict:
    """Every tensor name of the Hugging Face checkpoint and its shape (the loaders' names)."""
    V, H = cfg.vocab_size, cfg.hidden_size
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not cfg.tied:
        shapes["lm_head.weight"] = (V, H)
    for i, sparse in enumerate(sparse_layers(cfg)):
        shapes.update({f"model.layers.{i}.{k}": s for k, s in hf_layer_shapes(cfg, sparse).items()})
    for depth in range(mtp_depths if mtp_layout else 0):
        prefix = mtp_prefix(mtp_layout, cfg, depth)
        shapes.update({prefix + k: s for k, s in hf_layer_shapes(cfg, mtp_sparse(cfg)).items()})
        if mtp_layout == "mimo":
            shapes.update({prefix + "token_layernorm.weight": (H,), prefix + "hidden_layernorm.weight": (H,),
                           prefix + "input_proj.weight": (H, 2 * H), prefix + "final_layernorm.weight": (H,)})
        else:
            shapes.update({prefix + "enorm.weight": (H,), prefix + "hnorm.weight": (H,),
                           prefix + "eh_proj.weight": (H, 2 * H), prefix + "shared_head.norm.weight": (H,),
                           prefix + "shared_head.head.weight": (V, H), prefix + "embed_tokens.weight": (V, H)})
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


def megatron_to_hf(tensors: dict, cfg: ModelConfig, mtp_layout: str | None) -> dict:
    """megatron-core model tensors (state-dict names) -> Hugging Face tensors (MTP depths only
    with a layout)."""
    out = {"model.embed_tokens.weight": _unpad(tensors["embedding.word_embeddings.weight"], cfg)}
    for i, sparse in enumerate(sparse_layers(cfg)):
        layer = layer_to_hf(_inner(tensors, f"decoder.layers.{i}."), cfg, sparse)
        out.update({f"model.layers.{i}.{k}": v.contiguous() for k, v in layer.items()})
    out["model.norm.weight"] = tensors["decoder.final_layernorm.weight"]
    head = None if cfg.tied else _unpad(tensors["output_layer.weight"], cfg)
    if head is not None:
        out["lm_head.weight"] = head
    H = cfg.hidden_size
    for depth in range(cfg.mtp_num_layers if mtp_layout else 0):
        source = f"mtp.layers.{0 if cfg.mtp_repeated else depth}."
        prefix = mtp_prefix(mtp_layout, cfg, depth)
        inner = _inner(tensors, source + "mtp_model_layer.")
        out.update({prefix + k: v for k, v in layer_to_hf(inner, cfg, mtp_sparse(cfg)).items()})
        eh = tensors[source + "eh_proj.weight"]
        if mtp_layout == "mimo":
            out[prefix + "token_layernorm.weight"] = tensors[source + "enorm.weight"]
            out[prefix + "hidden_layernorm.weight"] = tensors[source + "hnorm.weight"]
            out[prefix + "input_proj.weight"] = torch.cat([eh[:, H:], eh[:, :H]], 1).contiguous()  # [hidden, emb]
            out[prefix + "final_layernorm.weight"] = tensors[source + "final_layernorm.weight"]
        else:
            out[prefix + "enorm.weight"] = tensors[source + "enorm.weight"]
            out[prefix + "hnorm.weight"] = tensors[source + "hnorm.weight"]
            out[prefix + "eh_proj.weight"] = eh
            out[prefix + "shared_head.norm.weight"] = tensors[source + "final_layernorm.weight"]
            out[prefix + "shared_head.head.weight"] = (head if head is not None
                                                       else out["model.embed_tokens.weight"]).clone()
            out[prefix + "embed_tokens.weight"] = out["model.embed_tokens.weight"].clone()
    return out


def detect_mtp(names, cfg: ModelConfig) -> tuple[str | None, int]:
    """The MTP layout and depth count of a Hugging Face checkpoint's names."""
    mimo = {int(m.group(1)) for n in names if (m := re.match(r"model\.mtp_layers\.(\d+)\.", n))}
    deep = {int(m.group(1)) - cfg.num_layers for n in names
            if (m := re.match(r"model\.layers\.(\d+)\.", n)) and int(m.group(1)) >= cfg.num_layers}
    if mimo and deep:
        raise ServingError("the checkpoint holds MTP depths in both MiMo's and DeepSeek-V3's layout")
    found = ("mimo", mimo) if mimo else ("deepseek_v3", deep) if deep else (None, set())
    depths = max(found[1]) + 1 if found[1] else 0
    if cfg.mtp_num_layers and depths and cfg.mtp_num_layers != depths:
        raise ServingError(f"config.json: num_nextn_predict_layers {cfg.mtp_num_layers}, but the tensors hold "
                           f"{depths} MTP depths")
    if cfg.mtp_num_layers and not depths:
        # the tensors are missing: the name check says which
        return ("deepseek_v3" if cfg.family == "deepseek_v3" else "mimo"), cfg.mtp_num_layers
    return found[0], depths


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
    trainer holds them."""
    check_hf(tensors, cfg, mtp_layout, depths)
    t = {k: v.float() for k, v in tensors.items() if not IGNORED_HF.match(k)}
    out = {"embedding.word_embeddings.weight": _pad(t["model.embed_tokens.weight"], cfg)}
    for i, sparse in enumerate(sparse_layers(cfg)):
        layer = layer_from_hf({k: t[f"model.layers.{i}.{k}"] for k in hf_layer_shapes(cfg, sparse)}, cfg, sparse)
        out.update({f"decoder.layers.{i}.{k}": v for k, v in layer.items()})
    out["decoder.final_layernorm.weight"] = t["model.norm.weight"]
    if not cfg.tied:
        out["output_layer.weight"] = _pad(t["lm_head.weight"], cfg)
    H = cfg.hidden_size
    for depth in range(depths):
        prefix = mtp_prefix(mtp_layout, cfg, depth)
        target = f"mtp.layers.{depth}."
        sparse = mtp_sparse(cfg)
        inner = layer_from_hf({k: t[prefix + k] for k in hf_layer_shapes(cfg, sparse)}, cfg, sparse)
        out.update({target + "mtp_model_layer." + k: v for k, v in inner.items()})
        if mtp_layout == "mimo":
            proj = t[prefix + "input_proj.weight"]
            out[target + "enorm.weight"] = t[prefix + "token_layernorm.weight"]
            out[target + "hnorm.weight"] = t[prefix + "hidden_layernorm.weight"]
            out[target + "eh_proj.weight"] = torch.cat([proj[:, H:], proj[:, :H]], 1)  # [emb, hidden]
            out[target + "final_layernorm.weight"] = t[prefix + "final_layernorm.weight"]
        else:
            head = t["model.embed_tokens.weight"] if cfg.tied else t["lm_head.weight"]
            for copy, original in (("shared_head.head.weight", head),
                                   ("embed_tokens.weight", t["model.embed_tokens.weight"])):
                if not torch.equal(t[prefix + copy], original):
                    raise ServingError(f"{prefix}{copy} differs from the main model's: megatron-core's MTP "
                                       "depths share the embedding and the output layer")
            out[target + "enorm.weight"] = t[prefix + "enorm.weight"]
            out[target + "hnorm.weight"] = t[prefix + "hnorm.weight"]
            out[target + "eh_proj.weight"] = t[prefix + "eh_proj.weight"]
            out[target + "final_layernorm.weight"] = t[prefix + "shared_head.norm.weight"]
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
