# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The MTP loss at valid positions only, in chunks of bounded memory (``mtp_sparse_loss``).

Depth k's rows are the positions valid at depth k, plus the few where only a deeper depth
is valid: the chain statistic of a deeper depth needs depth k's prediction there (loss
weight 0). They are gathered from h^k (autograd scatters their gradient back), and the
rows of all depths go through one chunked cross-entropy
(megatron.core.fork.mtp.sparse_cross_entropy), so all depths share one buffer for the output
weight's gradient (none under isolation: the weight is detached). The statistics come from
the same chunks' logits.
"""

import torch

from megatron.core.fork.mtp.draft_objectives import DraftTargets, depth_terms, objective_sum
from megatron.core.fork.mtp.sparse_cross_entropy import (
    chunked_cross_entropy,
    full_sequence,
    refuse_output_bias,
    vocab_parallel_rows,
)
from megatron.core.fork.mtp.supervision import rolled_by_depth


def rows_needed(masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per depth, the flat [s, b]-order positions where its prediction is needed: valid at
    that depth or at a deeper one (the chain statistic of depth k reads depths 1..k)."""
    needed, deeper = [], None
    for mask in reversed(masks):
        valid = mask.t().reshape(-1) != 0
        deeper = valid if deeper is None else deeper | valid
        needed.append(deeper.nonzero().squeeze(1))
    return needed[::-1]


def every_row(masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per depth, every flat position (the dense MTP loss projects them all)."""
    return [torch.arange(mask.numel(), device=mask.device) for mask in masks]


def flat(tensor: torch.Tensor) -> torch.Tensor:
    """[b, s] -> the flat [s, b] order of the hidden states' rows."""
    return tensor.t().reshape(-1)


def sparse_depth_losses(model, settings, main_hidden, hidden_by_depth, targets, weight, packed_seq_params=None,
                        main_logits=None) -> torch.Tensor:
    """sum_k S_k over all depths (the caller weights it by lambda / D and the normalization)
    for the forward's objective (megatron.core.fork.mtp.draft_objectives), computed at each
    depth's needed rows (``settings.sparse``) or at every row; records every depth's
    statistics, the sampled and greedy-draft acceptances included where the forward reads the
    main head at t + k, from the same chunks' logits.

    settings: the forward's (forward_settings.ForwardSettings); main_hidden: h^0 [s, b, h],
    hidden_by_depth: h^1..h^D, each a sequence shard under
    sequence parallelism; targets: (k, labels_k [b, s], mask_k [b, s]) for k = 1..D; weight:
    the output weight the MTP logits use (detached under isolation; None: the output layer's);
    main_logits: the main head's unscaled logits [s, b, vocabulary shard] over the whole
    sequence, from which p^k_t is read (None: projected again from h^0 at t + k).
    """
    config, tp_group = model.config, model.pg_collection.tp
    refuse_output_bias(model)
    masks = [mask for _, _, mask in targets]
    positions = (rows_needed if settings.sparse else every_row)(masks)
    rows, labels, row_weights = [], [], []
    for hidden, (_, labels_k, mask_k), where in zip(hidden_by_depth, targets, positions, strict=True):
        full = full_sequence(hidden, config, tp_group)
        rows.append(full.reshape(-1, full.size(-1)).index_select(0, where))
        labels.append(flat(labels_k).index_select(0, where))
        row_weights.append(flat(mask_k).index_select(0, where).float())
    draft_rows = vocab_parallel_rows(torch.cat(rows), config, tp_group)
    draft = draft_targets(model, settings, main_hidden, main_logits, positions, packed_seq_params, draft_rows.dtype)
    value, predicted, alpha, beta = chunked_cross_entropy(model, draft_rows, weight, torch.cat(labels),
                                                          torch.cat(row_weights), draft)
    values = list(value.split([where.numel() for where in positions]))
    chain = torch.stack([flat(mask) != 0 for mask in masks]).all(dim=0)
    record_statistics(settings.statistics, settings.objective, targets, positions, values, predicted,
                      (alpha, beta) if draft is not None else None, labels, row_weights)
    return objective_sum(settings.objective, values, row_weights, positions, chain)


def draft_targets(model, settings, main_hidden, main_logits, positions, packed_seq_params, dtype):
    """The main head at t + k for every draft row, depth by depth in ``positions``' order
    (DraftTargets), or None where this forward does not read it (``settings.reads_main_head``).
    From the main head's logits where given: each row's position t + k, rolled inside its
    sequence; else h^0's rows at t + k (exact across context-parallel ranks), projected in the
    chunks."""
    if not settings.reads_main_head:
        return None
    if main_logits is not None:
        seq, batch = main_logits.shape[:2]
        grid = torch.arange(seq * batch, device=main_logits.device).view(seq, batch, 1)
        rolled = rolled_by_depth(grid, len(positions), packed_seq_params)
    else:
        main_full = full_sequence(main_hidden.detach(), model.config, model.pg_collection.tp)
        rolled = rolled_by_depth(main_full, len(positions), packed_seq_params, model.cp_group)
    picked = torch.cat([at_k.reshape(-1, at_k.size(-1)).index_select(0, where)
                        for at_k, where in zip(rolled, positions, strict=True)])
    if main_logits is not None:
        return DraftTargets(settings.temperature, settings.objective,
                            logits=main_logits.detach().reshape(-1, main_logits.size(-1)), index=picked.squeeze(1))
    return DraftTargets(settings.temperature, settings.objective, rows=picked.to(dtype))


@torch.no_grad()
def record_statistics(statistics, objective, targets, positions, values, predicted, acceptances, labels,
                      row_weights) -> None:
    """Every depth's sums into `statistics` (megatron.core.fork.mtp.statistics: the forward's step's,
    or the plain forwards' record) from the rows' values, argmax
    predictions and (alpha, beta) (None: not measured); chains are products over depths 1..k
    at each position, as an engine's chained drafts are accepted."""
    depths, every_position = len(targets), targets[0][2].numel()
    lengths = [where.numel() for where in positions]

    def aligned(per_row):  # [D, every position], 0 where a depth has no row
        return torch.stack([piece.new_zeros(every_position, dtype=piece.dtype).index_put((where,), piece)
                            for piece, where in zip(per_row, positions, strict=True)])

    correct = aligned([p == l for p, l in zip(predicted.split(lengths), labels, strict=True)])
    chain_correct = torch.cumprod(correct.long(), dim=0)
    if acceptances is not None:
        sampled, greedy = (aligned(list(rates.float().split(lengths))) for rates in acceptances)
    else:  # not measured (ForwardSettings.reads_main_head): counted at no position, which the metrics leave out
        sampled = greedy = torch.zeros(correct.shape, device=correct.device)
    sampled_chain, greedy_chain = torch.cumprod(sampled, dim=0), torch.cumprod(greedy, dim=0)
    if objective == "e2e_tv":  # the depth's prefix term, at its rows
        terms = [1.0 - prefix.index_select(0, where) for prefix, where in zip(sampled_chain, positions)]
    else:
        terms = depth_terms(objective, values)
    measured = 1.0 if acceptances is not None else 0.0  # the count of positions the acceptances cover
    for (k, _, mask_k), where, term, weights_k in zip(targets, positions, terms, row_weights, strict=True):
        mask = flat(mask_k)
        statistics.add(k, depths, (term.float() * weights_k).sum(), mask_k.sum(), (correct[k - 1] * mask).sum(),
                            (chain_correct[k - 1] * mask).sum(), (sampled[k - 1] * mask).sum(),
                            (sampled_chain[k - 1] * mask).sum(), measured * mask_k.sum(),
                            (greedy[k - 1] * mask).sum(), (greedy_chain[k - 1] * mask).sum())
