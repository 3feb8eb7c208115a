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


@dataclass(frozen=True)
class Plan:
    """An export, resolved once by `plan` and never changed."""

    cfg: ModelConfig  # the model as written: its family is the one config.json names
    layout: str | None  # the MTP layout written (None: the backbone only)
    expert_layout: str  # published, per_expert or stacked
    note: str | None = None  # why the default family or layout is not the model's shape's own

    @property
    def depths(self) -> int:
        """The MTP depths written."""
        return self.cfg.mtp_num_layers if self.layout else 0

    def expected(self) -> dict:
        """The Hugging Face names written and their shapes (the loaders')."""
        return mapping.hf_shapes(self.cfg, self.layout, self.depths)

    def check_mtp_tensors(self, names, source: str) -> None:
        """The model (its tensor `names`, from `source`) holds the MTP depths the arguments name."""
        if self.depths and not any(name.startswith("mtp.layers.") for name in names):
            raise ServingError(f"{source}: the arguments name {self.cfg.mtp_num_layers} MTP depths but the model "
                               "holds no MTP tensors")

    def check_names(self, written, what: str) -> None:
        """The names `written` (`what`: the exported, the streamed) are the loaders' (an internal error)."""
        expected = self.expected()
        if set(written) != set(expected):
            raise ServingError(f"internal: {what} names differ from the loaders' "
                               f"({sorted(set(expected) ^ set(written))[:3]})")


def plan(run_args, mtp_layout: str | None = None, architecture: str | None = None,
         expert_layout: str | None = None) -> Plan:
    """The export of a model trained with `run_args` (the trainer's arguments; a checkpoint holds them),
    refused in one line where it cannot be written. mtp_layout: a layout of serving.families.MTP_LAYOUTS,
    none, or None for the family's default."""
    cfg, family, note = ModelConfig.from_megatron_args(run_args), architecture, None
    if not architecture and mtp_layout is None and cfg.mtp_num_layers and not cfg.adapter.drafter:
        family, note = _drafted_family(cfg)
    if family:
        cfg = cfg.as_architecture(family)
    if mtp_layout is None and cfg.mtp_num_layers and not cfg.adapter.drafter:  # no engine drafts for the family
        mtp_layout, note = "none", (f"the MTP depths are left out: no engine drafts with "
                                    f"{cfg.adapter.architecture}'s and vLLM's loader refuses them; "
                                    f"--mtp-layout {mapping.default_mtp_layout(cfg)} writes them anyway")
    layout = None if mtp_layout == "none" else mtp_layout or (
        mapping.default_mtp_layout(cfg) if cfg.mtp_num_layers else None)
    mapping.check_mtp(cfg, layout, cfg.mtp_num_layers if layout else 0, written=True)
    if layout and not cfg.mtp_num_layers:
        raise ServingError(f"--mtp-layout {mtp_layout}: the checkpoint has no MTP depths "
                           "(trained without --mtp-num-layers); use --mtp-layout none")
    if expert_layout and not cfg.moe:
        raise ServingError(f"--expert-layout {expert_layout}: the model has no experts")
    return Plan(cfg, layout, expert_layout or "published", note)


def _drafted_family(cfg: ModelConfig) -> tuple[str | None, str | None]:
    """An export must load in the engines as written, with its MTP depths where an engine drafts with
    them: a model whose family no engine drafts for is written as the family of the same shape that
    one does, if any (Qwen2's as MiMo's; otherwise plan leaves the depths out, as vLLM's loaders
    refuse tensors their model lacks). That family and the sentence that says so (None, None: none)."""
    own = cfg.adapter
    served = [families.FAMILIES[name] for name in families.same_shape(cfg.family) if families.FAMILIES[name].drafter]
    if not served:
        return None, None
    return served[0].name, (f"written as {served[0].architecture}, {own.title}'s model with its MTP depths, which vLLM "
                            f"drafts with ({served[0].drafter}); --architecture {own.name} writes {own.architecture} "
                            "without them")


def hf_tensors(export: Plan, global_tensors: dict, source: str) -> dict:
    """The model's global tensors (by checkpoint key) -> the Hugging Face tensors, in the order written;
    `source` names where the tensors come from in a refusal."""
    from megatron_mtp.serving.model import local_names

    cfg = export.cfg
    tensors = local_names(global_tensors, cfg.num_layers)  # the model's names, whatever layout holds them
    export.check_mtp_tensors(tensors, source)
    hf = mapping.megatron_to_hf(tensors, cfg, export.layout)
    export.check_names(hf, "exported")
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
