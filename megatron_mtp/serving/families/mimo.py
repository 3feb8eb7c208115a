# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""MiMo (MiMoForCausalLM): Qwen2 with MTP depths in model.mtp_layers; its class name in config.json's
architectures is what makes vLLM and SGLang serve those depths (their MiMo MTP models). The same
trained model as Qwen2: an import records the family, and --architecture exchanges the two.

The export writes model_type qwen2: transformers has no `mimo` model type (published MiMo checkpoints
say `mimo` and ship their own configuration code, loaded with trust_remote_code), and vLLM reads
config.json through transformers, so `mimo` stops both; under qwen2 transformers loads the backbone
as Qwen2ForCausalLM and vLLM picks its model by the architecture (MiMoForCausalLM, and its MiMo MTP
as the draft). Import reads either model type: the architecture names the family.

MiMo's MTP layout (the dense families' default): model.mtp_layers.{k}: token_layernorm = enorm,
hidden_layernorm = hnorm, input_proj over [hidden, embedding] (megatron-core's eh_proj with its
halves swapped), final_layernorm; the inner layer's tensors under the same prefix.
"""

import re

import torch

from megatron_mtp.serving import ServingError
from megatron_mtp.serving.families.base import MtpLayout
from megatron_mtp.serving.families.qwen2 import Qwen2


class MimoLayout(MtpLayout):
    name = "mimo"

    def prefix(self, cfg, depth: int) -> str:
        return f"model.mtp_layers.{depth}."

    def depths(self, names, cfg) -> set:
        return {int(m.group(1)) for n in names if (m := re.match(r"model\.mtp_layers\.(\d+)\.", n))}

    def shapes(self, cfg, prefix: str) -> dict:
        H = cfg.hidden_size
        return {prefix + "token_layernorm.weight": (H,), prefix + "hidden_layernorm.weight": (H,),
                prefix + "input_proj.weight": (H, 2 * H), prefix + "final_layernorm.weight": (H,)}

    def to_hf(self, tensors: dict, source: str, prefix: str, depth: int, cfg, out: dict) -> None:
        H, eh = cfg.hidden_size, tensors[source + "eh_proj.weight"]
        out[prefix + "token_layernorm.weight"] = tensors[source + "enorm.weight"]
        out[prefix + "hidden_layernorm.weight"] = tensors[source + "hnorm.weight"]
        out[prefix + "input_proj.weight"] = torch.cat([eh[:, H:], eh[:, :H]], 1).contiguous()  # [hidden, emb]
        out[prefix + "final_layernorm.weight"] = tensors[source + "final_layernorm.weight"]

    def from_hf(self, t: dict, prefix: str, target: str, cfg) -> dict:
        H, proj = cfg.hidden_size, t[prefix + "input_proj.weight"]
        return {target + "enorm.weight": t[prefix + "token_layernorm.weight"],
                target + "hnorm.weight": t[prefix + "hidden_layernorm.weight"],
                target + "eh_proj.weight": torch.cat([proj[:, H:], proj[:, :H]], 1),  # [emb, hidden]
                target + "final_layernorm.weight": t[prefix + "final_layernorm.weight"]}

    def engine_warnings(self, cfg, depths: int) -> list[str]:
        # read in vLLM 0.32.0 (models/mimo.py, mimo_mtp.py) and run (tests/test_engine.py's draft logits)
        warned = ["vLLM's MiMo MTP drafts from the main model's hidden states before its final norm (MiMoModel "
                  "returns them so and normalizes in compute_logits), megatron-core trains the depths on them "
                  "after it: the drafts there are not the trained ones (eval_speculative --draft-chain vllm "
                  "reproduces vLLM's)"]
        return warned + self.first_depth_only(cfg, depths, "vLLM's MiMo MTP models",
                                              "the proposer passes no step index")

    def check(self, cfg) -> None:
        if cfg.moe:
            raise ServingError(f"--mtp-layout mimo: MiMo's MTP layers are Qwen2 layers, the model is "
                               f"{cfg.family}-shaped; use --mtp-layout deepseek_v3")


class Mimo(Qwen2):
    name = "mimo"
    title = "MiMo"
    architecture = "MiMoForCausalLM"
    model_type = "qwen2"
    same_shape_as = "qwen2"
    own_mtp_layout = MimoLayout()
    drafter = "MiMoMTP"

    def check_mtp_layout(self, layout: str | None) -> None:
        if layout == "deepseek_v3":
            raise ServingError("--mtp-layout deepseek_v3: MiMo's MTP depths are model.mtp_layers (--mtp-layout "
                               "mimo); give --architecture qwen2 for DeepSeek-V3's layout")
