# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Qwen3.5-MoE (Qwen3_5MoeForCausalLM, text-only model_type qwen3_5_moe_text): Qwen3.5 with
Qwen3-Next's experts in every layer, their top-k probabilities always normalized (transformers'
class reads neither decoder_sparse_step, mlp_only_layers nor norm_topk_prob), and no dense MLP (no
intermediate_size: the experts' size fills megatron-core's unused --ffn-hidden-size). The same
trained model as Qwen3-Next: an import records the family, and --architecture exchanges the two.
Its published checkpoints (Qwen3_5MoeForConditionalGeneration) stack each decoder layer's experts
and store the MTP depths' one per expert."""

from megatron_mtp.serving import ServingError
from megatron_mtp.serving.families.qwen3_5 import Qwen3_5
from megatron_mtp.serving.families.qwen3_next import Qwen3NextExperts


class Qwen3_5Moe(Qwen3NextExperts, Qwen3_5):
    name = "qwen3_5_moe"
    title = "Qwen3.5-MoE"
    drafter = "Qwen3_5MoeMTP"
    architecture = "Qwen3_5MoeForCausalLM"
    model_type = "qwen3_5_moe_text"
    vlm_wrapper = "Qwen3_5MoeForConditionalGeneration"
    same_shape_as = "qwen3_next"
    dense_ffn_key = "moe_intermediate_size"
    published_experts = ("stacked", "per_expert")

    def moe_from_hf(self, config: dict, num_layers: int) -> dict:
        return dict(super().moe_from_hf(config, num_layers), normalize=True, layers=[1] * num_layers)

    def hf_experts(self, cfg, config: dict) -> None:
        if cfg.moe:
            del config["intermediate_size"]
        super().hf_experts(cfg, config)

    def hf_expert_layers(self, cfg) -> dict:
        return {}  # in every layer and always normalized (check_export)

    def check_export(self, cfg) -> None:
        if not all(cfg.moe["layers"]) or not cfg.moe["normalize"]:
            raise ServingError("Qwen3.5-MoE has experts in every layer and normalizes their top-k probabilities; "
                               "the model has dense layers or --moe-router-pre-softmax (--architecture qwen3_next "
                               "holds them)")
