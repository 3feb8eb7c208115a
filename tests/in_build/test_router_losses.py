# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The router losses' step scale and refusals (spec section 11), on each build's config."""

from types import SimpleNamespace

import pytest
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.core.fork.mtp import router_losses
from megatron.core.fork.runtime import compat


def moe_config(**overrides):
    return TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=4,
                             moe_router_topk=2, use_cpu_initialization=True, calculate_per_token_loss=True,
                             **overrides)


def test_the_scale_is_the_loss_scale_of_the_moment_over_the_routed_tokens():
    config = moe_config(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-2)
    if not compat.has_moe_grad_scale_func(config):
        with pytest.raises(ValueError, match="moe_grad_scale_func"):
            router_losses.scale_func(config, 128)
        return
    loss_scale = {"value": 1024.0}  # fp16's dynamic scale: it changes between steps
    config.grad_scale_func = lambda loss: loss * loss_scale["value"]
    scale = router_losses.scale_func(config, 128)
    assert float(scale()) == 1024.0 / 128
    loss_scale["value"] = 512.0
    assert float(scale()) == 512.0 / 128
    config.grad_scale_func = None
    assert float(scale()) == 1.0 / 128
    with pytest.raises(ValueError, match="at least one token"):
        router_losses.scale_func(config, 0)


def test_which_configs_have_router_losses_and_which_are_refused():
    assert not router_losses.active(SimpleNamespace(num_moe_experts=None))
    assert not router_losses.active(moe_config(moe_aux_loss_coeff=0.0))
    assert router_losses.active(moe_config(moe_aux_loss_coeff=0.0, moe_z_loss_coeff=1e-3))
    assert router_losses.active(moe_config(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-2))
    router_losses.check_exact_step(moe_config(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-2))
    with pytest.raises(ValueError, match="global_aux_loss.*seq_aux_loss"):
        router_losses.check_exact_step(moe_config(moe_router_load_balancing_type="global_aux_loss",
                                                  moe_aux_loss_coeff=1e-2))
    # under context parallelism the router losses are exact on the 0.19.2 series and refused on 0.16.1's
    # (tests/test_moe_gradients.py compares 0.19.2's); an MoE model without them is refused on neither
    under_cp = moe_config(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-2,
                          moe_z_loss_coeff=1e-3, context_parallel_size=2)
    if compat.router_losses_exact_under_context_parallel():
        router_losses.check_exact_step(under_cp)
    else:
        with pytest.raises(ValueError, match=r"context parallelism \(context_parallel_size=2\).*0\.19\.2's "
                                             r"series only.*--moe-aux-loss-coeff 0"):
            router_losses.check_exact_step(under_cp)
    router_losses.check_exact_step(moe_config(moe_aux_loss_coeff=0.0, context_parallel_size=2))
    # a global balance loss with coefficient 0 contributes nothing and is not refused
    router_losses.check_exact_step(SimpleNamespace(num_moe_experts=4, moe_router_load_balancing_type=[
        "seq_aux_loss", "global_aux_loss"], moe_aux_loss_coeff=[1e-2, 0.0]))
