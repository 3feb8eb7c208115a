# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The MTP loss branch of GPTModel's postprocess: per-depth logits, losses and statistics.

Upstream computes the same per-position losses; this version also derives labels when
none are given (0.16.1 cannot), isolates the output weight under ``mtp_detach_heads``,
records exact statistics (chain acceptance included), and attaches each depth's loss as a
raw, masked sum scaled by lambda / D so that the step's normalization can be exact (spec
section 4; upstream 0.19 rescales each depth by its local count, issue #7452).

By default (``mtp_sparse_loss``) the logits, losses and statistics of all depths come from
megatron.core.fork.mtp.sparse_loss: only the positions that count are projected, in
chunks. Without it the cross-entropy loop below projects every position, as upstream does,
and the statistics come from the chunked projection at every row; a draft objective (kl,
tv, e2e_tv) takes the chunked projection at every row. Where the branch reads the main head
at t + k (a draft objective, or a step that reports the acceptances) it reads it from the
main head's own logits, which it then computes for the caller (``main_head_output``).
"""

import torch
import torch.distributed as dist
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

from megatron.core.fork.mtp import isolation, last_depth
from megatron.core.fork.mtp.forward_settings import ForwardSettings
from megatron.core.fork.mtp.sparse_loss import rows_needed, sparse_depth_losses
from megatron.core.fork.mtp.supervision import depth_targets, labels_and_mask
from megatron.core.fork.runtime import compat


def rows_of_last_depth(model, input_ids, labels, loss_mask, packed_seq_params=None):
    """Around the MTP block's forward: the last depth's MLP runs only where the sparse loss
    reads h^D (megatron.core.fork.mtp.last_depth), when the loss is computed on this stage."""
    depths, rows = model.config.mtp_num_layers or 0, None
    if depths and model.post_process and ForwardSettings.sparse_loss(model.config) \
            and last_depth.rows_can_be_taken(model.config):
        supervised = labels_and_mask(model, input_ids, labels, loss_mask, packed_seq_params)
        if supervised is not None:
            *_, (_, _, last_mask) = depth_targets(*supervised, depths, packed_seq_params, model.cp_group)
            rows = rows_needed([last_mask])[0]
    return last_depth.taking_rows(rows)


class _LossScaler(MTPLossAutoScaler):
    """Upstream's MTPLossAutoScaler (the schedule's scale in the backward), whose output is a new
    tensor over the carrier's storage rather than the carrier returned as it is: when the
    carrier is the main head's logits, the main loss's cross-entropy works on them in place,
    which autograd forbids on an input a custom Function returns."""

    @staticmethod
    def forward(ctx, output, mtp_loss):
        ctx.save_for_backward(mtp_loss)
        return output.detach()


class _SeededLoss(torch.autograd.Function):
    """Attaches a loss to a tensor with the backward seed 1: its weight already holds the whole
    seed (a framework's step), not MTPLossAutoScaler's scale, which the framework's schedule sets.
    A new tensor over the carrier's storage, as _LossScaler's."""

    @staticmethod
    def forward(ctx, output, loss):
        ctx.save_for_backward(loss)
        return output.detach()

    @staticmethod
    def backward(ctx, grad_output):
        (loss,) = ctx.saved_tensors
        return grad_output, torch.ones_like(loss)


def _attach(settings: ForwardSettings, output, weighted_loss):
    if settings.seeds_whole:
        return _SeededLoss.apply(output, weighted_loss)
    return _LossScaler.apply(output, weighted_loss)


def main_head_output(model, settings: ForwardSettings, main_hidden, shared_output_weight, runtime_gather_output,
                     reusable: bool):
    """The main head's output layer at every position, (logits, bias), computed here when the MTP
    branch reads p^k_t from its logits (megatron.core.fork.mtp.draft_objectives) instead of
    projecting h^0 at t + k again; the caller's loss then takes these logits. None (the caller
    projects as upstream does, and the branch projects h^0 at t + k) when the branch does not
    read p^k_t, or the main loss does not project every position (``sparse_lm_loss``;
    ``reusable`` False: an output processor), or the logits would not be the vocabulary shard
    the MTP logits are (gathered at run time), or the rows at t + k may sit on another
    context-parallel rank."""
    config, layer = model.config, model.output_layer
    gathers = runtime_gather_output if runtime_gather_output is not None else getattr(layer, "gather_output", False)
    sharded = gathers and dist.get_world_size(model.pg_collection.tp) > 1
    split_sequence = model.cp_group is not None and dist.get_world_size(model.cp_group) > 1
    if not reusable or config.sparse_lm_loss or sharded or split_sequence or not settings.reads_main_head:
        return None
    return layer(main_hidden, weight=shared_output_weight, runtime_gather_output=runtime_gather_output)


def attach_mtp_losses(model, hidden_states, input_ids, labels, loss_mask, shared_output_weight,
                      packed_seq_params=None, runtime_gather_output=None, reuse_main_logits=True):
    """Split [h^0; h^1..h^D] and attach every depth's loss. Returns (h^0, the main head's output
    or None): where the MTP branch read p^k_t from the main head's logits (``main_head_output``)
    the losses are attached to those logits, which the caller's main loss must take, else to h^0,
    which the caller projects."""
    config = model.config
    depths = config.mtp_num_layers or 0
    if depths == 0:
        return hidden_states, None  # mtp_num_layers=0: no MTP, as upstream
    settings = ForwardSettings.of(model)  # what this forward computes, and the step it answers to
    try:
        isolation.refuse_trainable_output_bias(model)
    except ValueError as refusal:  # found on the MTP stage alone: refused on every rank by the step
        settings.refuse(str(refusal))
    main_hidden, *hidden_by_depth = torch.chunk(hidden_states, 1 + depths, dim=0)
    supervised = labels_and_mask(model, input_ids, labels, loss_mask, packed_seq_params)
    if supervised is None:
        return main_hidden, None  # generation: nothing to supervise
    if loss_mask is None and settings.exact:
        # Upstream would train every position (padding and prompts included) and count them all in N_tok.
        settings.refuse("an MTP forward inside an exact step needs a loss_mask (without one every position, "
                        "padding and prompt included, would be trained and counted): pass loss_mask=... to the "
                        "model's forward")
    labels, loss_mask = supervised
    weight = isolation.output_weight(model, shared_output_weight)
    loss_weight = settings.mtp_loss_weight(config, loss_mask.sum())
    targets = list(depth_targets(labels, loss_mask, depths, packed_seq_params, model.cp_group))
    head = main_head_output(model, settings, main_hidden, shared_output_weight, runtime_gather_output,
                            reuse_main_logits)
    main_logits = None if head is None else head[0]
    carrier = main_hidden if head is None else main_logits  # what the losses attach to
    if settings.chunked:
        losses = [sparse_depth_losses(model, settings, main_hidden, hidden_by_depth, targets, weight,
                                      packed_seq_params, main_logits)]
    else:
        with torch.no_grad():  # the statistics, recorded as the sparse loss records them, at every row
            sparse_depth_losses(model, settings, main_hidden, hidden_by_depth, targets, weight, packed_seq_params,
                                main_logits)
        losses = dense_depth_losses(model, hidden_by_depth, targets, weight, runtime_gather_output)
    for loss in losses:
        carrier = _attach(settings, carrier, loss_weight * loss)
    return (carrier, None) if head is None else (main_hidden, (carrier, head[1]))


def dense_depth_losses(model, hidden_by_depth, targets, weight, runtime_gather_output) -> list:
    """Each depth's per-token cross-entropy [b, s] times its mask, as upstream computes it (every
    position projected), one depth's logits alive at a time."""
    losses = []
    for hidden, (_, labels_k, mask_k) in zip(hidden_by_depth, targets, strict=True):
        logits, _ = model.output_layer(hidden, weight=weight, runtime_gather_output=runtime_gather_output)
        losses.append(model.compute_language_model_loss(labels_k, compat.scale_logits(model, logits)) * mask_k)
        del logits
    return losses
