# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""ModelConfig's Megatron side: a trainer checkpoint's arguments read into a ModelConfig (refused in
one line unless the model has the trained shape of a family), and a ModelConfig written as the
arguments megatron.training names (what an imported checkpoint holds) and as pretrain_gpt_mtp.py's
model flags (what fine-tunes the import). The Hugging Face side is serving.config's.
"""

import argparse

from megatron_mtp.serving import ServingError, families
from megatron_mtp.serving.config import LLAMA3_CONSTANTS, MLA_YARN_CONSTANTS, ModelConfig, titles
from megatron_mtp.serving.patterns import full_attention_interval, interval_pattern


def hybrid_refusal(pattern: str, what: str) -> str:
    """The one line for a HybridModel checkpoint where only GPTModel ones are read."""
    return (f"the checkpoint's model is a HybridModel (--hybrid-layer-pattern {pattern}), which {what}: it reads "
            "GPTModel checkpoints. Qwen3-Next's and Qwen3.5's layers train as a GPTModel with "
            "--experimental-attention-variant gated_delta_net --linear-attention-freq N --qk-layernorm in place of "
            "the pattern (docs/architectures.md)")


def model_config(args) -> ModelConfig:
    """A trainer checkpoint's arguments; refused (one line) unless the model has the trained
    shape of a family (families.FAMILIES, those not `same_shape_as` another)."""
    def get(name, default=None):
        return getattr(args, name, default)

    pattern = get("hybrid_layer_pattern")
    if pattern:  # its layers' differences from a family would be beside the point
        raise ServingError(hybrid_refusal(pattern, "export does not read"))
    problems = []
    if get("normalization") != "RMSNorm":
        problems.append(f"--normalization {get('normalization')} (needs RMSNorm)")
    if not get("swiglu"):
        problems.append("no --swiglu (needs SwiGLU)")
    if get("add_bias_linear", True):
        problems.append("linear biases (needs --disable-bias-linear)")
    gdn = _gdn_from_args(get, problems)
    sigmoid_routed = bool(get("num_experts")) and get("moe_router_score_function") == "sigmoid"
    partial = get("rotary_percent", 1.0) != 1.0 and (sigmoid_routed or gdn) and not get("multi_latent_attention")
    if get("position_embedding_type") != "rope" or (get("rotary_percent", 1.0) != 1.0 and not partial) or \
            get("rotary_interleaved"):
        problems.append("positions other than full, non-interleaved RoPE (partial: "
                        f"{titles(lambda f: f.partial_rotary and not f.same_shape_as, 's')})")
    if get("qk_layernorm") and get("add_qkv_bias") and not sigmoid_routed:
        problems.append("--qk-layernorm with --add-qkv-bias (Qwen3 has q/k norms, Qwen2 QKV biases; both: "
                        "GLM-4.5, with its experts)")
    # (1 + w) norms and gated attention are Qwen3-Next's, beside its Gated DeltaNet layers
    for field_name in ("qk_l2_norm", "apply_layernorm_1p", "squared_relu",
                       *(() if gdn else ("layernorm_zero_centered_gamma", "attention_output_gate"))):
        if get(field_name):  # (0.19.2's --apply-layernorm-1p sets layernorm_zero_centered_gamma)
            problems.append({"layernorm_zero_centered_gamma": "--apply-layernorm-1p"}.get(
                field_name, f"--{field_name.replace('_', '-')}"))
    mla = _mla_from_args(get, problems)
    moe = _moe_from_args(get, problems, mla is not None, gdn is not None)
    if problems:
        raise ServingError(f"the checkpoint's model is not {titles(lambda f: not f.same_shape_as, '-')}shaped, "
                           "it has " + ", ".join(problems))
    heads = get("num_attention_heads")
    groups = get("num_query_groups") if get("group_query_attention") else heads
    scaling = None
    if mla is not None and _mla_rope_type(get) == "yarn":
        scaling = dict(rope_type="yarn", factor=float(get("rotary_scaling_factor")), mscale=float(get("mscale")),
                       mscale_all_dim=float(get("mscale_all_dim")), **MLA_YARN_CONSTANTS)
    elif get("use_rope_scaling"):
        scaling = dict(rope_type="llama3", factor=float(get("rope_scaling_factor")), **LLAMA3_CONSTANTS)
    elif get("rotary_seq_len_interpolation_factor"):
        scaling = dict(rope_type="linear", factor=float(get("rotary_seq_len_interpolation_factor")))
    serving = dict(get("serving_extra") or {})
    vocab_size = int(get("vocab_size") or get("padded_vocab_size"))
    if get("tokenizer_type") == "NullTokenizer" and get("null_tokenizer_eod_id") is not None:
        eod = int(get("null_tokenizer_eod_id"))
        serving = serving or {"eos_token_id": eod}
        # the end-of-document id may lie past --vocab-size's ids (Megatron-LM's NullTokenizer convention
        # eod = vocab_size): its row is the tokenizer's too
        vocab_size = max(vocab_size, min(eod + 1, int(get("padded_vocab_size"))))
    config = ModelConfig(
        family=None, vocab_size=vocab_size,
        padded_vocab_size=int(get("padded_vocab_size")), hidden_size=int(get("hidden_size")),
        ffn_hidden_size=int(get("ffn_hidden_size")), num_layers=int(get("num_layers")),
        num_attention_heads=int(heads), num_query_groups=int(groups),
        head_dim=int(mla["qk_nope_head_dim"] if mla else get("kv_channels") or get("hidden_size") // heads),
        norm_epsilon=_norm_epsilon(get),
        rope_theta=float(get("rotary_base", 10000)), max_position_embeddings=int(get("max_position_embeddings")),
        tied=not get("untie_embeddings_and_output_weights"), qkv_bias=bool(get("add_qkv_bias")),
        qk_layernorm=bool(get("qk_layernorm")), rotary_percent=float(get("rotary_percent", 1.0)),
        rope_scaling=scaling, mtp_num_layers=int(get("mtp_num_layers") or 0),
        mtp_repeated=bool(get("mtp_use_repeated_layer")), extra=serving,
        attention_dropout=float(get("attention_dropout") or 0.0), moe=moe, mla=mla, gdn=gdn,
    )
    # the family whose shape it is, or the one an import recorded (e.g. imported from MiMo: exported as MiMo)
    config.family = families.home(config, get("serving_family"))
    return config


def arguments(cfg: ModelConfig) -> argparse.Namespace:
    """The model's arguments as megatron.training names them (what an imported checkpoint holds)."""
    scaling = cfg.rope_scaling or {}
    return argparse.Namespace(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads, group_query_attention=not cfg.mla,
        num_query_groups=cfg.num_query_groups,
        # MLA's head sizes are its own flags; the trainer leaves kv_channels at hidden / heads there
        kv_channels=cfg.hidden_size // cfg.num_attention_heads if cfg.mla else cfg.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_epsilon, swiglu=True, add_bias_linear=False, add_qkv_bias=cfg.qkv_bias,
        qk_layernorm=cfg.qk_layernorm,
        position_embedding_type="rope", rotary_base=cfg.rope_theta, rotary_percent=cfg.rotary_percent,
        rotary_interleaved=False, use_rope_scaling=scaling.get("rope_type") == "llama3",
        rope_scaling_factor=float(scaling.get("factor", 8.0)),
        rotary_seq_len_interpolation_factor=(scaling["factor"] if scaling.get("rope_type") == "linear" else None),
        max_position_embeddings=cfg.max_position_embeddings,
        untie_embeddings_and_output_weights=not cfg.tied, vocab_size=cfg.vocab_size,
        padded_vocab_size=cfg.padded_vocab_size, mtp_num_layers=cfg.mtp_num_layers or None,
        mtp_use_repeated_layer=cfg.mtp_repeated, attention_dropout=cfg.attention_dropout, hidden_dropout=0.0,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1, world_size=1, data_parallel_size=1, serving_extra=dict(cfg.extra),
        serving_family=cfg.family,
        layernorm_zero_centered_gamma=cfg.layernorm_zero_centered_gamma,
        attention_output_gate=cfg.attention_output_gate, **_moe_mla_args(cfg), **_gdn_args(cfg),
    )


def _gdn_args(cfg: ModelConfig) -> dict:
    """Gated DeltaNet's arguments, as megatron.training names them."""
    if not cfg.gdn:
        return {"experimental_attention_variant": None}
    return {"experimental_attention_variant": "gated_delta_net",
            "linear_attention_freq": full_attention_interval(cfg.gdn["layers"]) or list(cfg.gdn["layers"]),
            **{k: v for k, v in cfg.gdn.items() if k != "layers"}}


def _moe_mla_args(cfg: ModelConfig) -> dict:
    """The experts' and multi-latent attention's arguments, as megatron.training names them."""
    args = {"num_experts": None, "multi_latent_attention": bool(cfg.mla)}
    if cfg.moe:
        moe = cfg.moe
        args.update(num_experts=moe["experts"], moe_router_topk=moe["topk"], moe_ffn_hidden_size=moe["ffn"],
                    moe_shared_expert_intermediate_size=moe["shared_ffn"] or None,
                    moe_layer_freq=list(moe["layers"]), moe_router_score_function=moe["score"],
                    moe_router_pre_softmax=moe["score"] == "softmax" and not moe["normalize"],
                    moe_shared_expert_gate=moe["shared_gate"],
                    moe_router_enable_expert_bias=moe["expert_bias"], moe_router_num_groups=moe["groups"],
                    moe_router_group_topk=moe["group_topk"], moe_router_topk_scaling_factor=moe["scaling"],
                    moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
    if cfg.mla:
        scaling = cfg.rope_scaling or {}
        args.update(q_lora_rank=cfg.mla["q_lora_rank"], kv_lora_rank=cfg.mla["kv_lora_rank"],
                    qk_head_dim=cfg.mla["qk_nope_head_dim"], qk_pos_emb_head_dim=cfg.mla["qk_rope_head_dim"],
                    v_head_dim=cfg.mla["v_head_dim"], rope_type="yarn" if scaling else "rope",
                    rotary_scaling_factor=float(scaling.get("factor", 1.0)),
                    mscale=float(scaling.get("mscale", 1.0)),
                    mscale_all_dim=float(scaling.get("mscale_all_dim", 0.0)))
    return args


def trainer_flags(cfg: ModelConfig, pad_to: int) -> list[str]:
    """The pretrain_gpt_mtp.py model flags that build exactly this model (its dropout too: Megatron's
    default of 0.1 would fine-tune another model than the one imported). `pad_to` is the
    --make-vocab-size-divisible-by that pads the vocabulary to `padded_vocab_size` at the
    tensor-parallel size the import was made for."""
    flags = ["--num-layers", cfg.num_layers, "--hidden-size", cfg.hidden_size,
             "--ffn-hidden-size", cfg.ffn_hidden_size, "--num-attention-heads", cfg.num_attention_heads,
             *([] if cfg.mla else ["--group-query-attention", "--num-query-groups", cfg.num_query_groups,
                                   "--kv-channels", cfg.head_dim]),
             "--normalization", "RMSNorm", "--norm-epsilon", cfg.norm_epsilon,
             "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
             "--rotary-base", _number(cfg.rope_theta), "--max-position-embeddings", cfg.max_position_embeddings,
             "--make-vocab-size-divisible-by", pad_to, "--attention-dropout", _number(cfg.attention_dropout),
             "--hidden-dropout", "0"]
    if cfg.qkv_bias:
        flags.append("--add-qkv-bias")
    if cfg.qk_layernorm:
        flags.append("--qk-layernorm")
    if cfg.attention_output_gate:
        flags.append("--attention-output-gate")
    if cfg.layernorm_zero_centered_gamma:
        flags.append("--apply-layernorm-1p")
    if cfg.gdn:
        args = _gdn_args(cfg)
        pattern = args.pop("linear_attention_freq")
        flags += ["--experimental-attention-variant", args.pop("experimental_attention_variant"),
                  "--linear-attention-freq", pattern if isinstance(pattern, int) else _pattern(pattern)]
        for name, value in args.items():
            flags += ["--" + name.replace("_", "-"), value]
    if cfg.rotary_percent != 1.0:
        flags += ["--rotary-percent", _number(cfg.rotary_percent)]
    if not cfg.tied:
        flags.append("--untie-embeddings-and-output-weights")
    if cfg.mla:
        pass  # YaRN is MLA's (its flags below)
    elif cfg.rope_scaling and cfg.rope_scaling["rope_type"] == "llama3":
        flags += ["--use-rope-scaling", "--rope-scaling-factor", _number(cfg.rope_scaling["factor"])]
    elif cfg.rope_scaling:
        flags += ["--rotary-seq-len-interpolation-factor", _number(cfg.rope_scaling["factor"])]
    flags += _moe_mla_flags(cfg)
    if cfg.mtp_num_layers:
        flags += ["--mtp-num-layers", cfg.mtp_num_layers]
        if cfg.mtp_repeated:
            flags.append("--mtp-use-repeated-layer")
    return [str(f) for f in flags]


def _moe_mla_flags(cfg: ModelConfig) -> list:
    flags = []
    if cfg.mla:
        mla, scaling = cfg.mla, cfg.rope_scaling
        flags += ["--multi-latent-attention", "--q-lora-rank", mla["q_lora_rank"], "--kv-lora-rank",
                  mla["kv_lora_rank"], "--qk-head-dim", mla["qk_nope_head_dim"], "--qk-pos-emb-head-dim",
                  mla["qk_rope_head_dim"], "--v-head-dim", mla["v_head_dim"]]
        flags += (["--rope-type", "yarn", "--rotary-scaling-factor", _number(scaling["factor"]), "--mscale",
                   _number(scaling["mscale"]), "--mscale-all-dim", _number(scaling["mscale_all_dim"])]
                  if scaling else ["--rope-type", "rope"])
    if cfg.moe:
        moe = cfg.moe
        flags += ["--num-experts", moe["experts"], "--moe-router-topk", moe["topk"], "--moe-ffn-hidden-size",
                  moe["ffn"], "--moe-layer-freq", _pattern(moe["layers"]),
                  "--moe-router-score-function", moe["score"], "--moe-router-load-balancing-type", "none"]
        if moe["score"] == "softmax" and not moe["normalize"]:
            flags.append("--moe-router-pre-softmax")
        if moe["shared_ffn"]:
            flags += ["--moe-shared-expert-intermediate-size", moe["shared_ffn"]]
        if moe["shared_gate"]:
            flags.append("--moe-shared-expert-gate")
        if moe["expert_bias"]:
            flags.append("--moe-router-enable-expert-bias")
        if moe["groups"]:
            flags += ["--moe-router-num-groups", moe["groups"], "--moe-router-group-topk", moe["group_topk"]]
        if moe["scaling"] not in (None, 1.0):
            flags += ["--moe-router-topk-scaling-factor", _number(moe["scaling"])]
    return flags


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _pattern(layers: list) -> str:
    """A per-layer 0/1 list as Megatron-LM's --moe-layer-freq / --linear-attention-freq read it."""
    return "[" + ",".join(str(x) for x in layers) + "]"


def _norm_epsilon(get) -> float:
    """The norms' epsilon of a trainer checkpoint's arguments: --norm-epsilon's destination."""
    return float(get("layernorm_epsilon", get("norm_epsilon", 1e-5)))


def _mla_rope_type(get) -> str:
    """Multi-latent attention's rotary kind: without --rope-type (None) megatron-core's MLA config
    keeps its own default, YaRN."""
    return get("rope_type") or "yarn"


def _mla_from_args(get, problems: list) -> dict | None:
    """Multi-latent attention of a trainer checkpoint's arguments (DeepSeek-V3's), or None."""
    if not get("multi_latent_attention"):
        return None
    if not get("q_lora_rank"):
        problems.append("multi-latent attention without --q-lora-rank (DeepSeek-V3 has q_a_proj)")
    if not get("qk_layernorm"):
        problems.append("multi-latent attention without --qk-layernorm (DeepSeek-V3 has q_a_layernorm, "
                        "kv_a_layernorm)")
    if _norm_epsilon(get) != 1e-6:  # transformers builds q_a_layernorm and kv_a_layernorm with 1e-6
        problems.append(f"multi-latent attention with --norm-epsilon {_norm_epsilon(get)} (DeepSeek-V3's "
                        "q_a_layernorm and kv_a_layernorm normalize with 1e-6 in transformers)")
    if _mla_rope_type(get) not in ("rope", "yarn"):
        problems.append(f"--rope-type {get('rope_type')}")
    return {"q_lora_rank": get("q_lora_rank"), "kv_lora_rank": get("kv_lora_rank"),
            "qk_nope_head_dim": get("qk_head_dim"), "qk_rope_head_dim": get("qk_pos_emb_head_dim"),
            "v_head_dim": get("v_head_dim")}


def _moe_from_args(get, problems: list, mla: bool, gdn: bool) -> dict | None:
    """The experts of a trainer checkpoint's arguments, or None; refused where no Hugging Face
    family (Qwen3-MoE with q/k norms, DeepSeek-V3 with multi-latent attention, Qwen3-Next with
    Gated DeltaNet) routes the same."""
    experts = get("num_experts")
    if not experts:
        if mla:
            problems.append("multi-latent attention without experts (DeepSeek-V3 is MoE)")
        return None
    layers, topk = get("moe_layer_freq", 1), int(get("moe_router_topk"))
    layers = (list(layers) if isinstance(layers, (list, tuple))
              else [int(i % layers == 0) for i in range(int(get("num_layers")))])
    score, groups = get("moe_router_score_function", "softmax"), get("moe_router_num_groups")
    moe = dict(experts=int(experts), topk=topk, ffn=int(get("moe_ffn_hidden_size") or get("ffn_hidden_size")),
               shared_ffn=int(get("moe_shared_expert_intermediate_size") or 0), layers=layers, score=score,
               normalize=score == "sigmoid" or not get("moe_router_pre_softmax"),
               expert_bias=bool(get("moe_router_enable_expert_bias")), groups=groups,
               group_topk=get("moe_router_group_topk"), scaling=get("moe_router_topk_scaling_factor"),
               shared_gate=bool(get("moe_shared_expert_gate")))
    for flag in ("moe_expert_capacity_factor", "moe_latent_size"):
        if get(flag):
            problems.append(f"--{flag.replace('_', '-')}")
    if gdn:
        if score != "softmax" or moe["expert_bias"] or groups or moe["scaling"] not in (None, 1.0):
            problems.append("experts routed otherwise than Qwen3-Next's (softmax scores, no expert bias, groups or "
                            "scaling factor)")
        if not moe["shared_ffn"] or not moe["shared_gate"]:
            problems.append("Gated DeltaNet with experts but without a shared expert and --moe-shared-expert-gate "
                            "(Qwen3-Next and Qwen3.5-MoE have both)")
        return moe
    if moe["shared_gate"]:
        problems.append("--moe-shared-expert-gate without Gated DeltaNet (Qwen3-Next's)")
    if not mla and score == "softmax":
        if not get("qk_layernorm"):
            problems.append("experts without --qk-layernorm (Qwen3-MoE has q/k norms)")
        if moe["expert_bias"] or groups or moe["shared_ffn"] or moe["scaling"] not in (None, 1.0):
            problems.append("experts routed otherwise than Qwen3-MoE's (softmax scores, no expert bias, groups, "
                            "shared expert or scaling factor)")
        return moe
    dense = layers.index(1) if 1 in layers else len(layers)
    if layers != [0] * dense + [1] * (len(layers) - dense):
        problems.append(f"--moe-layer-freq {layers} (DeepSeek-V3's and GLM-4.5's MoE layers follow their first "
                        "dense ones)")
    if score != "sigmoid" or not moe["expert_bias"]:
        problems.append("experts routed otherwise than DeepSeek-V3's and GLM-4.5's (sigmoid scores with an expert "
                        "bias)")
    if not moe["shared_ffn"] or moe["shared_ffn"] % moe["ffn"]:
        problems.append("a shared expert size that is not a multiple of --moe-ffn-hidden-size (their "
                        "n_shared_experts)")
    if groups and topk // moe["group_topk"] != 2:
        problems.append("--moe-router-topk // --moe-router-group-topk != 2 (transformers scores a group by its top 2 "
                        "experts)")
    return moe


def _gdn_from_args(get, problems: list) -> dict | None:
    """The Gated DeltaNet layers of a trainer checkpoint's arguments (Qwen3-Next's), or None."""
    variant = get("experimental_attention_variant")
    if not variant:
        return None
    if variant != "gated_delta_net":
        problems.append(f"--experimental-attention-variant {variant}")
        return None
    for name, flag, what in (("attention_output_gate", "--attention-output-gate", "gated attention"),
                             ("layernorm_zero_centered_gamma", "--apply-layernorm-1p", "(1 + w) norms"),
                             ("qk_layernorm", "--qk-layernorm", "q/k norms")):
        if not get(name):
            problems.append(f"Gated DeltaNet without {flag} (Qwen3-Next has {what})")
    frequency, num_layers = get("linear_attention_freq"), int(get("num_layers"))
    if frequency is None:
        problems.append("Gated DeltaNet without --linear-attention-freq")
        return None
    layers = (list(frequency) if isinstance(frequency, (list, tuple))
              else interval_pattern(int(frequency), num_layers))
    return {"layers": layers, **{name: int(get(name)) for name in (
        "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
        "linear_num_value_heads")}}
