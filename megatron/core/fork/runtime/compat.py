# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""What differs between the carried upstream megatron-core versions, in one place.

Fork-owned modules serve every version in patches/; where upstream's API differs they
call these adapters instead of testing versions themselves.
"""


# TransformerConfig fields pristine megatron-core 0.16.1 lacks (its series adds them), and what
# their absence means.
_ABSENT_IN_0_16 = {"mtp_use_repeated_layer": False}


def config_field(config, name: str):
    """A TransformerConfig field, or what its absence means in a version without it."""
    return getattr(config, name, _ABSENT_IN_0_16.get(name))


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
    """Whether a step can scale the MoE router losses (moe_grad_scale_func): upstream's field
    from megatron-core 0.19, backported by the 0.16.1 series ("MoE: the router losses' scale
    from moe_grad_scale_func"); False only for a megatron-core without either."""
    return hasattr(config, "moe_grad_scale_func")


def mtp_rolls_across_context_parallel_ranks() -> bool:
    """Whether this megatron-core's MTP roll is the fork's exact one across context-parallel
    ranks (the 0.19.2 series routes roll_tensor to megatron.core.fork.runtime.context_parallel; the
    0.16.1 series does not carry it, so MTP with context parallelism stays refused there)."""
    return _at_least(0, 19)


def router_losses_exact_under_context_parallel() -> bool:
    """Whether MoE router losses with context parallelism are compared with the reference on this
    megatron-core's series: 0.19.2's (its MTP depths run under CP); 0.16.1 refuses them."""
    return _at_least(0, 19)


def carries_draft_objectives() -> bool:
    """Whether this megatron-core's series carries the draft objectives (kl, tv, e2e_tv) and
    is tested with them: the 0.19.2 series; 0.16.1's trains ``ce`` only."""
    return _at_least(0, 19)


def torch_norms_have_zero_centered_gamma() -> bool:
    """Whether megatron-core's torch norms (WrappedTorchNorm) build zero-centred gamma: the 0.19.2
    series' patch "Zero-centred gamma with the torch norms"; 0.16.1's still assert it away."""
    return _at_least(0, 19)


def _at_least(major: int, minor: int) -> bool:
    from megatron.core.package_info import __version__

    return tuple(int(part) for part in __version__.split(".")[:2]) >= (major, minor)
