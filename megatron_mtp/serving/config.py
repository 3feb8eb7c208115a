# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The model both sides describe: a decoder of one of the Hugging Face families (GQA or multi-latent
attention, Gated DeltaNet layers among full-attention ones, RMSNorm, SwiGLU MLPs or routed experts,
RoPE) with D MTP depths, read from a Hugging Face config.json (through its family's adapter,
serving.families) or from a trainer checkpoint's arguments, and written back to either (config.json,
the trainer's flags, the arguments a checkpoint holds). The Hugging Face side is here; the Megatron
side (the trainer's arguments and flags) is serving.trainer_args.
"""

import argparse
import dataclasses
import math
from dataclasses import dataclass, field

from megatron_mtp.serving import ServingError, families

# megatron-core's MLA takes YaRN's original context and correction range from MLATransformerConfig's
# defaults, which the trainer's flags do not set (DeepSeek-V3's own values).
MLA_YARN_CONSTANTS = {"original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0}
# megatron-core's Llama 3 RoPE scaling has these constants built in (rotary_pos_embedding._apply_scaling).
LLAMA3_CONSTANTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def titles(which, suffix: str) -> str:
    """The registered families `which` accepts, for a message: "Llama-, Qwen2- or Qwen3-" (suffix
    "-"), "GLM-4.5's and Qwen3-Next's" (suffix "s": possessive)."""
    names = [f"{family.title}'s" if suffix == "s" else f"{family.title}{suffix}"
             for family in families.FAMILIES.values() if which(family)]
    joiner = " and " if suffix == "s" else " or "
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + joiner + names[-1]


@dataclass
class ModelConfig:
    family: str  # a key of serving.families.FAMILIES (its adapter: `adapter`)
    vocab_size: int  # the tokenizer's vocabulary (Hugging Face's vocab_size)
    padded_vocab_size: int  # rows of megatron-core's embedding and output layer
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    norm_epsilon: float
    rope_theta: float
    max_position_embeddings: int
    tied: bool
    qkv_bias: bool
    rope_scaling: dict | None = None  # {"rope_type": "llama3" | "linear" | "yarn", "factor": F, ...}
    qk_layernorm: bool = False
    rotary_percent: float = 1.0  # the leading fraction of each head's dims that RoPE rotates (GLM-4.5: 0.5)
    mtp_num_layers: int = 0
    mtp_repeated: bool = False
    attention_dropout: float = 0.0  # Llama's and Qwen2's; neither has hidden dropout
    # Mixture of experts: {"experts", "topk", "ffn" (per expert), "shared_ffn" (0: none), "layers" (1 for
    # each MoE decoder layer, 0 for a dense one), "score" ("softmax" | "sigmoid"), "normalize" (the
    # top-k probabilities sum to 1), "expert_bias", "groups", "group_topk", "scaling", "shared_gate" (the
    # shared expert's output scaled by a sigmoid of its own linear gate)}.
    moe: dict | None = None
    # Multi-latent attention: {"q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
    # "v_head_dim"} (DeepSeek-V3's names).
    mla: dict | None = None
    # Gated DeltaNet: {"layers" (1 for each Gated DeltaNet layer, 0 for a full-attention one: megatron-core's
    # linear attention pattern), "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
    # "linear_num_key_heads", "linear_num_value_heads"} (megatron-core's names).
    gdn: dict | None = None
    extra: dict = field(default_factory=dict)  # bos/eos ids etc., carried through

    @property
    def adapter(self) -> families.Family:
        return families.get(self.family)

    @property
    def attention_output_gate(self) -> bool:
        return self.adapter.attention_output_gate

    @property
    def layernorm_zero_centered_gamma(self) -> bool:
        return self.adapter.zero_centred_norms

    # ------------------------------------------------------------------ Hugging Face

    @classmethod
    def from_hf(cls, config: dict, pad_to: int = 128) -> "ModelConfig":
        architectures = config.get("architectures") or []
        known = [a for a in architectures if a in families.BY_ARCHITECTURE]
        if not known:
            raise ServingError(f"unknown architecture {architectures or config.get('model_type')!r}: "
                               f"import reads {' or '.join(families.BY_ARCHITECTURE)}")
        family = families.BY_ARCHITECTURE[known[0]]
        try:
            hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            vocab = int(config["vocab_size"])
            values = dict(
                family=family.name, vocab_size=vocab, padded_vocab_size=math.ceil(vocab / pad_to) * pad_to,
                hidden_size=hidden, ffn_hidden_size=int(config[family.dense_ffn_key]),
                num_layers=int(config["num_hidden_layers"]), num_attention_heads=heads,
                num_query_groups=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                norm_epsilon=float(config.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
                tied=bool(config.get("tie_word_embeddings", False)),
                qkv_bias=family.qkv_bias, qk_layernorm=family.qk_norm,
            )
            family.read_hf(config, values)  # experts, multi-latent attention, Gated DeltaNet, ...
        except (KeyError, TypeError) as missing:
            name = missing.args[0] if isinstance(missing, KeyError) else "a number where it has null"
            raise ServingError(f"config.json has no {name!r}") from None
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ServingError(f"config.json: hidden_act {act!r} is not supported (SwiGLU needs 'silu')")
        family.refuse_hf(config)
        if heads % values["num_query_groups"]:
            raise ServingError(f"config.json: num_attention_heads {heads} is not a multiple of "
                               f"num_key_value_heads {values['num_query_groups']}")
        # transformers 5 writes rope_parameters; 4.x (and most published checkpoints) rope_theta / rope_scaling
        parameters = config.get("rope_parameters") or {}
        theta = parameters.get("rope_theta", config.get("rope_theta", 10000.0))
        scaling = config.get("rope_scaling")
        if parameters.get("rope_type", "default") != "default":
            scaling = parameters
        values["rope_theta"] = float(theta)
        values["rope_scaling"] = _rope_scaling(scaling, yarn=family.yarn)
        # (Qwen3.5's multimodal rotary, mrope_section, gives every section the same position for text)
        values["rotary_percent"] = float(parameters.get("partial_rotary_factor",
                                                        config.get("partial_rotary_factor",
                                                                   family.default_rotary_percent)))
        if values["rotary_percent"] != 1.0 and not family.partial_rotary:
            raise ServingError(f"config.json: partial_rotary_factor {values['rotary_percent']} (only "
                               f"{titles(lambda f: f.partial_rotary, 's')} rotary is partial here)")
        # Qwen3-Next's own key is mtp_num_hidden_layers (Megatron-Bridge reads it too); vLLM's num_nextn_predict_layers
        values["mtp_num_layers"] = int(config.get("num_nextn_predict_layers") or config.get("mtp_num_hidden_layers")
                                       or 0)
        values["extra"] = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
        values["attention_dropout"] = float(config.get("attention_dropout") or 0.0)
        return cls(**values)

    def to_hf(self, dtype: str, mtp_layout: str | None) -> dict:
        self.adapter.check_export(self)  # (after --architecture: the family the export writes)
        return self.adapter.hf_config(self, dtype, mtp_layout)
    def as_architecture(self, name: str) -> "ModelConfig":
        """The model as `name` instead of the family its shape (or its import) names, for an export: a
        dense family of the same attention, or a family of the same shape stored otherwise."""
        target = families.get(name)
        if self.moe or self.gdn or target.experts or target.gated_delta_net:
            shape = self.adapter.same_shape_as or self.family
            if name not in (shape, *families.same_shape(shape)):
                raise ServingError(f"--architecture {name}: the model is {self.adapter.architecture}-shaped")
            return dataclasses.replace(self, family=name)
        if target.qk_norm != self.qk_layernorm:
            raise ServingError(f"--architecture {name}: {target.architecture} "
                               f"{'has' if target.qk_norm else 'has no'} q/k norms, the model "
                               f"{'has' if self.qk_layernorm else 'has none'}")
        if target.qkv_bias != self.qkv_bias:
            raise ServingError(f"--architecture {name}: {target.architecture} "
                               f"{'has' if target.qkv_bias else 'has no'} QKV biases, the model "
                               f"{'has' if self.qkv_bias else 'has none'}")
        return dataclasses.replace(self, family=name)

    # ------------------------------------------------------------------ Megatron (serving.trainer_args)

    @classmethod
    def from_megatron_args(cls, args) -> "ModelConfig":
        """A trainer checkpoint's arguments (trainer_args.model_config)."""
        from megatron_mtp.serving import trainer_args

        return trainer_args.model_config(args)

    def megatron_args(self) -> argparse.Namespace:
        """The model's arguments as megatron.training names them (trainer_args.arguments)."""
        from megatron_mtp.serving import trainer_args

        return trainer_args.arguments(self)

    def trainer_flags(self, pad_to: int) -> list[str]:
        """The pretrain_gpt_mtp.py model flags that build exactly this model (trainer_args.trainer_flags)."""
        from megatron_mtp.serving import trainer_args

        return trainer_args.trainer_flags(self, pad_to)


def _rope_scaling(scaling: dict | None, yarn: bool = False) -> dict | None:
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind == "yarn" and yarn:
        return _mla_yarn(scaling)
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(scaling["factor"])}
    if kind == "llama3":
        differing = {k: scaling.get(k) for k, v in LLAMA3_CONSTANTS.items() if float(scaling.get(k, -1)) != v}
        if differing:
            raise ServingError(f"config.json: llama3 rope_scaling with {differing} (megatron-core's Llama 3 "
                               f"scaling has {LLAMA3_CONSTANTS} built in)")
        return {"rope_type": "llama3", "factor": float(scaling["factor"]), **LLAMA3_CONSTANTS}
    raise ServingError(f"config.json: rope_scaling type {kind!r} is not supported (default, linear or llama3"
                       f"{', yarn' if yarn else ''})")


def _mla_yarn(scaling: dict) -> dict:
    """DeepSeek-V3's YaRN as megatron-core's MLA computes it (refused where the two differ)."""
    values = {"original_max_position_embeddings": float(scaling.get("original_max_position_embeddings", 4096)),
              "beta_fast": float(scaling.get("beta_fast") or 32), "beta_slow": float(scaling.get("beta_slow") or 1)}
    differing = {k: v for k, v in values.items() if v != MLA_YARN_CONSTANTS[k]}
    if differing:
        raise ServingError(f"config.json: yarn rope_scaling with {differing} (megatron-core's MLA has "
                           f"{MLA_YARN_CONSTANTS} built in)")
    if scaling.get("truncate", True) is not True:
        raise ServingError("config.json: yarn rope_scaling with truncate false (megatron-core rounds YaRN's "
                           "correction range to integers)")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if not mscale_all_dim and mscale not in (None, 1, 1.0):
        # transformers then scales by YaRN's default attention factor and ignores mscale
        raise ServingError(f"config.json: yarn rope_scaling with mscale {mscale} and no mscale_all_dim")
    return {"rope_type": "yarn", "factor": float(scaling["factor"]), "mscale": float(mscale or 1.0),
            "mscale_all_dim": float(mscale_all_dim or 0.0), **MLA_YARN_CONSTANTS}
