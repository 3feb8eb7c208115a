# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""One optimizer step's loss: every branch divided exactly by its global count (spec section 4).

    L = L_main + (lambda / D) * sum_k S_k / N_tok

L_main is token-level (sum CE / N_tok) or sequence-level (mean over the N_seq valid
sequences of each sequence's token mean). The denominators are global: all micro-batches,
chunks and data-parallel ranks of the step. This builds on megatron-core's
``calculate_per_token_loss`` mode, where losses are raw sums; the step runs
finalize_model_grads without a token count (so it reduces and divides by nothing) and
an active ``StepNormalization`` applies the division itself:

- counts given up front (``StepCounts``): each branch is seeded with its exact global
  scale (main loss by 1/N_main, MTP by 1/N_tok) and nothing is left to divide.
  Exact for every mode.
- counts known only at the end: raw sums; after the reduce, main-loss gradients are
  divided by N_main and MTP-only parameters by N_tok. Exact when the MTP heads are
  isolated or when N_main = N_tok (token-level main loss). Isolation off with a
  sequence-level main loss cannot be corrected afterwards and is refused up front.

The main-loss level (token or sequence) is the step's: ``main_loss`` reads it from the
active step, so it cannot disagree with the normalization.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.core.fork.mtp.isolation import MTP_GRAD_NORM_GROUP
from megatron.core.fork.runtime import device as compute_device

TOKEN, SEQUENCE = "token", "sequence"
MAIN_LOSS_LEVELS = (TOKEN, SEQUENCE)


@dataclass(frozen=True)
class StepCounts:
    """Global counts of one step: valid next-token targets and sequences with at least one."""

    tokens: int
    sequences: int


def target_counts(loss_mask: torch.Tensor) -> torch.Tensor:
    """[valid targets, sequences with at least one] of one batch [b, s], in float64, so that
    sums over micro-batches and ranks (one all-reduce) stay exact."""
    return _counts(loss_mask.reshape(loss_mask.size(0), -1).double().sum(dim=1))


def _counts(per_sequence: torch.Tensor) -> torch.Tensor:
    """[valid targets, sequences with at least one] from each sequence's valid targets."""
    return torch.stack([per_sequence.sum(), (per_sequence > 0).sum().to(per_sequence.dtype)])


def step_counts(loss_masks: list, group=None) -> tuple[StepCounts, int]:
    """A step's global counts and its routed tokens, in one all-reduce.

    Args:
        loss_masks (list[Tensor]): the loss masks [b, s] this rank counts (an empty list on a
            rank that counts nothing, e.g. a pipeline stage without the loss or a CP rank whose
            pieces another rank counts).
        group (ProcessGroup, optional): the group the counts are summed over (default: the world).

    Returns:
        tuple[StepCounts, int]: the global counts (N_tok, N_seq), and the routed tokens T of spec
        section 11 (every input position, the MoE router losses' denominator).
    """
    local = torch.zeros(3, dtype=torch.float64, device=compute_device.current_device())
    for mask in loss_masks:
        local[:2] += target_counts(mask.to(local.device))
        local[2] += mask.numel()
    dist.all_reduce(local, group=group)
    tokens, sequences, routed = (int(round(x)) for x in local.tolist())
    return StepCounts(tokens=tokens, sequences=sequences), routed


class StepNormalization:
    seeds_mtp = False  # the MTP seed's loss scale comes through MTPLossAutoScaler (the step's hooks)

    def __init__(self, main_loss: str, isolated: bool, counts: StepCounts | None):
        if main_loss not in MAIN_LOSS_LEVELS:
            raise ValueError(f"main loss level must be one of {MAIN_LOSS_LEVELS}, got {main_loss!r}")
        if counts is None and main_loss == SEQUENCE and not isolated:
            raise ValueError(
                "a sequence-level main loss with attached MTP heads cannot be normalized exactly when "
                "the step's counts are only known at the end (the shared parameters mix 1/N_seq and "
                "1/N_tok terms). Either isolate the heads (--mtp-detach-heads) or pass the step's "
                "global counts up front (begin(counts=StepCounts(tokens=..., sequences=...)))."
            )
        if counts is not None and (counts.tokens < 0 or counts.sequences < 0):
            raise ValueError(f"step counts must be >= 0, got {counts}")
        self.main_loss = main_loss
        self.isolated = isolated
        self.counts = counts  # up front, if given
        self.final_counts: StepCounts | None = None  # observed and reduced at the end

    def _main_count(self, counts: StepCounts) -> int:
        return counts.tokens if self.main_loss == TOKEN else counts.sequences

    def main_scale(self) -> float:
        """Factor on the main loss's raw sum in the backward pass."""
        return 1.0 / max(self._main_count(self.counts), 1) if self.counts else 1.0

    def mtp_scale(self) -> float:
        """Factor on each depth's raw (lambda / D)-weighted sum in the backward pass."""
        return 1.0 / max(self.counts.tokens, 1) if self.counts else 1.0

    def normalize_reduced_gradients(self, model_chunk) -> None:
        """After the gradient reduce: what is left to divide (nothing if seeded up front)."""
        if self.counts is not None:
            return
        if self.final_counts is None:
            raise RuntimeError("the step's counts were not reduced before finalize_model_grads")
        main = max(self._main_count(self.final_counts), 1)
        model_chunk.scale_gradients(1.0 / main)
        if self.main_loss == TOKEN:
            return  # N_main = N_tok: every branch is already exact
        _scale_mtp_gradients(model_chunk, main / max(self.final_counts.tokens, 1))


def _scale_mtp_gradients(model_chunk, factor: float) -> None:
    """The MTP-only parameters' reduced gradients (the MTP gradient-norm group's) times `factor`."""
    for param in model_chunk.parameters():
        if getattr(param, "grad_norm_group", None) == MTP_GRAD_NORM_GROUP and param.requires_grad:
            grad = param.main_grad if hasattr(param, "main_grad") else param.grad
            if grad is not None:
                grad.mul_(factor)


def _context_parallel_group():
    """The CP group when context parallelism is on, else None."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    if parallel_state.get_context_parallel_world_size() == 1:
        return None
    return parallel_state.get_context_parallel_group()


class FrameworkNormalization(StepNormalization):
    """A framework's own step (megatron.core.fork.mtp.exact_mtp_step, main_loss=None): the framework
    scales its main loss as it always does; the step owns only the MTP branch's seed, the whole of
    it: lambda / D (applied by the heads) times the loss scale, 1/N_tok when the counts are given,
    and the inverse of the uniform factor the framework's DDP applies after backward
    (`framework_factor`: 1/(DP x CP) when each micro-batch is averaged, 1 in per-token mode), so
    the reduced MTP gradient is (lambda / D) S_k / N_tok whatever the framework's schedule sets on
    MTPLossAutoScaler. Without counts the seed is raw, and after the framework's finalize the
    MTP-only parameters (isolated heads) are divided by N_tok times any factor the framework applied
    through scale_gradients. The heads report each micro-batch's main valid targets here, so the
    counts given can be checked against the data."""

    seeds_mtp = True

    def __init__(self, isolated: bool, counts: StepCounts | None, framework_factor: float, loss_scale):
        if counts is None and not isolated:
            raise ValueError(
                "a framework step without counts cannot normalize attached MTP heads: their loss reaches the "
                "backbone, whose gradient needs 1/N_tok before backward. Pass the step's counts "
                "(exact_mtp_step(chunks, counts=StepCounts(tokens=..., sequences=...))) or isolate the heads "
                "(mtp_detach_heads=True)"
            )
        super().__init__(TOKEN, isolated, counts)
        self.main_loss = None  # the framework's
        self.framework_factor = framework_factor
        self.loss_scale = loss_scale
        self.observed = torch.zeros(2, dtype=torch.float64, device=compute_device.current_device())

    def observe(self, main_valid_targets: torch.Tensor) -> None:
        """One micro-batch's valid main targets (and the micro-batch itself), as the heads see them."""
        self.observed += torch.stack([main_valid_targets.detach().double().sum(), self.observed.new_ones(())])

    def mtp_scale(self) -> float:
        tokens = 1.0 / max(self.counts.tokens, 1) if self.counts else 1.0
        return float(self.loss_scale()) * tokens / self.framework_factor

    def normalize_reduced_gradients(self, model_chunk, applied: float = 1.0) -> None:
        """After the framework's finalize: the MTP-only gradients (seeded raw, then times `applied`
        by the framework) divided by N_tok; nothing when the counts were given."""
        if self.counts is not None:
            return
        _scale_mtp_gradients(model_chunk, 1.0 / (max(self.final_counts.tokens, 1) * applied))


_ACTIVE: StepNormalization | None = None
_DEFAULT_LEVEL = TOKEN  # of main_loss when no step is active (evaluation)


def set_default_level(level: str) -> None:
    """The main-loss level outside steps (evaluation); a trainer sets it to its steps' level."""
    global _DEFAULT_LEVEL
    if level not in MAIN_LOSS_LEVELS:
        raise ValueError(f"main loss level must be one of {MAIN_LOSS_LEVELS}, got {level!r}")
    _DEFAULT_LEVEL = level


def active() -> StepNormalization | None:
    return _ACTIVE


def activate(normalization: StepNormalization) -> None:
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("a training step is already in progress; finish() or abort() it first")
    _ACTIVE = normalization


def deactivate() -> None:
    global _ACTIVE
    _ACTIVE = None


def mtp_backward_scale() -> float:
    return _ACTIVE.mtp_scale() if _ACTIVE is not None else 1.0


def main_loss(per_token_loss: torch.Tensor, loss_mask: torch.Tensor):
    """A loss function for megatron-core's calculate_per_token_loss mode.

    Args:
        per_token_loss (Tensor): the main head's cross-entropy per position [b, s] (or [s, b]
            flattened alike with the mask; under CP this rank's piece).
        loss_mask (Tensor): 1 where a position's target counts, same shape.

    Returns:
        tuple[Tensor, Tensor, dict]: the tensor to backpropagate, the raw main-loss sum at the
        active step's level (token: the masked cross-entropy summed; sequence: each sequence's
        token mean summed over sequences with valid targets; outside a step, e.g. in evaluation,
        the default level) times the step's main scale; the micro-batch's main count (int); and
        {"main loss sums": [main sum, valid tokens, valid sequences]}, the sums that reduce
        exactly into metrics.
    """
    level = _ACTIVE.main_loss if _ACTIVE is not None else _DEFAULT_LEVEL
    mask = loss_mask.reshape(loss_mask.size(0), -1).float()
    losses = per_token_loss.float().reshape(mask.shape) * mask
    per_sequence_tokens = mask.sum(dim=1)
    tokens = per_sequence_tokens.sum()
    cp_group = _context_parallel_group()
    if cp_group is not None:
        # Each context-parallel rank holds a piece of every sequence: a sequence's mean divides
        # by all its valid targets, and it is counted once (by CP rank 0) in the step's sums.
        per_sequence_tokens = per_sequence_tokens.detach().clone()
        dist.all_reduce(per_sequence_tokens, group=cp_group)
    sequences = (per_sequence_tokens > 0).sum().to(tokens.dtype)
    if cp_group is not None and dist.get_rank(cp_group) != 0:
        sequences = torch.zeros_like(sequences)
    if level == TOKEN:
        raw, count = losses.sum(), tokens
    else:
        raw, count = (losses.sum(dim=1) / per_sequence_tokens.clamp(min=1)).sum(), sequences
    scale = _ACTIVE.main_scale() if _ACTIVE is not None else 1.0
    report = torch.stack([raw.detach(), tokens, sequences])
    return raw * scale, count.to(torch.int), {"main loss sums": report}
