# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""A model's Hugging Face tensors, as `convert_checkpoint.py export` writes them and as the weight
stream (serving.stream) yields them from a live model: one mapping for both.

`plan` reads the run's arguments and the export's options and refuses, in one line, what cannot be
written; `hf_tensors` turns the model's global tensors (by checkpoint key, whatever layout saved or
holds them) into the family's Hugging Face names in the export's order; `cast` gives each tensor
the dtype written; `engine_warnings` says where a serving engine is known to serve the written MTP
layout otherwise than megatron-core trained it.
"""

from dataclasses import dataclass

import torch

from megatron_mtp.serving import ServingError, experts, families, files, mapping
from megatron_mtp.serving.config import ModelConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class Plan:
    cfg: ModelConfig
    layout: str | None  # the MTP layout written (None: the backbone only)
    expert_layout: str  # published, per_expert or stacked
    note: str | None = None  # why the default family or layout is not the model's shape's own


def plan(run_args, mtp_layout: str | None = None, architecture: str | None = None,
         expert_layout: str | None = None) -> Plan:
    """The export of a model trained with `run_args` (the trainer's arguments; a checkpoint holds them).
    mtp_layout: a layout of serving.families.MTP_LAYOUTS, none, or None for the family's default."""
    cfg = ModelConfig.from_megatron_args(run_args)
    note = None
    if architecture:
        cfg.as_architecture(architecture)
    if mtp_layout is None and cfg.mtp_num_layers and not cfg.adapter.drafter:
        note = None if architecture else as_drafted_family(cfg)
        if not cfg.adapter.drafter:  # no family of the model's shape that an engine drafts for
            mtp_layout, note = "none", (f"the MTP depths are left out: no engine drafts with "
                                        f"{cfg.adapter.architecture}'s and vLLM's loader refuses them; "
                                        f"--mtp-layout {mapping.default_mtp_layout(cfg)} writes them anyway")
    default = mapping.default_mtp_layout(cfg)
    layout = None if mtp_layout == "none" else mtp_layout or (default if cfg.mtp_num_layers else None)
    mapping.check_mtp_layout(cfg, layout)
    if layout:
        families.mtp_layout(layout).check(cfg)
    cfg.adapter.check_mtp_layout(layout)
    if layout and not cfg.mtp_num_layers:
        raise ServingError(f"--mtp-layout {mtp_layout}: the checkpoint has no MTP depths "
                           "(trained without --mtp-num-layers); use --mtp-layout none")
    mapping.check_mtp_layer(cfg, cfg.mtp_num_layers if layout else 0)
    if expert_layout and not cfg.moe:
        raise ServingError(f"--expert-layout {expert_layout}: the model has no experts")
    return Plan(cfg, layout, expert_layout or "published", note)


def as_drafted_family(cfg: ModelConfig) -> str | None:
    """An export must load in the engines as written, with its MTP depths where an engine drafts with
    them: a model whose family no engine drafts for is written as the family of the same shape that
    one does, if any (Qwen2's as MiMo's; otherwise plan leaves the depths out, as vLLM's loaders
    refuse tensors their model lacks). `cfg` becomes that family; the sentence says so (None: none)."""
    own = cfg.adapter
    served = [name for name in families.same_shape(cfg.family) if families.FAMILIES[name].drafter]
    if not served:
        return None
    cfg.as_architecture(served[0])
    return (f"written as {cfg.adapter.architecture}, {own.title}'s model with its MTP depths, which vLLM drafts "
            f"with ({cfg.adapter.drafter}); --architecture {own.name} writes {own.architecture} without them")


def hf_tensors(export: Plan, global_tensors: dict, source: str) -> dict:
    """The model's global tensors (by checkpoint key) -> the Hugging Face tensors, in the order written;
    `source` names where the tensors come from in a refusal."""
    from megatron_mtp.serving.model import local_names

    cfg, layout = export.cfg, export.layout
    tensors = local_names(global_tensors, cfg.num_layers)  # the model's names, whatever layout holds them
    if cfg.mtp_num_layers and layout and not any(k.startswith("mtp.layers.") for k in tensors):
        raise ServingError(f"{source}: the arguments name {cfg.mtp_num_layers} MTP depths but the model "
                           "holds no MTP tensors")
    hf = mapping.megatron_to_hf(tensors, cfg, layout)
    expected = mapping.hf_shapes(cfg, layout, cfg.mtp_num_layers)
    if sorted(hf) != sorted(expected):
        raise ServingError(f"internal: exported names differ from the loaders' ({sorted(set(hf) ^ set(expected))[:3]})")
    return experts.stack(hf, cfg.adapter.published_experts, export.expert_layout, cfg.num_layers)


def cast(tensors: dict, dtype: str):
    """(name, tensor) in `dtype`, contiguous, each with storage of its own (files.unshared; a cast to
    another dtype copies anyway)."""
    return files.unshared((name, value.to(DTYPES[dtype]).contiguous()) for name, value in tensors.items())


def engine_warnings(cfg: ModelConfig, layout: str | None) -> list[str]:
    """Where vLLM is known to serve the written MTP depths otherwise than megatron-core trained them
    (docs/serving.md "What the engines run"): each a sentence, none when nothing is known."""
    depths = cfg.mtp_num_layers if layout else 0
    return families.mtp_layout(layout).engine_warnings(cfg, depths) if depths else []
