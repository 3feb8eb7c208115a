# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The exact step (spec sections 4-7, 11, 12): one mechanism, the running step, and its adapters.

The names a controller or a framework imports come from here:

    from megatron.core.fork.mtp.step import SplitStep, StepCounts, exact_mtp_step, main_loss, step_counts

- running: ``RunningStep``, what one step owns while it runs (its normalization, counts, seeds and
  scales, metrics, refusals), bound to its own model chunks; ``active()``, the step open in this
  process.
- normalization: ``StepCounts``, ``step_counts`` and how a step divides each loss by its global count.
- loss_function: ``main_loss``, the main loss at the open step's level.
- framework: ``exact_mtp_step``, one call around a framework's own step (AReaL, verl, NeMo-RL).
- split: ``SplitStep``, a controller's step in chunks (begin, accumulate, finish).

megatron.training's ``train_step`` runs the same running step
(megatron.core.fork.training_loop.exact_step). A model's MTP forward reads its step through
megatron.core.fork.mtp.forward_settings.
"""

from megatron.core.fork.mtp.forward_settings import StepRefused
from megatron.core.fork.mtp.step.framework import ExactMTPStep, exact_mtp_step
from megatron.core.fork.mtp.step.loss_function import main_loss
from megatron.core.fork.mtp.step.normalization import MAIN_LOSS_LEVELS, SEQUENCE, TOKEN, StepCounts, step_counts
from megatron.core.fork.mtp.step.running import RunningStep, active
from megatron.core.fork.mtp.step.split import SplitStep

__all__ = ["ExactMTPStep", "MAIN_LOSS_LEVELS", "RunningStep", "SEQUENCE", "SplitStep", "StepCounts", "StepRefused",
           "TOKEN", "active", "exact_mtp_step", "main_loss", "step_counts"]
