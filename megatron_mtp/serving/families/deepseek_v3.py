# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""DeepSeek-V3 (DeepseekV3ForCausalLM): multi-latent attention with YaRN, sigmoid-routed experts
with an expert bias, group-limited routing and a shared expert, dense first layers. Its routing
and config.json form are GLM-4.5's too (SigmoidRouted).

DeepSeek-V3's MTP layout (the MoE families' default): model.layers.{L+k}: enorm, hnorm, eh_proj
over [embedding, hidden], shared_head.norm = final_layernorm, and the copies shared_head.head = the
output weight, embed_tokens = the embedding (its loaders read them; megatron-core's depths share
the main model's).
"""

import re

import torch

from megatron_mtp.serving import ServingError
from megatron_mtp.serving.families.base import Family, MtpLayout, hf_dtype


class SigmoidRouted(Family):
    """DeepSeek-V3's experts (sigmoid scores with e_score_correction_bias, groups, a shared expert,
    a scaling factor, dense first layers) and its config.json form, which GLM-4.5 shares."""

    experts = True
    mtp_layout = "deepseek_v3"
    published_experts = ("per_expert", "per_expert")

    def read_hf(self, config: dict, values: dict) -> None:
        values["moe"] = self.moe_from_hf(config, values["num_layers"])
        super().read_hf(config, values)

    def moe_frequency(self, config: dict) -> int:
        return 1

    def moe_from_hf(self, config: dict, num_layers: int) -> dict:
        experts, topk = int(config["n_routed_experts"]), int(config["num_experts_per_tok"])
        groups, group_topk = int(config.get("n_group") or 1), int(config.get("topk_group") or 1)
        problems = []
        if config.get("scoring_func", "sigmoid") != "sigmoid" or config.get("topk_method", "noaux_tc") != "noaux_tc":
            problems.append(f"scoring_func {config.get('scoring_func')!r} / topk_method {config.get('topk_method')!r} "
                            f"(transformers' {self.title} routes by sigmoid with e_score_correction_bias)")
        if topk > 1 and not config.get("norm_topk_prob", True):
            problems.append("norm_topk_prob false (megatron-core normalizes sigmoid top-k probabilities)")
        if groups > 1 and topk // group_topk != 2:
            problems.append(f"num_experts_per_tok {topk} // topk_group {group_topk} != 2 (transformers scores a group "
                            "by its top 2 experts, megatron-core by its top num_experts_per_tok // topk_group)")
        if int(config.get("n_shared_experts") or 0) < 1:
            problems.append("no shared expert")
        if problems:
            raise ServingError(f"config.json: {self.title} with " + "; ".join(problems))
        first_dense, frequency = int(config.get("first_k_dense_replace") or 0), self.moe_frequency(config)
        return dict(experts=experts, topk=topk, ffn=int(config["moe_intermediate_size"]),
                    shared_ffn=int(config["n_shared_experts"]) * int(config["moe_intermediate_size"]), score="sigmoid",
                    normalize=True, expert_bias=True, groups=groups if groups > 1 else None,
                    group_topk=group_topk if groups > 1 else None,
                    scaling=float(config.get("routed_scaling_factor", 1.0)), shared_gate=False,
                    layers=[int(i >= first_dense and i % frequency == 0) for i in range(num_layers)])

    def hf_attention(self, cfg) -> dict:
        """The attention's keys (after num_attention_heads)."""
        raise NotImplementedError

    def hf_config(self, cfg, dtype: str, mtp_layout: str | None) -> dict:
        moe = cfg.moe
        dense = moe["layers"].index(1) if 1 in moe["layers"] else cfg.num_layers
        config = {
            "architectures": [self.architecture], "model_type": self.hf_model_type,
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.ffn_hidden_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_attention_heads, **self.hf_attention(cfg), "hidden_act": "silu",
            "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.norm_epsilon, "rope_theta": cfg.rope_theta,
            "moe_intermediate_size": moe["ffn"], "n_routed_experts": moe["experts"],
            "num_experts_per_tok": moe["topk"], "n_shared_experts": moe["shared_ffn"] // moe["ffn"],
            "n_group": moe["groups"] or 1, "topk_group": moe["group_topk"] or 1, "norm_topk_prob": moe["normalize"],
            "routed_scaling_factor": moe["scaling"], "first_k_dense_replace": dense,
            "tie_word_embeddings": cfg.tied, "attention_dropout": cfg.attention_dropout, "initializer_range": 0.02,
            "use_cache": True, "torch_dtype": hf_dtype(dtype),
        }
        config.update(cfg.extra)
        if mtp_layout and cfg.mtp_num_layers:
            config.update(self.hf_mtp(cfg))
        return config


class DeepseekV3Layout(MtpLayout):
    name = "deepseek_v3"
    copies_shared = True

    def prefix(self, cfg, depth: int) -> str:
        return f"model.layers.{cfg.num_layers + depth}."

    def depths(self, names, cfg) -> set:
        return {int(m.group(1)) - cfg.num_layers for n in names
                if (m := re.match(r"model\.layers\.(\d+)\.", n)) and int(m.group(1)) >= cfg.num_layers}

    def shapes(self, cfg, prefix: str) -> dict:
        V, H = cfg.vocab_size, cfg.hidden_size
        return {prefix + "enorm.weight": (H,), prefix + "hnorm.weight": (H,), prefix + "eh_proj.weight": (H, 2 * H),
                prefix + "shared_head.norm.weight": (H,), prefix + "shared_head.head.weight": (V, H),
                prefix + "embed_tokens.weight": (V, H)}

    def to_hf(self, tensors: dict, source: str, prefix: str, depth: int, cfg, out: dict) -> None:
        out[prefix + "enorm.weight"] = tensors[source + "enorm.weight"]
        out[prefix + "hnorm.weight"] = tensors[source + "hnorm.weight"]
        out[prefix + "eh_proj.weight"] = tensors[source + "eh_proj.weight"]
        out[prefix + "shared_head.norm.weight"] = tensors[source + "final_layernorm.weight"]
        out[prefix + "shared_head.head.weight"] = out.get("lm_head.weight", out["model.embed_tokens.weight"]).clone()
        out[prefix + "embed_tokens.weight"] = out["model.embed_tokens.weight"].clone()

    def from_hf(self, t: dict, prefix: str, target: str, cfg) -> dict:
        head = t["model.embed_tokens.weight"] if cfg.tied else t["lm_head.weight"]
        for copy, original in (("shared_head.head.weight", head),
                               ("embed_tokens.weight", t["model.embed_tokens.weight"])):
            if not torch.equal(t[prefix + copy], original):
                raise ServingError(f"{prefix}{copy} differs from the main model's: megatron-core's MTP "
                                   "depths share the embedding and the output layer")
        return {target + "enorm.weight": t[prefix + "enorm.weight"],
                target + "hnorm.weight": t[prefix + "hnorm.weight"],
                target + "eh_proj.weight": t[prefix + "eh_proj.weight"],
                target + "final_layernorm.weight": t[prefix + "shared_head.norm.weight"]}

    def engine_warnings(self, cfg, depths: int) -> list[str]:
        if depths < 2:  # one draft step carries the main model's normalized state, as trained
            return []
        return ["megatron-core carries each depth's normalized output (final_layernorm) into the next; vLLM "
                "before vllm-project/vllm#45895 carries the pre-norm hidden state into draft steps 2+ (see "
                "vllm-project/vllm#46075), so depths 2+ see inputs they were not trained on there"]


class DeepseekV3(SigmoidRouted):
    name = "deepseek_v3"
    architecture = "DeepseekV3ForCausalLM"
    title = "DeepSeek-V3"
    yarn = True
    own_mtp_layout = DeepseekV3Layout()
    drafter = "DeepSeekMTP"

    def claims(self, cfg) -> bool:
        return bool(cfg.moe) and bool(cfg.mla)

    def moe_frequency(self, config: dict) -> int:
        return int(config.get("moe_layer_freq") or 1)

    def read_hf(self, config: dict, values: dict) -> None:
        super().read_hf(config, values)
        values["mla"] = {name: int(config[name]) for name in
                         ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
        values.update(num_query_groups=values["num_attention_heads"], head_dim=values["mla"]["qk_nope_head_dim"],
                      qk_layernorm=True)

    def refuse_attention_hf(self, config: dict) -> None:
        if config.get("rope_interleave", True) is not True:
            raise ServingError("config.json: DeepSeek-V3 with rope_interleave false is not supported (its "
                               "checkpoints rotate interleaved pairs, as vLLM and SGLang read them)")

    def hf_attention(self, cfg) -> dict:
        return {"num_key_value_heads": cfg.num_attention_heads, **cfg.mla, "rope_interleave": True,
                "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
                "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1, "attention_bias": False}
