# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Qwen2 (Qwen2ForCausalLM): Llama's layers with QKV biases (megatron-core's --add-qkv-bias)."""

from megatron_mtp.serving.families.base import Family


class Qwen2(Family):
    name = "qwen2"
    title = "Qwen2"
    architecture = "Qwen2ForCausalLM"
    mtp_layout = "mimo"
    qkv_bias = True
    accepts_biases = True  # (config.json's attention_bias is not read: Qwen2 always has them)

    def claims(self, cfg) -> bool:
        return not cfg.moe and not cfg.gdn and cfg.qkv_bias

    def hf_layers(self, cfg) -> dict:
        return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.num_layers}
