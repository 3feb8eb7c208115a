# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Llama (LlamaForCausalLM): GQA, RMSNorm, SwiGLU, RoPE, no biases; its MTP depths in MiMo's layout."""

from megatron_mtp.serving.families.base import Family


class Llama(Family):
    name = "llama"
    title = "Llama"
    architecture = "LlamaForCausalLM"
    mtp_layout = "mimo"  # the engines serve a dense model's MTP depths as MiMo's
    refuses_sliding_window = False  # transformers' Llama has no such key

    def claims(self, cfg) -> bool:
        return not cfg.moe and not cfg.gdn and not cfg.qkv_bias and not cfg.qk_layernorm

    def bias_refusal(self) -> str:
        return "config.json: Llama attention_bias / mlp_bias are not supported"

    def hf_layers(self, cfg) -> dict:
        return {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}
