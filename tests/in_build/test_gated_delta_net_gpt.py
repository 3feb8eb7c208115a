# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Gated DeltaNet on GPTModel (--experimental-attention-variant gated_delta_net), on each build:
the 0.19.2 series selects its layers (patch 0018 and the fork's builder), and refuses in one
line MTP layers on a last Gated DeltaNet layer (the MTP layer is the decoder's last, and MTP
layers attend with a causal mask); 0.16.1's series does not carry the selection, and refuses the
variant rather than build plain attention layers under its name."""

import pytest
import torch.nn.functional as F
from megatron.core import package_info
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.core.fork.runtime.specs import SpecError, gpt_specs


def test_the_variant_is_refused_where_its_layers_are_not_selected():
    # three layers, every second full attention: the last is a Gated DeltaNet layer
    config = TransformerConfig(
        num_layers=3, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True, transformer_impl="local",
        experimental_attention_variant="gated_delta_net", linear_attention_freq=2, mtp_num_layers=1,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu)
    expected = "the MTP layer is the decoder's last layer, a Gated DeltaNet layer" \
        if not package_info.__version__.startswith("0.16.") else "needs the 0.19.2 build"
    with pytest.raises(SpecError, match=expected) as refused:
        gpt_specs(config)
    assert "\n" not in str(refused.value)
