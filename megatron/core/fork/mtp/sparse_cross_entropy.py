# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Vocabulary-parallel cross-entropy at chosen rows only, in chunks of bounded memory.

Upstream projects every position onto the vocabulary and masks the cross-entropy
afterwards: with most positions masked (RL and SFT prompts, padding, dropped samples) most
of that work is thrown away, and the backward keeps an [s, b, vocab] fp32 softmax alive.
Here the caller picks the rows that count; they are projected and reduced in chunks of
``sparse_loss_chunk_size``. Each chunk's logits give the cross-entropy, the top-1
prediction and, already in the forward, the gradients of the chunk's rows and of the output
weight (softmax minus one-hot, as Liger's and Apple's fused losses do); then they are
freed. At most one chunk of logits exists at any time, and the backward only scales what
the forward kept: no projection is computed twice.

Row i's gradient is exact for any incoming gradient (it depends on row i's loss only).
The weight's gradient is summed over rows in the forward, so it needs the weighting of the
rows' losses up front: the caller gives ``row_weights`` and promises a loss of the form
factor * sum_i row_weights[i] * CE_i (a masked sum, normalized by anything); the backward
checks that the incoming gradient has that form and raises otherwise.

Under tensor parallelism each rank holds a vocabulary shard: the maximum and argmax are
gathered (ties resolve to the lowest index, as torch.argmax on gathered logits), the
exponential sums and target logits all-reduced; the row gradients a rank computes are
partial sums over its shard, which the region mappings of ``vocab_parallel_rows`` reduce
in the backward (an all-reduce, or the reduce-scatter of the sequence-parallel gather).

Users: the MTP loss (``mtp_sparse_loss``, megatron.core.fork.mtp.sparse_loss) and the
main head's loss (``sparse_lm_loss``, below).
"""

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from megatron.core.fork.mtp.chunk_buffers import ChunkBuffers, product
from megatron.core.fork.mtp.draft_objectives import DraftTargets, chunk_terms
from megatron.core.fork.mtp.statistics import vocab_parallel_max
from megatron.core.fork.runtime import compat

# Relative deviation of the incoming gradient from factor * row_weights that the backward
# accepts (autograd's own products differ from it by float round-off only).
WEIGHTING_TOLERANCE = 1e-4


class ChunkedVocabParallelCrossEntropy(torch.autograd.Function):
    """Per-row CE(rows_i @ weight^T * scale, labels_i) and argmax, for a loss
    factor * sum_i row_weights[i] * CE_i.

    rows [n, h]; weight [vocab shard, h]; labels [n] (full-vocabulary ids); row_weights [n].
    Returns (per-row CE [n] in at least fp32, per-row argmax [n], per-row alpha [n], per-row
    beta [n]; the last three without gradient).

    With ``draft`` (MTP rows; megatron.core.fork.mtp.draft_objectives) each chunk also
    reads (or projects) the main head's logits at t + k and gives the sampled acceptance alpha and the
    greedy-draft acceptance beta (p at the argmax the chunk already takes); for a
    draft objective other than ``ce`` the first output is that objective's per-row value
    (KL, or alpha) with its own gradient, exact for any incoming per-row gradient (the
    weight, detached under the isolation these objectives need, takes none). Without it the
    alpha and beta outputs are empty.
    """

    @staticmethod
    def forward(ctx, rows, weight, labels, row_weights, chunk_size: int, tp_group, logit_scale: float,
                compute_grads: bool, fuse_weight_grad_into_main_grad: bool, draft: Optional[DraftTargets] = None):
        n, shard = rows.size(0), weight.size(0)
        tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        vocab_start = dist.get_rank(tp_group) * shard if tp_size > 1 else 0
        objective = "ce" if draft is None else draft.objective
        want_rows = compute_grads and ctx.needs_input_grad[0]
        want_weight = compute_grads and ctx.needs_input_grad[1]
        if want_weight and objective != "ce":
            raise ValueError(f"the MTP draft objective {objective!r} trains the heads toward the main head's "
                             "distribution and needs isolation: add --mtp-detach-heads (mtp_detach_heads=True)")
        # Softmax and kept gradients in at least fp32 (upstream's cross-entropy is fp32; the
        # fp16 loss scale applied in the backward must not meet underflowed values).
        precision = torch.promote_types(weight.dtype, torch.float32)
        row_weights = row_weights.to(precision)
        grad_rows = rows.new_zeros(rows.shape, dtype=precision) if want_rows else None
        grad_weight = weight.new_zeros(weight.shape, dtype=precision) if want_weight else None
        ce = rows.new_empty(n, dtype=precision)
        predicted = torch.empty(n, dtype=torch.long, device=rows.device)
        alpha = rows.new_empty(n if draft is not None else 0, dtype=precision)
        beta = torch.empty_like(alpha)
        buffers = ChunkBuffers(min(chunk_size, n), shard, precision, rows.device)  # every chunk's
        for start in range(0, n, chunk_size):
            chunk = slice(start, min(start + chunk_size, n))
            x = rows[chunk]
            logits = product(x, weight.t(), buffers.take("logits", x.size(0)))
            if logit_scale != 1.0:
                logits.mul_(logit_scale)
            best, predicted[chunk] = vocab_parallel_max(logits, tp_group)
            if draft is not None:
                target_logits = draft.target_logits(chunk, weight, buffers.take("target", x.size(0)))
                if logit_scale != 1.0:
                    target_logits.mul_(logit_scale)
                value, alpha[chunk], beta[chunk], grad_logits = chunk_terms(
                    logits, target_logits, draft.temperature, objective, tp_group, want_rows, predicted[chunk],
                    vocab_start, buffers)
                del target_logits
                if objective != "ce":  # the row's value and gradient are the draft objective's
                    ce[chunk] = value
                    if want_rows:
                        if logit_scale != 1.0:
                            grad_logits.mul_(logit_scale)
                        grad_rows[chunk] = torch.matmul(grad_logits.to(weight.dtype), weight)
                    del logits, grad_logits
                    continue
            target = labels[chunk] - vocab_start
            on_rank = (target >= 0) & (target < shard)
            target = torch.where(on_rank, target, torch.zeros_like(target))
            logits.sub_(best.unsqueeze(1))
            target_logit = logits.gather(1, target.unsqueeze(1)).squeeze(1) * on_rank
            logits.exp_()
            sums = torch.stack([logits.sum(dim=1), target_logit])
            if tp_size > 1:
                dist.all_reduce(sums, group=tp_group)
            sum_exp, target_logit = sums
            ce[chunk] = sum_exp.log() - target_logit
            if want_rows or want_weight:
                # dCE/d(raw logits) = scale * (softmax - one-hot(target)), in place.
                logits.div_(sum_exp.unsqueeze(1))
                logits.scatter_add_(1, target.unsqueeze(1), -on_rank.to(precision).unsqueeze(1))
                if logit_scale != 1.0:
                    logits.mul_(logit_scale)
                if want_rows:
                    grad_rows[chunk] = torch.matmul(logits.to(weight.dtype), weight)
                if want_weight:  # (weighting the rows is cheaper than weighting the logits)
                    weighted_x = x * row_weights[chunk].unsqueeze(1).to(x.dtype)
                    grad_weight += torch.matmul(logits.to(weight.dtype).t(), weighted_x)
            del logits
        ctx.save_for_backward(grad_rows, grad_weight, row_weights)
        ctx.rows_dtype, ctx.weight = rows.dtype, weight
        ctx.fuse_weight_grad_into_main_grad = fuse_weight_grad_into_main_grad
        ctx.mark_non_differentiable(predicted, alpha, beta)
        return ce, predicted, alpha, beta

    @staticmethod
    def backward(ctx, grad_ce, _grad_predicted, _grad_alpha, _grad_beta):
        grad_rows, grad_weight, row_weights = ctx.saved_tensors
        d_rows = None if grad_rows is None else (grad_rows * grad_ce.unsqueeze(1)).to(ctx.rows_dtype)
        d_weight = None
        if grad_weight is not None:
            scaled = grad_weight * common_factor(grad_ce.to(row_weights.dtype), row_weights)
            weight = ctx.weight
            if ctx.fuse_weight_grad_into_main_grad:
                # Upstream's output layer with gradient_accumulation_fusion adds its weight
                # gradient to main_grad and flags it, after which DDP ignores param.grad:
                # follow the same protocol or this contribution would be dropped.
                weight.main_grad.add_(scaled.to(weight.main_grad.dtype))
                if hasattr(weight, "grad_added_to_main_grad"):
                    weight.grad_added_to_main_grad = True
            else:
                d_weight = scaled.to(weight.dtype)
        return d_rows, d_weight, None, None, None, None, None, None, None, None


def common_factor(grad: torch.Tensor, row_weights: torch.Tensor) -> torch.Tensor:
    """The factor f with grad = f * row_weights; raises if the loss was weighted otherwise."""
    if grad.numel() == 0:
        return grad.new_zeros(())
    norm = (row_weights * row_weights).sum()
    factor = (grad * row_weights).sum() / norm.clamp(min=torch.finfo(norm.dtype).tiny)
    deviation = (grad - factor * row_weights).abs().max()
    if deviation > WEIGHTING_TOLERANCE * grad.abs().max().clamp(min=torch.finfo(grad.dtype).tiny):
        raise RuntimeError(
            "the sparse cross-entropy's loss must be a multiple of sum(row_weights * CE): the rows' "
            "gradients are not proportional to their weights (the main head's per-token loss must be "
            "summed times the loss_mask given to the model; or turn sparse_lm_loss off)"
        )
    return factor


def full_sequence(hidden: torch.Tensor, config, tp_group) -> torch.Tensor:
    """hidden over the whole sequence [s, b, h] (sequence parallelism holds a shard of it)."""
    if config.sequence_parallel:
        return gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True, group=tp_group)
    return hidden


def vocab_parallel_rows(rows: torch.Tensor, config, tp_group) -> torch.Tensor:
    """Rows entering the vocabulary-parallel projection: their gradients are all-reduced over
    TP in the backward (under sequence parallelism the gather's reduce-scatter does it)."""
    if config.sequence_parallel:
        return rows
    return copy_to_tensor_model_parallel_region(rows, group=tp_group)


def refuse_output_bias(model) -> None:
    if getattr(model.output_layer, "bias", None) is not None:
        raise ValueError(
            "the sparse losses (mtp_sparse_loss, sparse_lm_loss) compute logits without the output layer's bias; "
            "this model has one. Turn them off (--no-mtp-sparse-loss; sparse_lm_loss is off by default)."
        )


def chunked_cross_entropy(model, rows, weight, labels, row_weights, draft: Optional[DraftTargets] = None):
    """ChunkedVocabParallelCrossEntropy with the model's output weight, chunk size, TP group
    and logit scale; rows must have passed vocab_parallel_rows."""
    if weight is None:
        weight = model.output_layer.weight
    fuse = getattr(model.output_layer, "gradient_accumulation_fusion", False) and hasattr(weight, "main_grad")
    return ChunkedVocabParallelCrossEntropy.apply(
        rows, weight, labels, row_weights, model.config.sparse_loss_chunk_size, model.pg_collection.tp,
        compat.logit_multiplier(model), torch.is_grad_enabled(), fuse, draft)


def sparse_lm_loss(model, hidden_states, labels, loss_mask, weight) -> torch.Tensor:
    """The main head's per-token cross-entropy [b, s] (as compute_language_model_loss returns
    it), computed only where loss_mask != 0 and zero elsewhere. For a loss function that sums
    it times that loss_mask (pretrain_gpt's does); another weighting raises in the backward."""
    config, tp_group = model.config, model.pg_collection.tp
    refuse_output_bias(model)
    if loss_mask is None:
        loss_mask = torch.ones_like(labels, dtype=torch.float)
    full = full_sequence(hidden_states, config, tp_group)
    seq, batch = full.shape[:2]
    flat_mask = loss_mask.t().reshape(-1)
    where = (flat_mask != 0).nonzero().squeeze(1)
    rows = vocab_parallel_rows(full.reshape(seq * batch, -1).index_select(0, where), config, tp_group)
    ce, _, _, _ = chunked_cross_entropy(model, rows, weight, labels.t().reshape(-1).index_select(0, where),
                                     flat_mask.index_select(0, where))
    per_token = ce.new_zeros(seq * batch).index_put((where,), ce)
    return per_token.view(seq, batch).t().contiguous()
