# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The Hugging Face families, one adapter each (a file here), and the registry that serving.config,
serving.trainer_args, serving.mapping, serving.export, serving.experts and tools/convert_checkpoint.py
look them up in: none of them names a family. An adapter (families.base.Family) reads its family's
config.json into a ModelConfig and writes it back, says which trained shape it is the export's
default for, holds its tensor names where they differ from the shared ones, its MTP layout and its
published experts' layout, and refuses what its transformers class says that megatron-core does not
compute.

A new family is its file (a Family subclass that composes the parts it shares: Qwen3-MoE is Qwen3
with Qwen3MoeExperts), its line in the registration below, and its tests (docs/serving.md "Families").
"""

from megatron_mtp.serving import ServingError
from megatron_mtp.serving.families import (
    deepseek_v3,
    glm4_moe,
    llama,
    mimo,
    qwen2,
    qwen3,
    qwen3_5,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
)
from megatron_mtp.serving.families.base import Family, MtpLayout

FAMILIES: dict[str, Family] = {}  # the order an import's refusal lists them in
BY_ARCHITECTURE: dict[str, Family] = {}
VLM_WRAPPERS: dict[str, str] = {}  # a published VLM's class -> its language model's class (mapping.unwrap_vlm)
MTP_LAYOUTS: dict[str, MtpLayout] = {}  # in their families' order (the order detect_mtp names them in)


def register(family: Family) -> None:
    """Adds a family (its class, its VLM class and the MTP layout it defines with it)."""
    FAMILIES[family.name] = family
    BY_ARCHITECTURE[family.architecture] = family
    if family.vlm_wrapper:
        VLM_WRAPPERS[family.vlm_wrapper] = family.architecture
    if family.own_mtp_layout:
        MTP_LAYOUTS.setdefault(family.own_mtp_layout.name, family.own_mtp_layout)


for _family in (llama.Llama(), qwen2.Qwen2(), mimo.Mimo(), qwen3.Qwen3(), qwen3_moe.Qwen3Moe(),
                deepseek_v3.DeepseekV3(), glm4_moe.Glm4Moe(), qwen3_next.Qwen3Next(), qwen3_5.Qwen3_5(),
                qwen3_5_moe.Qwen3_5Moe()):
    register(_family)


def get(name: str) -> Family:
    if name not in FAMILIES:
        raise ServingError(f"unknown family {name!r} (one of {', '.join(FAMILIES)})")
    return FAMILIES[name]


def mtp_layout(name: str) -> MtpLayout:
    if name not in MTP_LAYOUTS:
        raise ServingError(f"unknown MTP layout {name!r} (one of {', '.join(MTP_LAYOUTS)})")
    return MTP_LAYOUTS[name]


def same_shape(name: str) -> tuple:
    """The families of the same trained model as `name`'s, stored otherwise (its own excluded)."""
    return tuple(family.name for family in FAMILIES.values() if family.same_shape_as == name)


def home(cfg, recorded: str | None) -> str:
    """The family a trained model of `cfg`'s shape exports as: the one that claims the shape, or
    `recorded` (the family an import recorded) where that is the same model stored otherwise."""
    claimed = [family.name for family in FAMILIES.values() if not family.same_shape_as and family.claims(cfg)]
    if len(claimed) != 1:
        raise ServingError(f"internal: the families {claimed} claim the model's shape (exactly one must)")
    return recorded if recorded in same_shape(claimed[0]) else claimed[0]
