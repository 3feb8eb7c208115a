# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Draft objectives for sampled rollouts (spec section 12): ``kl``, ``tv`` and ``e2e_tv``
beside ``ce``, and the sampled and greedy-draft acceptances every objective reports.

For depth k at position t (``mtp_loss_type``, ``mtp_draft_temperature`` tau):

    p^k_t = softmax(z^0_{t+k} / tau)   the main head at t + k, a target (always detached)
    q^k_t = softmax(z^k_t / tau)       depth k's draft distribution
    alpha^k_t = sum_v min(p, q)        what a rejection sampler accepts (drafts sampled from q)
    beta^k_t = p(argmax_v q)           what it accepts of greedy drafts (spec section 12.1)

z^0_{t+k} is the main head's own logit row at t + k: the main loss projects every position,
and GPTModel's postprocess hands those logits to the MTP branch
(megatron.core.fork.mtp.loss_branch.main_head_output), which reads each chunk's rows from them
at positions rolled by k inside their sequence (upstream's ``roll_tensor``, which respects
packed segments). Where the main loss does not project every position (``sparse_lm_loss``,
an output processor) or the rows at t + k sit on another context-parallel rank, z^0_{t+k} is
projected again from h^0 rolled by k (megatron.core.fork.mtp.supervision.rolled_by_depth,
which this series makes exact across context-parallel ranks) with the detached output
weight, at the same rows as z^k_t. Either way each chunk gathers or projects its own rows: no
[tokens, vocab] tensor outlives its chunk beyond the main loss's own logits.

Under tensor parallelism each rank holds a vocabulary shard; the maxima, exponential sums
and the sums over the vocabulary of min(p, q), of q where q < p, and of p log(p / q) are
all-reduced, so every value is the full vocabulary's. beta reads p at the draft's argmax over the full vocabulary (the
chunk's argmax, vocab_parallel_max: lowest id on ties) on the rank whose shard holds it, summed
in the same all-reduce.

Per row the chunk gives the objective's value (``kl``: KL(p || q); ``tv`` and ``e2e_tv``:
alpha) and its gradient with respect to the row (the output weight takes none: every
draft objective needs isolation, which detaches it). The backward only scales that
gradient by the incoming per-row gradient, so it is exact for any function of the rows'
values: ``e2e_tv``'s products across depths are ordinary autograd over them
(``objective_sum``).

Where this and upstream's open proposal (Megatron-LM #6473 / #6875) differ: there the
cross-entropy objective is named ``cross_entropy`` (accepted here too), only ``e2e_tv``
exists, and e2e_tv's loss is normalized by the count of complete chains; here the
objectives are ``ce | kl | tv | e2e_tv`` and every one is normalized by the step's N_tok
(spec section 12), so the normalization is exact however the step is cut.
"""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron.core.fork.mtp.chunk_buffers import ChunkBuffers, gathered_rows, product

OBJECTIVES = ("ce", "kl", "tv", "e2e_tv")
UPSTREAM_NAMES = {"cross_entropy": "ce"}  # Megatron-LM #6875's name for today's objective


def objective_of(config) -> str:
    """The config's draft objective in this module's names."""
    name = getattr(config, "mtp_loss_type", "ce")
    return UPSTREAM_NAMES.get(name, name)


@dataclass
class DraftTargets:
    """What the chunked projection needs beside the draft rows: tau, the objective, and the
    main head's logits at t + k for each draft row, in the same order. Either ``logits`` (the
    main head's unscaled logits [positions, vocabulary shard], detached) read at ``index`` (each
    row's position t + k), or ``rows`` (h^0 at t + k, detached) projected in the chunk."""

    temperature: float
    objective: str
    rows: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None
    index: Optional[torch.Tensor] = None

    def target_logits(self, chunk: slice, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The chunk's rows of z^0_{t+k} (unscaled, over this rank's vocabulary shard), written into `out`."""
        if self.logits is not None:
            return gathered_rows(self.logits, self.index[chunk], out)
        return product(self.rows[chunk], weight.t(), out)


def _all_reduce(tensor: torch.Tensor, tp_group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(tensor, op=op, group=tp_group)
    return tensor


def _softmaxes(draft_logits: torch.Tensor, target_logits: torch.Tensor, inverse: float, tp_group, logs: bool,
               buffers: ChunkBuffers):
    """(q, p, log q, log p) over the full vocabulary of the logits times ``inverse`` (1 / tau), each
    [n, shard], q and p in the buffers "q" and "p"; draft_logits is only read, target_logits
    overwritten. The logs only when asked (``kl``), else None. One rank: torch's fused softmax (a
    pass fewer than exp(log_softmax)); over TP shards the maxima and the exponential sums are
    all-reduced."""
    q, p = buffers.take("q", draft_logits.size(0)), buffers.take("p", draft_logits.size(0))
    if inverse != 1.0:
        target_logits.mul_(inverse)
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        z_q = draft_logits if inverse == 1.0 else torch.mul(draft_logits, inverse, out=p)  # p's buffer: z_q till p
        if logs:
            log_q, log_p = torch.log_softmax(z_q, dim=1), torch.log_softmax(target_logits, dim=1)
            return torch.exp(log_q, out=q), torch.exp(log_p, out=p), log_q, log_p
        torch.softmax(z_q, 1, out=q)
        return q, torch.softmax(target_logits, 1, out=p), None, None
    z_q, z_p = torch.mul(draft_logits, inverse, out=q), target_logits
    maxima = _all_reduce(torch.stack([z_q.amax(dim=1), z_p.amax(dim=1)]), tp_group, dist.ReduceOp.MAX)
    z_q.sub_(maxima[0].unsqueeze(1))
    z_p.sub_(maxima[1].unsqueeze(1))
    q = z_q.exp() if logs else z_q.exp_()  # with the logs, the shifted logits stay
    p = torch.exp(z_p, out=p)
    sums = _all_reduce(torch.stack([q.sum(dim=1), p.sum(dim=1)]), tp_group)
    q.div_(sums[0].unsqueeze(1))
    p.div_(sums[1].unsqueeze(1))
    if not logs:
        return q, p, None, None
    log_sums = sums.log()
    return q, p, z_q.sub_(log_sums[0].unsqueeze(1)), z_p.sub_(log_sums[1].unsqueeze(1))


def chunk_terms(draft_logits: torch.Tensor, target_logits: torch.Tensor, temperature: float, objective: str,
                tp_group, want_grad: bool, draft_argmax: torch.Tensor, vocab_start: int, buffers: ChunkBuffers):
    """For a chunk of rows' logits over this rank's vocabulary shard (float, scaled as the
    model scales them): (value [n] or None for ``ce``, alpha [n], beta [n], d value /
    d draft_logits [n, shard] or None). ``value`` is KL(p || q) for ``kl`` and alpha for
    ``tv``/``e2e_tv``; beta is p at ``draft_argmax`` (the rows' full-vocabulary argmax of the
    draft logits, which is argmax q; this shard starts at ``vocab_start``). draft_logits is
    only read; target_logits, a buffer of the caller's, is overwritten, and the distributions
    and the gradient are written into ``buffers`` (chunk_buffers.ChunkBuffers): read the
    gradient before the next chunk. Few passes over the chunk and no fresh tensor of its size:
    on the CPU these passes and fresh pages, not the projection, are most of the cost at a
    large vocabulary."""
    inverse = 1.0 / temperature
    q, p, log_q, log_p = _softmaxes(draft_logits, target_logits, inverse, tp_group, objective == "kl", buffers)
    parts = []
    if objective == "kl":  # p log(p / q), in log p's buffer
        parts.append(log_p.sub_(log_q).mul_(p).sum(dim=1))
    del log_q, log_p
    # beta = p(argmax q): read on the rank whose shard holds the argmax, 0 on the others
    local = draft_argmax - vocab_start
    on_rank = (local >= 0) & (local < p.size(1))
    parts.insert(0, p.gather(1, torch.where(on_rank, local, 0).unsqueeze(1)).squeeze(1) * on_rank)
    overlap = torch.minimum(q, p, out=target_logits)  # the main head's logits are read by now: their buffer
    parts.insert(0, overlap.sum(dim=1))
    tv_grad = objective in ("tv", "e2e_tv") and want_grad
    if tv_grad:  # sum_v 1[q < p] q: the overlap where it is q (only there does alpha depend on the draft)
        parts.insert(2, overlap.mul_(q < p).sum(dim=1))
    totals = _all_reduce(torch.stack(parts), tp_group)
    alpha, beta = totals[0], totals[1]
    if objective == "ce":
        return None, alpha, beta, None
    value = totals[-1] if objective == "kl" else alpha
    if not want_grad:
        return value, alpha, beta, None
    if objective == "kl":  # d KL / d z_q = q - p
        grad = q.sub_(p)
    else:  # d alpha / d z_q = q * (1[q < p] - A) = 1[q < p] q - A q, A = sum_v 1[q < p] q
        grad = q.mul_(-totals[2].unsqueeze(1)).add_(overlap)
    return value, alpha, beta, grad.mul_(inverse)


def depth_terms(objective: str, values: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each depth's per-row term of a per-position objective, from the rows' values in depth
    order (``ce``: CE; ``kl``: KL; ``tv``: 1 - alpha). ``e2e_tv`` couples the depths at each
    position: its sum is ``objective_sum``'s, its per-depth prefix the statistics' (sparse_loss)."""
    if objective in ("ce", "kl"):
        return values
    if objective == "tv":
        return [1.0 - value for value in values]
    raise ValueError(f"{objective!r} has no per-row term of its own")


def objective_sum(objective: str, values: list[torch.Tensor], weights: list[torch.Tensor],
                  positions: list[torch.Tensor], chain: torch.Tensor) -> torch.Tensor:
    """The MTP branch's sum over depths of S_k (the caller scales it by lambda / (D N_tok)).

    values, weights, positions: per depth, the rows' values, loss weights (the depth-k mask)
    and flat positions. ``e2e_tv`` (Bebop Eq. 13): lambda * sum_t e_t / N_tok with
    e_t = 1 - (1/D) sum_j prod_{i<=j} alpha^i_t over the anchors in ``chain`` (every flat
    position, True where valid at every depth), returned as D * sum_t e_t so that the common
    lambda / D applies."""
    if len(values) != len(weights) or len(values) != len(positions):
        raise ValueError("one value, weight and position list per MTP depth")
    if objective != "e2e_tv":
        terms = depth_terms(objective, values)
        return sum((term * weight.to(term.dtype)).sum() for term, weight in zip(terms, weights))
    depths = len(values)
    aligned = [value.new_zeros(chain.numel()).index_put((where,), value) for value, where in zip(values, positions)]
    prefixes = torch.cumprod(torch.stack(aligned), dim=0)  # [D, positions]
    per_anchor = 1.0 - prefixes.mean(dim=0)
    return depths * (per_anchor * chain.to(per_anchor.dtype)).sum()
