# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Zero-centred gamma (--apply-layernorm-1p) with megatron-core's torch norms, on each build: the
0.19.2 series builds it (patch 0045: (1 + w), w started at zero, the torch module's names and
sequence-parallel marks); 0.16.1's norms still assert it away, and its specs refuse it in one line."""

import pytest
import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.core.fork.runtime import compat
from megatron.core.fork.runtime.specs import SpecError, refuse_dropped


def config(**overrides):
    return TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, use_cpu_initialization=True,
                             layernorm_zero_centered_gamma=True, **overrides)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_the_torch_norms_scale_by_one_plus_w_or_the_specs_refuse_them(normalization):
    cfg = config(normalization=normalization)
    if not compat.torch_norms_have_zero_centered_gamma():
        with pytest.raises(SpecError, match="--apply-layernorm-1p"):
            refuse_dropped(cfg, get_gpt_layer_local_spec(normalization=normalization))
        return
    refuse_dropped(cfg, get_gpt_layer_local_spec(normalization=normalization))
    norm = WrappedTorchNorm(cfg, 8, eps=1e-5)
    assert sorted(name for name, _ in norm.named_parameters()) == (
        ["bias", "weight"] if normalization == "LayerNorm" else ["weight"])
    assert not norm.weight.any() and all(hasattr(p, "sequence_parallel") for p in norm.parameters())
    x = torch.randn(3, 8)
    with torch.no_grad():
        norm.weight.normal_()
    plain = (torch.nn.LayerNorm if normalization == "LayerNorm" else torch.nn.RMSNorm)(8, eps=1e-5)
    with torch.no_grad():
        plain.weight.copy_(1 + norm.weight)
    assert torch.allclose(norm(x), plain(x), rtol=1e-6, atol=1e-6)
    norm.reset_parameters()  # what meta-device initialization calls: w back at zero
    assert not norm.weight.any()
