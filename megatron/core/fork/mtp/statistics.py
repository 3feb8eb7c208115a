"""Exact per-depth MTP statistics (spec section 7), kept as sums so they reduce exactly.

For each depth k, over valid depth-k positions: the raw cross-entropy sum S_k, the
valid count M_k, the top-1 correct count, and the chain-correct count (predictions at
depths 1..k all correct at that position: a k-token draft fully accepted). Sums add
across micro-batches, chunks and data-parallel ranks; ratios are taken only at the end.
A prediction at depth j < k counts as correct when it equals its target token, whether
or not that target is itself supervised (the target token exists whenever depth k's does).
"""

import torch
import torch.distributed as dist

from megatron.core.fork import device as compute_device

CE_SUM, VALID, CORRECT, CHAIN_CORRECT = range(4)
FIELDS = 4


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


def vocab_parallel_argmax(logits: torch.Tensor, tp_group) -> torch.Tensor:
    """argmax over the full vocabulary of logits split over tensor-parallel ranks (last dim)."""
    return vocab_parallel_max(logits.float(), tp_group)[1]


class MTPStatistics:
    """Per-depth sums for one training step; reset it when a step begins."""

    def __init__(self):
        self.sums = None

    def reset(self) -> None:
        self.sums = None

    def add(self, depth: int, depths: int, ce_sum, valid, correct, chain_correct) -> None:
        if self.sums is None or self.sums.size(0) != depths:
            self.sums = torch.zeros(depths, FIELDS, dtype=torch.float64, device=compute_device.current_device())
        row = torch.stack([ce_sum.detach().double(), valid.detach().double(),
                           correct.detach().double(), chain_correct.detach().double()])
        self.sums[depth - 1] += row

    def local_sums(self) -> torch.Tensor | None:
        """A copy of this rank's sums so far; None if no MTP ran here. (The split step
        reduces them over ranks with its other counts, in one collective.)"""
        return None if self.sums is None else self.sums.clone()


STEP_STATISTICS = MTPStatistics()


def metrics_from_sums(sums: torch.Tensor) -> dict:
    """Named metrics from [D, 4] sums. Expected accepted length counts the verifier's bonus token."""
    metrics = {}
    chain_total = 0.0
    for k in range(sums.size(0)):
        ce_sum, valid, correct, chain = sums[k].tolist()

        def ratio(x, valid=valid):
            return x / valid if valid > 0 else 0.0

        metrics[f"mtp_{k + 1} loss"] = ratio(ce_sum)
        metrics[f"mtp_{k + 1} acceptance"] = ratio(correct)
        metrics[f"mtp_{k + 1} chain acceptance"] = ratio(chain)
        metrics[f"mtp_{k + 1} tokens"] = valid
        chain_total += ratio(chain)
    metrics["expected accepted length (incl. bonus token)"] = 1.0 + chain_total
    return metrics
