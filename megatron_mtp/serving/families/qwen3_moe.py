# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention with softmax-routed experts (top-k of a
softmax, normalized or not; dense layers by decoder_sparse_step and mlp_only_layers); its MTP depths
in DeepSeek-V3's layout, its experts one per expert in published checkpoints. Its experts are
Qwen3-Next's too."""

from megatron_mtp.serving.families.base import Family
from megatron_mtp.serving.families.qwen3 import Qwen3


class Qwen3MoeExperts(Family):
    """Qwen3-MoE's softmax-routed experts, read from and written to config.json."""

    experts = True
    published_experts = ("per_expert", "per_expert")

    def read_hf(self, config: dict, values: dict) -> None:
        values["moe"] = self.moe_from_hf(config, values["num_layers"])
        super().read_hf(config, values)

    def moe_from_hf(self, config: dict, num_layers: int) -> dict:
        experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
        step, dense = int(config.get("decoder_sparse_step") or 1), set(config.get("mlp_only_layers") or [])
        return dict(experts=experts, topk=int(config["num_experts_per_tok"]), ffn=int(config["moe_intermediate_size"]),
                    shared_ffn=0, score="softmax", normalize=bool(config.get("norm_topk_prob", False)),
                    expert_bias=False, groups=None, group_topk=None, scaling=None, shared_gate=False,
                    layers=[int(experts > 0 and i not in dense and (i + 1) % step == 0) for i in range(num_layers)])

    def hf_experts(self, cfg, config: dict) -> None:
        if cfg.moe:
            config.update(self.hf_expert_keys(cfg), output_router_logits=False, router_aux_loss_coef=0.0)

    def hf_expert_keys(self, cfg) -> dict:
        moe = cfg.moe
        return dict(num_experts=moe["experts"], num_experts_per_tok=moe["topk"], moe_intermediate_size=moe["ffn"],
                    **self.hf_expert_layers(cfg))

    def hf_expert_layers(self, cfg) -> dict:
        """Which layers hold experts, and whether their top-k probabilities are normalized."""
        moe = cfg.moe
        return dict(norm_topk_prob=moe["normalize"], decoder_sparse_step=1,
                    mlp_only_layers=[i for i, sparse in enumerate(moe["layers"]) if not sparse])


class Qwen3Moe(Qwen3MoeExperts, Qwen3):
    name = "qwen3_moe"
    title = "Qwen3-MoE"
    architecture = "Qwen3MoeForCausalLM"
    mtp_layout = "deepseek_v3"  # the engines serve an MoE model's MTP depths as DeepSeek-V3's

    def claims(self, cfg) -> bool:
        return bool(cfg.moe) and not cfg.mla and cfg.moe["score"] != "sigmoid" and not cfg.gdn
