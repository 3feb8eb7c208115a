"""The MTP loss at valid positions only, in chunks of bounded memory (``mtp_sparse_loss``).

Upstream projects every position of every depth onto the vocabulary and masks the
cross-entropy afterwards: with most positions masked (RL and SFT prompts, padding,
dropped samples) most of that work is thrown away, and each depth keeps an
[s, b, vocab] fp32 softmax alive for its backward. Here:

- Depth k's rows are the positions valid at depth k, plus the few where only a deeper
  depth is valid: the chain statistic needs depth k's prediction there (loss weight 0).
  They are gathered from h^k; autograd scatters their gradient back.
- The rows of all depths are projected and reduced in chunks of ``mtp_loss_chunk_size``.
  Each chunk's logits give the cross-entropy, the top-1 prediction and already in the
  forward the gradients of the chunk's rows and of the output weight (softmax minus
  one-hot, as Liger's and Apple's fused losses do); then they are freed. At most one
  chunk of logits exists at any time, and the backward only scales what the forward kept:
  no projection is computed twice.
- The Function returns the weighted loss sum, a scalar, so the gradient reaching it is one
  number and scaling the kept gradients by it is exact. All depths share one call, hence
  one buffer for the output weight's gradient (none under isolation: the weight is detached).

Under tensor parallelism each rank holds a vocabulary shard: the maximum and argmax are
gathered (ties resolve to the lowest index, as torch.argmax on gathered logits), the
exponential sums and target logits all-reduced; the row gradients each rank computes are
partial sums over its shard, which the region mappings reduce in the backward (an
all-reduce, or the reduce-scatter of the sequence-parallel gather).
"""

import torch
import torch.distributed as dist

from megatron.core.fork import compat
from megatron.core.fork.mtp.statistics import STEP_STATISTICS, vocab_parallel_max
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)


class ChunkedVocabParallelCrossEntropy(torch.autograd.Function):
    """sum_i w_i * CE(rows_i @ weight^T * scale, labels_i), with per-row CE and argmax.

    rows [n, h]; weight [vocab shard, h]; labels [n] (full-vocabulary ids); row_weights [n].
    Returns (loss sum, per-row CE [n] in at least fp32, per-row argmax [n]); the last two carry
    no gradient.
    """

    @staticmethod
    def forward(ctx, rows, weight, labels, row_weights, chunk_size: int, tp_group, logit_scale: float,
                compute_grads: bool, fuse_weight_grad_into_main_grad: bool):
        n, shard = rows.size(0), weight.size(0)
        tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        vocab_start = dist.get_rank(tp_group) * shard if tp_size > 1 else 0
        want_rows = compute_grads and ctx.needs_input_grad[0]
        want_weight = compute_grads and ctx.needs_input_grad[1]
        # Softmax and kept gradients in at least fp32 (upstream's cross-entropy is fp32; the
        # fp16 loss scale applied in the backward must not meet underflowed values).
        precision = torch.promote_types(weight.dtype, torch.float32)
        grad_rows = rows.new_zeros(rows.shape, dtype=precision) if want_rows else None
        grad_weight = weight.new_zeros(weight.shape, dtype=precision) if want_weight else None
        ce = rows.new_empty(n, dtype=precision)
        predicted = torch.empty(n, dtype=torch.long, device=rows.device)
        for start in range(0, n, chunk_size):
            chunk = slice(start, min(start + chunk_size, n))
            x = rows[chunk]
            logits = torch.matmul(x, weight.t()).to(precision)
            if logit_scale != 1.0:
                logits.mul_(logit_scale)
            best, predicted[chunk] = vocab_parallel_max(logits, tp_group)
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
                # d(w * CE)/d(raw logits) = w * scale * (softmax - one-hot(target)), in place.
                logits.div_(sum_exp.unsqueeze(1))
                logits.scatter_add_(1, target.unsqueeze(1), -on_rank.to(precision).unsqueeze(1))
                logits.mul_((row_weights[chunk].to(precision) * logit_scale).unsqueeze(1))
                grad_logits = logits.to(weight.dtype)
                if want_rows:
                    grad_rows[chunk] = torch.matmul(grad_logits, weight)
                if want_weight:
                    grad_weight += torch.matmul(grad_logits.t(), x)
                del grad_logits
            del logits
        ctx.save_for_backward(grad_rows, grad_weight)
        ctx.rows_dtype, ctx.weight = rows.dtype, weight
        ctx.fuse_weight_grad_into_main_grad = fuse_weight_grad_into_main_grad
        ctx.mark_non_differentiable(ce, predicted)
        return (ce * row_weights.to(precision)).sum(), ce, predicted

    @staticmethod
    def backward(ctx, grad_loss, _grad_ce, _grad_predicted):
        grad_rows, grad_weight = ctx.saved_tensors
        d_rows = None if grad_rows is None else (grad_rows * grad_loss).to(ctx.rows_dtype)
        d_weight = None
        if grad_weight is not None:
            scaled = grad_weight * grad_loss
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
        return d_rows, d_weight, None, None, None, None, None, None, None


def rows_needed(masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per depth, the flat [s, b]-order positions where its prediction is needed: valid at
    that depth or at a deeper one (the chain statistic of depth k reads depths 1..k)."""
    needed, deeper = [], None
    for mask in reversed(masks):
        valid = mask.t().reshape(-1) != 0
        deeper = valid if deeper is None else deeper | valid
        needed.append(deeper.nonzero().squeeze(1))
    return needed[::-1]


def full_sequence(hidden: torch.Tensor, config, tp_group) -> torch.Tensor:
    """h^k over the whole sequence [s, b, h] (sequence parallelism holds a shard of it)."""
    if config.sequence_parallel:
        return gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True, group=tp_group)
    return hidden


def refuse_output_bias(model) -> None:
    if getattr(model.output_layer, "bias", None) is not None:
        raise ValueError(
            "mtp_sparse_loss computes MTP logits without the output layer's bias; this model has one. "
            "Use the dense MTP loss (mtp_sparse_loss=False, --no-mtp-sparse-loss)."
        )


def sparse_depth_losses(model, hidden_by_depth, targets, weight) -> torch.Tensor:
    """sum_k sum_t mask_k[t] * CE_k[t] over all depths (the caller weights it), computed at
    the needed rows only; records every depth's statistics from the same logits.

    hidden_by_depth: h^1..h^D, each [s, b, h] (a sequence shard under sequence
    parallelism); targets: (k, labels_k [b, s], mask_k [b, s]) for k = 1..D; weight: the
    output weight the MTP logits use (detached under isolation).
    """
    config, tp_group = model.config, model.pg_collection.tp
    refuse_output_bias(model)
    if weight is None:
        weight = model.output_layer.weight
    masks = [mask for _, _, mask in targets]
    positions = rows_needed(masks)
    rows, labels, row_weights = [], [], []
    for hidden, (_, labels_k, mask_k), where in zip(hidden_by_depth, targets, positions):
        full = full_sequence(hidden, config, tp_group)
        rows.append(full.reshape(-1, full.size(-1)).index_select(0, where))
        labels.append(labels_k.t().reshape(-1).index_select(0, where))
        row_weights.append(mask_k.t().reshape(-1).index_select(0, where))
    rows = torch.cat(rows)
    if not config.sequence_parallel:
        rows = copy_to_tensor_model_parallel_region(rows, group=tp_group)
    fuse = getattr(model.output_layer, "gradient_accumulation_fusion", False) and hasattr(weight, "main_grad")
    loss, ce, predicted = ChunkedVocabParallelCrossEntropy.apply(
        rows, weight, torch.cat(labels), torch.cat(row_weights), config.mtp_loss_chunk_size,
        tp_group, compat.logit_multiplier(model), torch.is_grad_enabled(), fuse)
    record_statistics(targets, positions, ce, predicted, labels, row_weights)
    return loss


@torch.no_grad()
def record_statistics(targets, positions, ce, predicted, labels, row_weights) -> None:
    depths, chain, offset = len(targets), None, 0
    for (k, _, mask_k), where, labels_k, weights_k in zip(targets, positions, labels, row_weights):
        rows = slice(offset, offset + where.numel())
        offset = rows.stop
        correct = predicted[rows] == labels_k
        correct_everywhere = torch.zeros(mask_k.numel(), dtype=torch.bool, device=correct.device)
        correct_everywhere[where] = correct
        chain = correct_everywhere if chain is None else chain & correct_everywhere
        weights_k = weights_k.float()
        STEP_STATISTICS.add(k, depths, (ce[rows] * weights_k).sum(), mask_k.sum(), (correct * weights_k).sum(),
                            (chain * mask_k.t().reshape(-1)).sum())
