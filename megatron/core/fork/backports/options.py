# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The fork's TransformerConfig fields in megatron-core 0.16.1: those of every version
(megatron.core.fork.mtp.options) plus the two MTP options megatron-core 0.17 added upstream
under these names and meanings. The 0.16.1 series' TransformerConfig derives from this class.
(exact_steps is a field here too, but 0.16.1's sdist has no megatron.training to read it.)"""

from dataclasses import dataclass

from megatron.core.fork.mtp import options


@dataclass
class MTPTrainingConfig(options.MTPTrainingConfig):
    """ModelParallelConfig plus the fields the 0.16.1 series adds to TransformerConfig."""

    mtp_detach_heads: bool = False
    """Isolate the MTP heads: no MTP gradient reaches the backbone, the shared embedding or
    the output weight; the depth chain stays connected (megatron.core.fork.backports.isolation)."""

    mtp_use_repeated_layer: bool = False
    """Apply one MTP layer (mtp.layers.0) at every one of the mtp_num_layers depths."""
