# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""What every family adapter has, and the defaults most families keep; a family file overrides
what its transformers class does otherwise. serving.config, serving.mapping and serving.export
call these and never name a family.

A family (the registry's key, ModelConfig.family) is one transformers class: how its config.json
reads into a ModelConfig and is written back (`read_hf`, `refuse_hf`, `hf_config`), which trained
model shape it is the export's default for (`claims`), its Hugging Face tensor names where they
differ (the shared expert's prefix, Gated DeltaNet's input projections), the MTP layout its engines
read (`mtp_layout`, an MtpLayout: MiMo's, DeepSeek-V3's and Qwen3-Next's are defined in their
families' files) and how its published checkpoints store the routed experts.
"""

from megatron_mtp.serving import ServingError


class MtpLayout:
    """How a Hugging Face checkpoint holds the MTP depths (their inner layers' tensors are the
    decoder layers' names under `prefix`; the rest is the layout's own)."""

    name: str
    # Its norms scale by 1 + w, the other layouts' by w: a model is written in its family's kind only.
    zero_centred = False
    # A depth holds copies of the embedding and the output head (`to_hf` finds them in `out`).
    copies_shared = False

    def prefix(self, cfg, depth: int) -> str:
        raise NotImplementedError

    def depths(self, names, cfg) -> set:
        """The depths (0-based) whose tensors `names` holds in this layout."""
        raise NotImplementedError

    def shapes(self, cfg, prefix: str) -> dict:
        """The layout's own tensors of a depth (beside its inner layer's) and their shapes."""
        raise NotImplementedError

    def to_hf(self, tensors: dict, source: str, prefix: str, depth: int, cfg, out: dict) -> None:
        """Writes into `out` depth `depth`'s own tensors from megatron-core's (under `source`)."""
        raise NotImplementedError

    def from_hf(self, t: dict, prefix: str, target: str, cfg) -> dict:
        """Depth's own megatron-core tensors (under `target`) from the checkpoint's `t`."""
        raise NotImplementedError

    def check(self, cfg) -> None:
        """Refuses (one line) a model this layout cannot hold."""

    def engine_warnings(self, cfg, depths: int) -> list[str]:
        """Where vLLM is known to serve `depths` (>= 1) depths in this layout otherwise than
        megatron-core trained them."""
        return []

    def first_depth_only(self, cfg, depths: int, engine: str, why: str) -> list[str]:
        """The warning for an engine that runs the first depth's layer at every draft step (`why`: how
        that is known), where distinct depths were trained."""
        if cfg.mtp_repeated or depths < 2:
            return []
        return [f"{engine} run {self.prefix(cfg, 0).rstrip('.')} at every draft step ({why}), so the {depths - 1} "
                "deeper trained depths are loaded and never run there; train one --mtp-use-repeated-layer for "
                "what vLLM runs"]


class Family:
    name: str  # the registry's key
    title: str  # the family's name in messages (GLM-4.5)
    architecture: str  # transformers' class, config.json's architectures
    model_type: str | None = None  # config.json's model_type, when not the name
    vlm_wrapper: str | None = None  # the published VLM class whose language model this class is
    same_shape_as: str | None = None  # a family of the same trained model (what --architecture may exchange)
    mtp_layout: str  # the MtpLayout its engines read the MTP depths in (the export's default)
    own_mtp_layout: MtpLayout | None = None  # the layout the family defines (the registry collects them)
    # vLLM's model that drafts with the family's MTP depths (its registry, vLLM 0.32.0); None: no engine
    # does, its loader refuses them, and the export leaves them out unless --mtp-layout names a layout
    drafter: str | None = None
    qkv_bias = False  # what config.json implies where it does not say (read_hf may read it)
    qk_norm = False  # an RMSNorm of each head's query and key (megatron-core's --qk-layernorm)
    experts = False
    gated_delta_net = False
    accepts_biases = False  # attention_bias / mlp_bias are read or ignored, not refused
    refuses_sliding_window = True
    yarn = False  # reads YaRN rope_scaling (multi-latent attention's)
    partial_rotary = False
    default_rotary_percent = 1.0
    attention_output_gate = False
    zero_centred_norms = False  # (1 + w) RMSNorms (megatron-core's --apply-layernorm-1p)
    dense_ffn_key = "intermediate_size"  # the config.json key of megatron-core's --ffn-hidden-size
    hf_shared_expert = "mlp.shared_experts."  # Hugging Face's prefix of the shared expert
    published_experts: tuple | None = None  # (decoder layers, MTP depths): per_expert or stacked

    @property
    def hf_model_type(self) -> str:
        return self.model_type or self.name

    def claims(self, cfg) -> bool:
        """Whether this family is the export's default for a trained model of `cfg`'s shape: exactly
        one family claims each shape a trainer checkpoint can have (the registry asks none with
        same_shape_as: those are written when imported from or asked for)."""
        return False

    # ------------------------------------------------------------------ config.json -> ModelConfig

    def read_hf(self, config: dict, values: dict) -> None:
        """What the family reads beyond the common keys, into `values` (ModelConfig's fields); a
        missing key raises KeyError (the caller's one line)."""

    def refuse_hf(self, config: dict) -> None:
        """What the family's config.json can say that megatron-core's model does not compute."""
        if not self.accepts_biases and (config.get("attention_bias") or config.get("mlp_bias")):
            raise ServingError(self.bias_refusal())
        self.refuse_attention_hf(config)
        if self.refuses_sliding_window and config.get("use_sliding_window"):
            raise ServingError(f"config.json: {self.architecture} sliding-window attention is not supported")

    def bias_refusal(self) -> str:
        return f"config.json: {self.architecture} attention_bias is not supported"

    def refuse_attention_hf(self, config: dict) -> None:
        """The family's own attention refusals."""

    # ------------------------------------------------------------------ ModelConfig -> config.json

    def hf_config(self, cfg, dtype: str, mtp_layout: str | None) -> dict:
        config = {
            "architectures": [self.architecture], "model_type": self.hf_model_type,
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.ffn_hidden_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_query_groups,
            "head_dim": cfg.head_dim, "hidden_act": "silu", "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.norm_epsilon, "rope_theta": cfg.rope_theta,
            "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
            "tie_word_embeddings": cfg.tied, "attention_dropout": cfg.attention_dropout, "initializer_range": 0.02,
            "use_cache": True, "torch_dtype": hf_dtype(dtype),
        }
        config.update(self.hf_layers(cfg))
        self.hf_experts(cfg, config)
        config.update(cfg.extra)
        if mtp_layout and cfg.mtp_num_layers:
            config.update(self.hf_mtp(cfg))
        return config

    def hf_layers(self, cfg) -> dict:
        """The family's own keys of its layers (after the common ones)."""
        return {}

    def hf_experts(self, cfg, config: dict) -> None:
        """The experts' keys, into `config`."""

    def hf_mtp(self, cfg) -> dict:
        """The keys that say how many MTP depths the checkpoint holds."""
        return {"num_nextn_predict_layers": cfg.mtp_num_layers}

    def check_export(self, cfg) -> None:
        """What the family's transformers class cannot hold, though the shape is its."""

    def check_mtp_layout(self, layout: str | None) -> None:
        """Refuses (one line) an MTP layout the family's engines would not read."""


def hf_dtype(dtype: str) -> str:
    return {"fp32": "float32", "bf16": "bfloat16"}[dtype]
