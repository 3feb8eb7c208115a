"""The MTP loss at valid positions only, in chunks of bounded memory (``mtp_sparse_loss``).

Depth k's rows are the positions valid at depth k, plus the few where only a deeper depth
is valid: the chain statistic of a deeper depth needs depth k's prediction there (loss
weight 0). They are gathered from h^k (autograd scatters their gradient back), and the
rows of all depths go through one chunked cross-entropy
(megatron.core.fork.sparse_cross_entropy), so all depths share one buffer for the output
weight's gradient (none under isolation: the weight is detached). The statistics come from
the same chunks' logits.
"""

import torch

from megatron.core.fork.mtp.statistics import STEP_STATISTICS
from megatron.core.fork.sparse_cross_entropy import (
    chunked_cross_entropy,
    full_sequence,
    refuse_output_bias,
    vocab_parallel_rows,
)


def rows_needed(masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per depth, the flat [s, b]-order positions where its prediction is needed: valid at
    that depth or at a deeper one (the chain statistic of depth k reads depths 1..k)."""
    needed, deeper = [], None
    for mask in reversed(masks):
        valid = mask.t().reshape(-1) != 0
        deeper = valid if deeper is None else deeper | valid
        needed.append(deeper.nonzero().squeeze(1))
    return needed[::-1]


def sparse_depth_losses(model, hidden_by_depth, targets, weight) -> torch.Tensor:
    """sum_k sum_t mask_k[t] * CE_k[t] over all depths (the caller weights it), computed at
    the needed rows only; records every depth's statistics from the same logits.

    hidden_by_depth: h^1..h^D, each [s, b, h] (a sequence shard under sequence
    parallelism); targets: (k, labels_k [b, s], mask_k [b, s]) for k = 1..D; weight: the
    output weight the MTP logits use (detached under isolation; None: the output layer's).
    """
    config, tp_group = model.config, model.pg_collection.tp
    refuse_output_bias(model)
    positions = rows_needed([mask for _, _, mask in targets])
    rows, labels, row_weights = [], [], []
    for hidden, (_, labels_k, mask_k), where in zip(hidden_by_depth, targets, positions):
        full = full_sequence(hidden, config, tp_group)
        rows.append(full.reshape(-1, full.size(-1)).index_select(0, where))
        labels.append(labels_k.t().reshape(-1).index_select(0, where))
        row_weights.append(mask_k.t().reshape(-1).index_select(0, where).float())
    all_weights = torch.cat(row_weights)
    ce, predicted = chunked_cross_entropy(model, vocab_parallel_rows(torch.cat(rows), config, tp_group), weight,
                                          torch.cat(labels), all_weights)
    record_statistics(targets, positions, ce.detach(), predicted, labels, row_weights)
    return (ce * all_weights.to(ce.dtype)).sum()


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
        STEP_STATISTICS.add(k, depths, (ce[rows] * weights_k).sum(), mask_k.sum(), (correct * weights_k).sum(),
                            (chain * mask_k.t().reshape(-1)).sum())
