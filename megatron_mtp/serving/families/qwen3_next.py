# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Qwen3-Next (Qwen3NextForCausalLM): megatron-core's GPTModel with --experimental-attention-variant
gated_delta_net (as Megatron-Bridge builds it): Gated DeltaNet layers among gated full-attention
ones (an output gate per attention head, q/k norms, partial rotary: a quarter of each head when
config.json does not say), every norm zero-centred (--apply-layernorm-1p: transformers' (1 + w)
RMSNorms), Qwen3-MoE's routing with a shared expert gated by a sigmoid (--moe-shared-expert-gate).
Its layers are Qwen3.5's too (GatedDeltaNet); its Gated DeltaNet input projections in_proj_qkvz and
in_proj_ba are grouped per key head (its queries, key, values and z of that key head's value heads;
their betas, then alphas), which megatron-core's in_proj holds section by section.

Qwen3-Next's MTP layout (the engines' layout, as vLLM's and SGLang's Qwen3-Next MTP models read it;
Qwen3.5's too): mtp.layers.{k} (a full-attention layer), and once for all depths
mtp.pre_fc_norm_embedding = enorm, mtp.pre_fc_norm_hidden = hnorm, mtp.fc = eh_proj over
[embedding, hidden], mtp.norm = final_layernorm; no copies of the embedding or head.
"""

import re

from megatron_mtp.serving import ServingError
from megatron_mtp.serving.families.base import Family, MtpLayout
from megatron_mtp.serving.families.qwen3_moe import Qwen3MoeExperts
from megatron_mtp.serving.patterns import full_attention_interval, interval_pattern

# The MTP tensors shared by all depths (megatron-core suffix, Hugging Face name).
SHARED_MTP = [("enorm.weight", "mtp.pre_fc_norm_embedding.weight"),
              ("hnorm.weight", "mtp.pre_fc_norm_hidden.weight"), ("eh_proj.weight", "mtp.fc.weight"),
              ("final_layernorm.weight", "mtp.norm.weight")]


class Qwen3NextLayout(MtpLayout):
    name = "qwen3_next"
    zero_centred = True

    def prefix(self, cfg, depth: int) -> str:
        return f"mtp.layers.{depth}."

    def depths(self, names, cfg) -> set:
        return {int(m.group(1)) for n in names if (m := re.match(r"mtp\.layers\.(\d+)\.", n))}

    def shapes(self, cfg, prefix: str) -> dict:
        H = cfg.hidden_size
        return {name: (H, 2 * H) if name == "mtp.fc.weight" else (H,) for _, name in SHARED_MTP}

    def to_hf(self, tensors: dict, source: str, prefix: str, depth: int, cfg, out: dict) -> None:
        # every depth writes the one set; mapping.join refuses depths whose tensors differ
        for ours, name in SHARED_MTP:
            out[name] = tensors[source + ours]

    def from_hf(self, t: dict, prefix: str, target: str, cfg) -> dict:
        return {target + ours: t[name] for ours, name in SHARED_MTP}

    def engine_warnings(self, cfg, depths: int) -> list[str]:
        return self.first_depth_only(cfg, depths, "vLLM's Qwen3-Next and Qwen3.5 MTP models",
                                     "no draft-step index reaches them: vllm-project/vllm#52688")


class GatedDeltaNet(Family):
    """Qwen3-Next's and Qwen3.5's layers, read from and written to config.json."""

    mtp_layout = "qwen3_next"
    gated_delta_net = True
    qk_norm = True
    partial_rotary = True
    default_rotary_percent = 0.25  # transformers' when config.json does not say
    attention_output_gate = True
    zero_centred_norms = True
    # Hugging Face's Gated DeltaNet input projections and the in_proj sections each holds (0 queries,
    # 1 keys, 2 values, 3 z, 4 betas, 5 alphas); grouped per key head, or section by section.
    in_proj_parts: list
    in_proj_per_key_head: bool

    def read_hf(self, config: dict, values: dict) -> None:
        super().read_hf(config, values)
        values["gdn"] = self.gdn_from_hf(config, values["num_layers"])

    def gdn_from_hf(self, config: dict, num_layers: int) -> dict:
        """The Gated DeltaNet layers: layer_types (transformers 5), else every full_attention_interval-th
        layer full attention, as transformers derives it."""
        interval = int(config.get("full_attention_interval") or 4)
        types = config.get("layer_types") or ["linear_attention" if linear else "full_attention"
                                              for linear in interval_pattern(interval, num_layers)]
        unknown = sorted(set(types) - {"linear_attention", "full_attention"})
        if len(types) != num_layers or unknown:
            raise ServingError(f"config.json: layer_types {types} (needs num_hidden_layers {num_layers} of "
                               "'linear_attention' and 'full_attention')")
        gdn = {"layers": [int(kind == "linear_attention") for kind in types],
               **{name: int(config[name]) for name in ("linear_conv_kernel_dim", "linear_key_head_dim",
                                                       "linear_value_head_dim", "linear_num_key_heads",
                                                       "linear_num_value_heads")}}
        if gdn["linear_num_value_heads"] % gdn["linear_num_key_heads"]:
            raise ServingError(f"config.json: linear_num_value_heads {gdn['linear_num_value_heads']} is not a "
                               f"multiple of linear_num_key_heads {gdn['linear_num_key_heads']}")
        return gdn

    def hf_layers(self, cfg) -> dict:
        gdn = cfg.gdn
        keys = {name: value for name, value in gdn.items() if name != "layers"}  # the same names
        keys.update(attention_bias=False, partial_rotary_factor=cfg.rotary_percent,
                    layer_types=["linear_attention" if x else "full_attention" for x in gdn["layers"]])
        if cfg.moe:
            keys["shared_expert_intermediate_size"] = cfg.moe["shared_ffn"]
        interval = full_attention_interval(gdn["layers"])
        if interval:  # the key of Qwen3-Next's published config.json, which vLLM and SGLang read
            keys["full_attention_interval"] = interval
        return keys

    def hf_mtp(self, cfg) -> dict:
        return {**super().hf_mtp(cfg), "mtp_num_hidden_layers": cfg.mtp_num_layers}


class Qwen3NextExperts(Qwen3MoeExperts):
    """Qwen3-MoE's experts beside a shared expert (mlp.shared_expert) with its sigmoid gate
    (mlp.shared_expert_gate) in every MoE layer, as transformers' Qwen3-Next builds them."""

    hf_shared_expert = "mlp.shared_expert."

    def moe_from_hf(self, config: dict, num_layers: int) -> dict:
        moe = super().moe_from_hf(config, num_layers)
        moe.update(shared_ffn=int(config["shared_expert_intermediate_size"]), shared_gate=True,
                   normalize=bool(config.get("norm_topk_prob", True)))
        if not moe["experts"] or not moe["shared_ffn"]:
            raise ServingError(f"config.json: {self.architecture} without experts or without a shared expert "
                               "(num_experts, shared_expert_intermediate_size) is not supported")
        return moe


class Qwen3Next(Qwen3NextExperts, GatedDeltaNet):
    name = "qwen3_next"
    title = "Qwen3-Next"
    architecture = "Qwen3NextForCausalLM"
    own_mtp_layout = Qwen3NextLayout()
    drafter = "Qwen3NextMTP"
    in_proj_parts = [("linear_attn.in_proj_qkvz.weight", (0, 1, 2, 3)), ("linear_attn.in_proj_ba.weight", (4, 5))]
    in_proj_per_key_head = True

    def claims(self, cfg) -> bool:
        return bool(cfg.moe) and not cfg.mla and cfg.moe["score"] != "sigmoid" and bool(cfg.gdn)
