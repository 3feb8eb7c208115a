"""Gradient isolation of the MTP heads (spec section 2, ``mtp_detach_heads``).

With isolation on, nothing of the MTP loss reaches what the main objective owns:
- the backbone's final hidden state h^0 enters depth 1 detached (the boundary);
- h^{k-1} feeds depth k with gradient for k >= 2, so the depth chain stays connected
  and the depth-k loss trains the MTP parameters of depths 1..k (detaching at every
  depth would silently drop those cross-depth terms);
- the shared embedding is evaluated without gradient at every depth;
- MTP logits use a detached view of the effective output weight (tied or untied), so
  the gradient still flows into h^k but not into the weight.
With isolation off every function here returns its input unchanged.
"""

import torch

MTP_GRAD_NORM_GROUP = "mtp"


def backbone_boundary(hidden_states: torch.Tensor, config) -> torch.Tensor:
    """h^0 as it enters depth 1."""
    if not config.mtp_detach_heads:
        return hidden_states
    detached = hidden_states.detach()
    if config.recompute_granularity is not None:
        # A recomputed block whose tensor inputs all lack requires_grad produces outputs
        # without a graph, and its parameters would get no gradient. Make h^0 a leaf that
        # asks for one; its gradient stops here.
        detached.requires_grad_(True)
    return detached


def depth_embedding(embedding, input_ids: torch.Tensor, position_ids: torch.Tensor, config) -> torch.Tensor:
    """e^k = E[x_{t+k}]; under isolation computed without gradient (E gets none from MTP)."""
    if not config.mtp_detach_heads:
        return embedding(input_ids=input_ids, position_ids=position_ids)
    with torch.no_grad():
        return embedding(input_ids=input_ids, position_ids=position_ids)


def output_weight(model, shared_weight):
    """The weight MTP logits use: None means the output layer's own (upstream behaviour)."""
    if not model.config.mtp_detach_heads:
        return shared_weight
    weight = shared_weight if shared_weight is not None else model.output_layer.weight
    return weight.detach()


def tag_mtp_parameters(model) -> None:
    """Under isolation the MTP parameters form their own gradient-norm group (spec section 6).
    (megatron-core 0.17+ tags them upstream, with the same attribute and name.)"""
    if model.config.mtp_detach_heads and model.mtp_process:
        for param in model.mtp.parameters():
            param.grad_norm_group = MTP_GRAD_NORM_GROUP


def refuse_trainable_output_bias(model) -> None:
    """Isolation cannot honour a trainable output-layer bias: MTP logits would train it."""
    bias = getattr(getattr(model, "output_layer", None), "bias", None)
    if model.config.mtp_detach_heads and bias is not None and bias.requires_grad:
        raise ValueError(
            "mtp_detach_heads cannot isolate a trainable output-layer bias: the MTP loss would "
            "train it. Freeze the bias (requires_grad=False) or build the output layer without one."
        )
