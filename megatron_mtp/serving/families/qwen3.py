# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Qwen3 (Qwen3ForCausalLM): Llama's layers with a per-head q/k RMSNorm (megatron-core's
--qk-layernorm), no biases."""

from megatron_mtp.serving.families.base import Family


class Qwen3(Family):
    name = "qwen3"
    title = "Qwen3"
    architecture = "Qwen3ForCausalLM"
    mtp_layout = "mimo"
    qk_norm = True

    def claims(self, cfg) -> bool:
        return not cfg.moe and not cfg.gdn and not cfg.qkv_bias and cfg.qk_layernorm

    def hf_layers(self, cfg) -> dict:
        return {"attention_bias": False, "use_sliding_window": False, "sliding_window": None,
                "max_window_layers": cfg.num_layers}
