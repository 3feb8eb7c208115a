# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Qwen3.5 (Qwen3_5ForCausalLM, text-only model_type qwen3_5_text): Qwen3-Next's layers without
experts; its Gated DeltaNet layers hold in_proj_qkv (all queries, keys, values), in_proj_z,
in_proj_b, in_proj_a: megatron-core's in_proj sections as they are; Qwen3-Next's MTP layout. Its
published checkpoints are the VLM's (Qwen3_5ForConditionalGeneration), whose language model the
import takes (mapping.unwrap_vlm)."""

from megatron_mtp.serving.families.qwen3_next import GatedDeltaNet


class Qwen3_5(GatedDeltaNet):
    name = "qwen3_5"
    title = "Qwen3.5"
    drafter = "Qwen3_5MTP"
    architecture = "Qwen3_5ForCausalLM"
    model_type = "qwen3_5_text"  # config.json's model_type "qwen3_5" is the VLM's
    vlm_wrapper = "Qwen3_5ForConditionalGeneration"
    in_proj_parts = [("linear_attn.in_proj_qkv.weight", (0, 1, 2)), ("linear_attn.in_proj_z.weight", (3,)),
                     ("linear_attn.in_proj_b.weight", (4,)), ("linear_attn.in_proj_a.weight", (5,))]
    in_proj_per_key_head = False

    def claims(self, cfg) -> bool:
        return not cfg.moe and bool(cfg.gdn)
