# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""What a checkpoint's model must share with the model that loads it (spec section 9).

Distributed checkpoints load by key: a model with fewer MTP depths than the checkpoint
simply never asks for the extra depths' tensors, so a depth mismatch would load
silently. A trainer saves ``model_shape`` beside the weights and calls
``check_same_shape`` before loading any tensor (every checkpoint writer of this project:
megatron.training's, through megatron.core.fork.training_loop.checkpoint, and the library's). Isolation on or off
(``mtp_detach_heads``) is a training choice, not a shape: it is not compared. With mixture
of experts the expert count, the experts' sizes and which layers are MoE layers are part of
the shape (dist checkpoints key experts by global index: another count or placement would
load some experts and leave others as initialized). So are the attention's parameters: q/k
norms and multi-latent attention with its ranks and head sizes (a model without q/k norms
would load the others and drop them without a word), the attention's output gate,
Gated DeltaNet's heads, head sizes and convolution (HybridModel's `G` layers or GPTModel's
experimental gated_delta_net layers), and the norms' kind and zero-centred gamma (the same
tensors read as w or as 1 + w), and the shared expert's gate (a model without one would load the
rest and drop it).
"""

from megatron.core.utils import get_attr_wrapped_model

from megatron.core.fork.runtime import compat

SHAPE_FIELDS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "mtp_num_layers",
    "mtp_use_repeated_layer",
)
MOE_FIELDS = ("num_moe_experts", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_layers")
ATTENTION_FIELDS = ("qk_layernorm", "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
                    "qk_pos_emb_head_dim", "v_head_dim")
GATE_AND_LINEAR_ATTENTION_FIELDS = ("attention_output_gate", "experimental_attention_variant",
                                    "linear_attention_freq", "linear_num_key_heads", "linear_num_value_heads",
                                    "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim")
# (1 + w) or w: the same tensors, another model (a checkpoint of the other kind would load silently)
NORM_FIELDS = ("normalization", "layernorm_zero_centered_gamma")
# the shared expert's sigmoid gate (Qwen3-Next's): a parameter of its own, recorded after the other MoE fields
SHARED_EXPERT_GATE_FIELDS = ("moe_shared_expert_gate",)
# What a finetune may change: MTP depths added to, or dropped from, a pretrained backbone.
MTP_FIELDS = ("mtp_num_layers", "mtp_use_repeated_layer")


def config_shape(config, hybrid_layer_pattern: str | None = None) -> dict:
    """The shape a TransformerConfig and HybridModel's layer pattern fix: sizes, MTP depths
    and mode, experts, attention and linear-attention parameters, norms."""
    shape = {field: compat.config_field(config, field) for field in SHAPE_FIELDS}
    shape["hybrid_layer_pattern"] = hybrid_layers(hybrid_layer_pattern)
    shape["mtp_num_layers"] = shape["mtp_num_layers"] or 0  # None and 0 both mean no MTP
    shape["qk_layernorm"] = bool(getattr(config, "qk_layernorm", False))
    shape["multi_latent_attention"] = bool(getattr(config, "multi_latent_attention", False))
    if shape["multi_latent_attention"]:
        shape.update({field: getattr(config, field) for field in ATTENTION_FIELDS[2:]})
    shape["attention_output_gate"] = bool(getattr(config, "attention_output_gate", False))
    shape["normalization"] = config.normalization
    shape["layernorm_zero_centered_gamma"] = bool(config.layernorm_zero_centered_gamma)
    variant = getattr(config, "experimental_attention_variant", None)
    shape["experimental_attention_variant"] = variant
    if variant == "gated_delta_net" or "G" in (hybrid_layer_pattern or ""):
        shape.update({field: getattr(config, field) for field in GATE_AND_LINEAR_ATTENTION_FIELDS[3:]})
        if variant is not None:
            frequency = config.linear_attention_freq
            shape["linear_attention_freq"] = list(frequency) if isinstance(frequency, (list, tuple)) else frequency
    experts = getattr(config, "num_moe_experts", None) or 0
    shape["num_moe_experts"] = experts
    if experts:
        shape["moe_ffn_hidden_size"] = config.moe_ffn_hidden_size
        shape["moe_shared_expert_intermediate_size"] = config.moe_shared_expert_intermediate_size
        shape["moe_shared_expert_gate"] = bool(getattr(config, "moe_shared_expert_gate", False))
        frequency = config.moe_layer_freq
        shape["moe_layers"] = (list(frequency) if isinstance(frequency, (list, tuple))
                               else [int(layer % frequency == 0) for layer in range(config.num_layers)])
    return shape


def hybrid_layers(pattern: str | None) -> str | None:
    """HybridModel's layers and MTP depths: its pattern without the pipeline-stage marks."""
    return None if pattern is None else pattern.replace("|", "")


def model_shape(model) -> dict:
    """The shape of a GPTModel (or a wrapper of one: DDP, Float16Module): ``config_shape``,
    vocabulary, tied or untied output weights."""
    gpt = get_attr_wrapped_model(model, "share_embeddings_and_output_weights", return_model_obj=True)
    shape = config_shape(gpt.config, getattr(gpt, "hybrid_layer_pattern", None))
    shape["vocab_size"] = gpt.vocab_size
    shape["share_embeddings_and_output_weights"] = gpt.share_embeddings_and_output_weights
    return shape


def check_same_shape(saved: dict, current: dict, finetune: bool = False) -> None:
    """Raise ValueError naming every field where the checkpoint and the model differ (a shape
    saved before the experts, the shared expert's gate, the attention's fields, the output gate
    and linear attention's fields, or the norms' were recorded is compared without them; with `finetune`, the MTP
    depths may differ)."""
    if finetune:
        saved = dict(saved, **{field: current.get(field) for field in MTP_FIELDS})
    if "num_moe_experts" not in saved:
        current = {field: value for field, value in current.items() if field not in MOE_FIELDS}
    if "moe_shared_expert_gate" not in saved:
        current = {field: value for field, value in current.items() if field not in SHARED_EXPERT_GATE_FIELDS}
    if "qk_layernorm" not in saved:
        current = {field: value for field, value in current.items() if field not in ATTENTION_FIELDS}
    if "layernorm_zero_centered_gamma" not in saved:
        current = {field: value for field, value in current.items() if field not in NORM_FIELDS}
    if "attention_output_gate" not in saved:
        current = {field: value for field, value in current.items()
                   if field not in GATE_AND_LINEAR_ATTENTION_FIELDS}
    differences = [
        f"{field}: checkpoint {saved.get(field)!r}, model {current.get(field)!r}"
        for field in sorted(set(saved) | set(current))
        if saved.get(field) != current.get(field)
    ]
    if differences:
        raise ValueError(
            "the checkpoint holds a model of another shape (" + "; ".join(differences) + "). "
            "Build the model with the checkpoint's values to load it; mtp_detach_heads may differ."
        )
