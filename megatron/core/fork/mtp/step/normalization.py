# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""One optimizer step's loss: every branch divided exactly by its global count (spec section 4).

    L = L_main + (lambda / D) * sum_k S_k / N_tok

L_main is token-level (sum CE / N_tok) or sequence-level (mean over the N_seq valid
sequences of each sequence's token mean). The denominators are global: all micro-batches,
chunks and data-parallel ranks of the step. This builds on megatron-core's
``calculate_per_token_loss`` mode, where losses are raw sums; the step runs
finalize_model_grads without a token count (so it reduces and divides by nothing) and
the step's ``StepNormalization`` applies the division itself:

- counts given up front (``StepCounts``): each branch is seeded with its exact global
  scale (main loss by 1/N_main, MTP by 1/N_tok) and nothing is left to divide.
  Exact for every mode.
- counts known only at the end: raw sums; after the reduce, main-loss gradients are
  divided by N_main and MTP-only parameters by N_tok. Exact when the MTP heads are
  isolated or when N_main = N_tok (token-level main loss). Isolation off with a
  sequence-level main loss cannot be corrected afterwards and is refused up front.

The main-loss level (token or sequence) is the normalization's, decided once when the step is
built: ``main_loss`` (megatron.core.fork.mtp.step.loss_function) reads it from the open step, so
it cannot disagree with the normalization.
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
        if counts is not None and not isinstance(counts, StepCounts):
            raise TypeError(f"counts must be a StepCounts or None, got {type(counts).__name__}")
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


class FrameworkNormalization(StepNormalization):
    """A framework's own step (megatron.core.fork.mtp.step.framework, no main-loss level): the framework
    scales its main loss as it always does; the step owns only the MTP branch's seed, the whole of
    it: lambda / D (applied by the heads) times the loss scale, 1/N_tok when the counts are given,
    and the inverse of the uniform factor the framework's DDP applies after backward
    (`framework_factor`: 1/(DP x CP) when each micro-batch is averaged, 1 in per-token mode), so
    the reduced MTP gradient is (lambda / D) S_k / N_tok whatever the framework's schedule sets on
    MTPLossAutoScaler. Without counts the seed is raw, and after the framework's finalize the
    MTP-only parameters (isolated heads) are divided by N_tok times any factor the framework applied
    through scale_gradients. The step's own model's MTP forwards report each micro-batch's main valid
    targets here (``observe``), so the counts given can be checked against the data."""

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
