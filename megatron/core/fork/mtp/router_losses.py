# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""MoE router losses in an exact step (spec section 11).

For every MoE layer of the backbone and of every MTP depth a step's objective adds

    z-loss            coeff * sum_t z_t / T
    seq_aux_loss      coeff * sum_q l_q / Q
    aux_loss          coeff * sum_mb (T_mb / T) * l_mb

with T the step's routed tokens (every input position of every micro-batch, chunk and
data-parallel rank) and Q its sequences. megatron-core's router, in
``calculate_per_token_loss`` mode, attaches each loss to the backward pass with the weight
``local tokens x TP-CP size`` times the scale of ``MoEAuxLossAutoScaler``: a raw sum over
the micro-batch's routed tokens (z-loss: coeff * sum_t z_t; seq_aux_loss: coeff * s *
sum_q l_q for sequences of length s; aux_loss: coeff * T_mb * l_mb). Upstream then relies
on finalize_model_grads dividing by the step's *valid target* count, which is T only when
every position has a target. An exact step divides by nothing there (its branches are
seeded up front), so the router losses get their own denominator here: the schedules set
the autoscaler's scale from ``config.moe_grad_scale_func`` after every micro-batch's
forward, and during an exact step that function returns ``loss scale / T``. Each of the
three losses is then exactly its step term, for any micro-batch size, chunk count and
DP / EP / TP / PP layout, and the fp16 loss scale reaches every router loss.

Under context parallelism each CP rank routes its pieces of every sequence, and the step's terms
are still those of whole sequences: megatron-core's router reduces what each balance loss needs
over the TP-CP group (the per-expert token counts of the micro-batch for aux_loss, of each sequence
for seq_aux_loss, whose batch is folded into the expert dimension) and divides by the whole
micro-batch's or sequence's tokens (local x TP-CP size). Each rank's loss then holds its own
tokens' probabilities against those whole counts, attached with the weight local tokens x TP-CP
size, and the DP x CP gradient reduce adds the pieces up to the whole sequence's gradient. The
z-loss is per token: coeff / TP-CP size times the local mean, at that weight, is coeff times the
rank's own sum. T is counted from whole rows, once per data-parallel replica (the trainer on CP
rank 0, ``megatron_mtp.library.step`` over data-parallel ranks only), and the expert bias moves on
the tokens per expert over TP x DP x CP. The 0.19.2 series is compared with the reference this way
(tests/test_moe_gradients.py); 0.16.1's, whose MTP depths do not run under CP, refuses router
losses with CP.

On packed rows (THD: ``PackedSeqParams``) a packed row is one batch entry of the router's
``[seq, batch]`` layout. ``aux_loss`` and the z-loss then hold the row's tokens, every input
position, which is what the spec asks; the padding of packed sequences (``cu_seqlens_q_padded``,
as context parallelism needs) is input positions too: routed, counted in T and balanced like
tokens, the same at every layout for the same rows. ``seq_aux_loss``'s statistics are the whole
row's, not each packed sequence's, so it is refused on packed rows (``check_packed_forward``,
before the step's first model forward). Upstream's ``padding_mask``, which would leave padding out,
is refused in exact steps: the step's T counts every input position, an MTP depth's rolled mask
marks a sequence's last token as padding and its padding's last position as a token, and under
context parallelism upstream weights each rank's balance loss by that rank's unpadded count (the
whole micro-batch's is the weight), so it cannot be exact without changing upstream's MTP roll
and router.

``global_aux_loss`` uses routing statistics accumulated over the step's micro-batches so
far (each micro-batch sees a different partial count), so it is not the step's loss and
is refused in exact steps.

Upstream's routers compute their losses only in training with gradients, so an evaluation
reported none. A router bound to an evaluation that reports them (megatron.core.fork.training_loop.
exact_step.begin_evaluation: a running step whose ``router_losses_in_evaluation`` is set) computes
them in eval mode too, for the evaluation's record: they reach the metrics trackers, and no gradient
flows.
"""

import torch

from megatron.core.fork.mtp.forward_settings import step_of
from megatron.core.fork.runtime import compat
from megatron.core.fork.runtime import device as compute_device

_GLOBAL = "global_aux_loss"


def load_balancing_types(config) -> list:
    kinds = config.moe_router_load_balancing_type
    return list(kinds) if isinstance(kinds, (list, tuple)) else [kinds]


def coefficients(config) -> list:
    coeffs = config.moe_aux_loss_coeff
    return list(coeffs) if isinstance(coeffs, (list, tuple)) else [coeffs] * len(load_balancing_types(config))


def active(config) -> bool:
    """True when the model has MoE layers with a router loss that reaches the backward pass."""
    if not getattr(config, "num_moe_experts", None):
        return False
    balancing = any(c and c > 0 for c in coefficients(config))
    return balancing or bool(config.moe_z_loss_coeff)


def check_exact_step(config) -> None:
    """Refuse what an exact step cannot normalize (before any state changes)."""
    if not getattr(config, "num_moe_experts", None):
        return
    cp = getattr(config, "context_parallel_size", 1)
    if active(config) and cp > 1 and not compat.router_losses_exact_under_context_parallel():
        raise ValueError(
            f"MoE router losses with context parallelism (context_parallel_size={cp}) are exact with "
            "megatron-core 0.19.2's series only: this series is not compared with the reference under context "
            "parallelism. Set --moe-aux-loss-coeff 0 and drop --moe-z-loss-coeff, use --context-parallel-size 1, "
            "or the 0.19.2 series"
        )
    for kind, coeff in zip(load_balancing_types(config), coefficients(config), strict=True):
        if kind == _GLOBAL and coeff and coeff > 0:
            raise ValueError(
                "the global balance loss (global_aux_loss) accumulates routing statistics over the "
                "micro-batches seen so far, so its gradient depends on how the step is cut and it "
                "cannot be normalized exactly: use --moe-router-load-balancing-type seq_aux_loss "
                "(DeepSeek-V3's sequence-wise loss, exact) or aux_loss (per micro-batch, weighted by "
                "its tokens)"
            )


def check_packed_forward(config, packed_seq_params, padding_mask) -> None:
    """Refuse, before a model forward in an exact step, what the router losses cannot hold exactly:
    a padding mask, seq_aux_loss on packed rows (see the module's docstring)."""
    if not active(config):
        return
    if padding_mask is not None:
        raise ValueError("a padding_mask with MoE router losses in an exact step is refused: the step's routed "
                         "tokens T count every input position, the MTP depths roll the mask onto the wrong "
                         "positions and under context parallelism each rank's balance loss is weighted by its own "
                         "unpadded count; pass no padding_mask (padding is then routed and counted as input "
                         "positions)")
    if packed_seq_params is None:
        return
    kinds = dict(zip(load_balancing_types(config), coefficients(config), strict=True))
    if kinds.get("seq_aux_loss"):
        raise ValueError("seq_aux_loss on packed rows (PackedSeqParams) is refused: megatron-core's router takes "
                         "the whole packed row as one sequence, not each packed sequence; use "
                         "--moe-router-load-balancing-type aux_loss (per micro-batch, exact on packed rows)")


def computes_losses(router) -> bool:
    """Whether `router` computes its losses in this forward pass: upstream's condition
    (training, with gradients), or in eval mode inside an evaluation that reports them."""
    if router.training:
        return torch.is_grad_enabled()
    step = step_of(router)
    return step is not None and step.router_losses_in_evaluation


def scale_func(config, routed_tokens: int, grad_scale_func=None):
    """A ``moe_grad_scale_func`` for one step: the optimizer's loss scale over T (the loss
    scale of ``grad_scale_func`` if given, else of the config's at the time it is applied)."""
    if not compat.has_moe_grad_scale_func(config):
        raise ValueError("MoE router losses in an exact step need megatron-core's moe_grad_scale_func "
                         "(0.19 and later); this build has none: use the 0.19.2 series")
    if routed_tokens < 1:
        raise ValueError(f"a step with router losses routes at least one token, got T = {routed_tokens}")
    def scale():  # the loss scale of the moment (fp16's changes between steps)
        one = torch.ones(1, device=compute_device.current_device())
        loss_scale = grad_scale_func or config.grad_scale_func
        return (loss_scale(one) if loss_scale is not None else one) / routed_tokens

    return scale
