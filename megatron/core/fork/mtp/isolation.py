# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Gradient isolation of the MTP heads (spec section 2, ``mtp_detach_heads``).

With isolation on, nothing of the MTP loss reaches what the main objective owns:
- the backbone's final hidden state h^0 enters depth 1 detached (the boundary);
- h^{k-1} feeds depth k with gradient for k >= 2, so the depth chain stays connected
  and the depth-k loss trains the MTP parameters of depths 1..k (detaching at every
  depth would silently drop those cross-depth terms);
- the shared embedding is evaluated without gradient at every depth;
- MTP logits use a detached view of the effective output weight (tied or untied), so
  the gradient still flows into h^k but not into the weight;
- the MTP parameters form their own gradient-norm group, MTP_GRAD_NORM_GROUP.
The first two and the tag are upstream's in megatron-core 0.19 (megatron.core.fork.backports
gives them to 0.16.1); the output weight is this module's, for every version. With
isolation off every function here returns its input unchanged.
"""

MTP_GRAD_NORM_GROUP = "mtp"


def output_weight(model, shared_weight):
    """The weight MTP logits use: None means the output layer's own (upstream behaviour)."""
    if not model.config.mtp_detach_heads:
        return shared_weight
    weight = shared_weight if shared_weight is not None else model.output_layer.weight
    return weight.detach()


def refuse_trainable_output_bias(model) -> None:
    """Isolation cannot honour a trainable output-layer bias: MTP logits would train it."""
    bias = getattr(getattr(model, "output_layer", None), "bias", None)
    if model.config.mtp_detach_heads and bias is not None and bias.requires_grad:
        raise ValueError(
            "mtp_detach_heads cannot isolate a trainable output-layer bias: the MTP loss would "
            "train it. Freeze the bias (requires_grad=False) or build the output layer without one."
        )
