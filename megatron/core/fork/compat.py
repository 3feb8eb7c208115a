"""What differs between the carried upstream megatron-core versions, in one place.

Fork-owned modules serve every version in patches/; where upstream's API differs they
call these adapters instead of testing versions themselves.
"""


def scale_logits(model, logits):
    """Output-logit scaling of the model (MuP in megatron-core 0.17+; none in 0.16.1), as
    upstream applies it to main and MTP logits."""
    scale = getattr(model, "_scale_logits", None)
    return logits if scale is None else scale(logits)


def logit_multiplier(model) -> float:
    """The constant scale_logits multiplies by (1.0 without MuP), for code that needs the
    factor itself: the sparse MTP loss applies it inside its chunks and to its gradient."""
    config = model.config
    return config.mup_output_mult if getattr(config, "use_mup", False) else 1.0


def has_moe_grad_scale_func(config) -> bool:
    """megatron-core 0.19+ lets a step scale the MoE router losses (moe_grad_scale_func);
    0.16.1's schedules take the main loss scale for them, with no hook."""
    return hasattr(config, "moe_grad_scale_func")

