# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The model shape a checkpoint records names every parameter-bearing architecture field.

A checkpoint of one architecture loaded into a model of another must be refused naming the
fields, not load the tensors both share: the attention's output gate, Gated DeltaNet's
heads, head sizes and convolution (issue 27), for HybridModel's `G` layers and GPTModel's
experimental gated_delta_net layers, the norms' kind and zero-centred gamma, and the shared
expert's gate are compared;
a shape saved before those fields were
recorded is compared without them.
"""

import pytest
from megatron.core.transformer import TransformerConfig

from megatron.core.fork.training_loop.model_shape import check_same_shape, config_shape

BASE = dict(num_layers=4, hidden_size=64, num_attention_heads=4, mtp_num_layers=1)
GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
           linear_conv_kernel_dim=4)


def shape(pattern=None, **fields):
    return config_shape(TransformerConfig(**BASE, **fields), pattern)


def refusal(saved, current):
    with pytest.raises(ValueError) as error:
        check_same_shape(saved, current)
    return str(error.value)


@pytest.mark.parametrize("field, other", [("linear_num_value_heads", 8), ("linear_key_head_dim", 8),
                                          ("linear_conv_kernel_dim", 2)])
def test_gated_delta_net_fields_are_a_shape_in_hybrid_patterns(field, other):
    message = refusal(shape("G*G*/*", **GDN), shape("G*G*/*", **dict(GDN, **{field: other})))
    assert f"{field}: checkpoint {GDN[field]}, model {other}" in message, message


def test_gated_delta_net_fields_are_a_shape_in_gpt_models():
    variant = dict(GDN, experimental_attention_variant="gated_delta_net", linear_attention_freq=2)
    message = refusal(shape(**variant), shape(**dict(variant, linear_attention_freq=4, linear_num_key_heads=4)))
    assert "linear_attention_freq: checkpoint 2, model 4" in message and \
        "linear_num_key_heads: checkpoint 2, model 4" in message, message


def test_a_model_without_linear_attention_does_not_record_its_unused_defaults():
    assert "linear_num_key_heads" not in shape("*-*-/*-")
    check_same_shape(shape("*-*-/*-", **GDN), shape("*-*-/*-"))


def test_the_output_gate_is_a_shape():
    assert "attention_output_gate: checkpoint False, model True" in refusal(shape(), shape(attention_output_gate=True))


def test_a_shape_saved_before_the_gate_and_linear_attention_fields_loads():
    current = shape("G*G*/*", **GDN)
    saved = {field: value for field, value in current.items()
             if not field.startswith("linear_") and field not in ("attention_output_gate",
                                                                  "experimental_attention_variant")}
    check_same_shape(saved, current)


def test_zero_centred_gamma_and_the_norm_are_a_shape():
    # the same tensors, read as w or as 1 + w: a checkpoint of the other kind would load silently
    message = refusal(shape(), shape(layernorm_zero_centered_gamma=True, normalization="RMSNorm"))
    assert "layernorm_zero_centered_gamma: checkpoint False, model True" in message, message
    assert "normalization: checkpoint 'LayerNorm', model 'RMSNorm'" in message, message
    saved = {field: value for field, value in shape().items()
             if field not in ("normalization", "layernorm_zero_centered_gamma")}  # saved before they were recorded
    check_same_shape(saved, shape(layernorm_zero_centered_gamma=True))


def test_the_shared_experts_gate_is_a_shape():
    moe = dict(num_moe_experts=4, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32)
    message = refusal(shape(**moe, moe_shared_expert_gate=True), shape(**moe))
    assert "moe_shared_expert_gate: checkpoint True, model False" in message, message
    saved = {field: value for field, value in shape(**moe).items() if field != "moe_shared_expert_gate"}
    check_same_shape(saved, shape(**moe, moe_shared_expert_gate=True))  # saved before it was recorded
    assert "moe_shared_expert_gate" not in shape()  # without experts it is not recorded
