# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Exact per-depth MTP statistics (spec sections 7 and 12), kept as sums so they reduce exactly.

For each depth k, over valid depth-k positions: the objective's sum S_k (cross-entropy
for ``ce``; the depth's term of the draft objective otherwise, megatron.core.fork.mtp.
draft_objectives), the valid count M_k, the top-1 correct count, the chain-correct count
(predictions at depths 1..k all correct at that position: a k-token draft fully accepted),
and, for sampled drafts, the sum of alpha^k_t = sum_v min(p, q) (what a rejection sampler
accepts at depth k given depths < k accepted) and of the chain product
prod_{i<=k} alpha^i_t (a k-token sampled draft fully accepted), the same two for greedy
drafts (spec section 12.1: beta^k_t = p(argmax q), what a rejection sampler accepts of a draft
d = argmax q taken as one-hot, and prod_{i<=k} beta^i_t), and the count of valid positions where
these four were measured (the metric projections, the main head at t + k, run only in forwards that
report them: forward_settings.ForwardSettings). Sums add across
micro-batches, chunks and data-parallel ranks; ratios are taken only at the end. A
prediction at depth j < k counts as correct when it equals its target token, whether or
not that target is itself supervised (the target token exists whenever depth k's does).
"""

import contextlib

import torch
import torch.distributed as dist

from megatron.core.fork.runtime import device as compute_device

(CE_SUM, VALID, CORRECT, CHAIN_CORRECT, SAMPLED_ACCEPTED, SAMPLED_CHAIN_ACCEPTED, MEASURED, GREEDY_ACCEPTED,
 GREEDY_CHAIN_ACCEPTED) = range(9)
FIELDS = 9
COUNT_FIELDS = (VALID, CORRECT, CHAIN_CORRECT, MEASURED)  # integers: they reduce exactly


def vocab_parallel_max(logits: torch.Tensor, tp_group) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, argmax) over the full vocabulary of float logits split over tensor-parallel
    ranks (last dim), as torch.max on the gathered logits: ties resolve to the lowest index."""
    local_max, local_index = logits.max(dim=-1)
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    if tp_size == 1:
        return local_max, local_index
    global_index = local_index + dist.get_rank(tp_group) * logits.size(-1)
    # One collective: float64 holds every float32 maximum and every vocabulary index exactly.
    pairs = torch.stack([local_max.double(), global_index.double()])
    gathered = [torch.empty_like(pairs) for _ in range(tp_size)]
    dist.all_gather(gathered, pairs, group=tp_group)
    maxima, indices = torch.stack(gathered).unbind(dim=1)
    best = maxima.max(dim=0).values
    candidates = torch.where(maxima == best, indices, torch.full_like(indices, float("inf")))
    return best.to(logits.dtype), candidates.min(dim=0).values.long()


class MTPStatistics:
    """Per-depth sums of forwards: a running step's (megatron.core.fork.mtp.step.running, its own
    record from the start of the step) or the plain forwards' (``STEP_STATISTICS``: forwards of a
    model no step is bound to). ``reporting``: whether plain forwards measure the metrics that need
    a projection of their own (a step measures them when built with ``metrics=True``). Off by
    default, so that a library forward pays for them only when its caller reads them:
    ``report_metrics()`` around plain forwards, and the trainer's evaluations."""

    def __init__(self):
        self.sums = None
        self.reporting = False

    @contextlib.contextmanager
    def report_metrics(self, on: bool = True):
        """Forwards inside measure the metric projections (``on``) or skip them; the setting
        before is restored after."""
        before, self.reporting = self.reporting, on
        try:
            yield self
        finally:
            self.reporting = before

    def reset(self) -> None:
        self.sums = None

    def add(self, depth: int, depths: int, ce_sum, valid, correct, chain_correct, sampled_accepted,
            sampled_chain_accepted, measured, greedy_accepted, greedy_chain_accepted) -> None:
        if self.sums is None or self.sums.size(0) != depths:
            self.sums = torch.zeros(depths, FIELDS, dtype=torch.float64, device=compute_device.current_device())
        row = torch.stack([value.detach().double() for value in (
            ce_sum, valid, correct, chain_correct, sampled_accepted, sampled_chain_accepted, measured,
            greedy_accepted, greedy_chain_accepted)])
        self.sums[depth - 1] += row

    def local_sums(self) -> torch.Tensor | None:
        """A copy of this rank's sums so far; None if no MTP ran here. (A step reduces its own
        over ranks with its other counts, in one collective.)"""
        return None if self.sums is None else self.sums.clone()


STEP_STATISTICS = MTPStatistics()  # the plain forwards' record (a public name, kept from before steps had their own)


EXPECTED_LENGTH = "expected accepted length (incl. bonus token)"
EXPECTED_LENGTH_SAMPLING = "expected accepted length (sampling)"
EXPECTED_LENGTH_GREEDY = "expected accepted length (greedy drafts)"


def metrics_from_sums(sums: torch.Tensor) -> dict:
    """Named metrics from [D, FIELDS] sums. Every expected accepted length counts the
    verifier's bonus token. The sampled and greedy-draft ones are ratios over the positions where
    they were measured; a depth with valid positions none of which was measured leaves them out
    (unknown), and so does a table measured nowhere (mtp_sampled_acceptance off, or no step
    reported them)."""
    metrics = {}
    chain_total = sampled_chain_total = greedy_chain_total = 0.0
    any_measured = bool((sums[:, MEASURED] > 0).any())
    for k in range(sums.size(0)):
        ce_sum, valid, correct, chain, sampled, sampled_chain, measured, greedy, greedy_chain = sums[k].tolist()

        def ratio(x, valid=valid):
            return x / valid if valid > 0 else 0.0

        metrics[f"mtp_{k + 1} loss"] = ratio(ce_sum)
        metrics[f"mtp_{k + 1} acceptance"] = ratio(correct)
        metrics[f"mtp_{k + 1} chain acceptance"] = ratio(chain)
        if measured > 0 or (any_measured and valid == 0):
            metrics[f"mtp_{k + 1} sampled acceptance"] = ratio(sampled, measured)
            metrics[f"mtp_{k + 1} greedy-draft acceptance"] = ratio(greedy, measured)
            sampled_chain_total += ratio(sampled_chain, measured)
            greedy_chain_total += ratio(greedy_chain, measured)
        else:  # unknown
            sampled_chain_total = greedy_chain_total = float("nan")
        metrics[f"mtp_{k + 1} tokens"] = valid
        chain_total += ratio(chain)
    metrics[EXPECTED_LENGTH] = 1.0 + chain_total
    if sampled_chain_total == sampled_chain_total:
        metrics[EXPECTED_LENGTH_SAMPLING] = 1.0 + sampled_chain_total
    if greedy_chain_total == greedy_chain_total:
        metrics[EXPECTED_LENGTH_GREEDY] = 1.0 + greedy_chain_total
    return metrics


def widened(sums: torch.Tensor | None) -> torch.Tensor | None:
    """Sums saved by an older version in today's fields: without the sampled fields ([D, 4]), or
    with them but without the greedy-draft fields and the measured count ([D, 6]), they were
    measured at no position (the greedy-draft acceptance of those steps is unknown, and the two
    are counted over the same positions). A resumed run's sampled and greedy-draft metrics then
    cover the steps that measured them, and every other metric is as before."""
    if sums is None or sums.size(1) == FIELDS:
        return sums
    return torch.cat([sums[:, :SAMPLED_ACCEPTED], sums.new_zeros(sums.size(0), FIELDS - SAMPLED_ACCEPTED)], dim=1)
