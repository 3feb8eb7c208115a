# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Repeated-layer mode (``mtp_use_repeated_layer``): one MTP layer applied at all D depths.

Only ``mtp.layers.0`` is built (upstream's parameter names and state-dict keys); the
block runs it once per depth, so autograd sums the contributions of every depth into
its gradient.
"""


def layer_specs_to_build(layer_specs, config):
    return layer_specs[:1] if config.mtp_use_repeated_layer else layer_specs


def layers_by_depth(layers, config):
    """The layer to run at each depth, in order."""
    if config.mtp_use_repeated_layer:
        return [layers[0]] * config.mtp_num_layers
    return list(layers)
