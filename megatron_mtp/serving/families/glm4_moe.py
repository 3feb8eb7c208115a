# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""GLM-4.5 (Glm4MoeForCausalLM): GQA with QKV biases (attention_bias), optional q/k norms
(use_qk_norm) and partial rotary, DeepSeek-V3's experts and config.json form; its MTP depths in
DeepSeek-V3's layout."""

from megatron_mtp.serving.families.deepseek_v3 import SigmoidRouted


class Glm4Moe(SigmoidRouted):
    name = "glm4_moe"
    architecture = "Glm4MoeForCausalLM"
    title = "GLM-4.5"
    drafter = "Glm4MoeMTP"
    accepts_biases = True
    partial_rotary = True

    def claims(self, cfg) -> bool:
        return bool(cfg.moe) and not cfg.mla and cfg.moe["score"] == "sigmoid"

    def read_hf(self, config: dict, values: dict) -> None:
        super().read_hf(config, values)
        values.update(qkv_bias=bool(config.get("attention_bias")), qk_layernorm=bool(config.get("use_qk_norm")))

    def hf_attention(self, cfg) -> dict:
        return {"num_key_value_heads": cfg.num_query_groups, "head_dim": cfg.head_dim,
                "attention_bias": cfg.qkv_bias, "use_qk_norm": cfg.qk_layernorm,
                "partial_rotary_factor": cfg.rotary_percent}
