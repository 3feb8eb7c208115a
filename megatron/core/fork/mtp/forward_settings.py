# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""What one MTP forward computes, and the step it answers to.

A running step (megatron.core.fork.mtp.step.running) is bound to its own model chunks while it
runs: to the model inside each chunk's wrappers (the GPTModel or HybridModel whose forward
attaches the MTP losses) and to that model's MoE routers. A forward reads its model's step, or
none, through ``ForwardSettings``, decided once at the top of the MTP loss branch and passed
down. A forward of another model in the same process (an RL worker's reference policy, with MTP
depths and the same TransformerConfig) finds no step of its own: it is a plain forward, and the
step counts, seeds and measures nothing of it.

A plain forward records its statistics in ``statistics.STEP_STATISTICS`` (the library's forwards
outside any step), measures the metric projections where that record asks
(``STEP_STATISTICS.report_metrics()``), seeds its MTP losses as upstream does, and raises a
refusal at once.
"""

from dataclasses import dataclass
from typing import Optional

from megatron.core.fork.mtp.draft_objectives import objective_of
from megatron.core.fork.mtp.statistics import STEP_STATISTICS, MTPStatistics

_STEP = "_mtp_running_step"  # the attribute a running step sets on the modules it is bound to


class StepRefused(ValueError):
    """A refusal found inside a step, raised alike on every rank before the gradient reduce."""


def innermost(chunk):
    """The model inside a chunk's wrappers (DDP, Float16Module)."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def bound_modules(chunks) -> list:
    """The modules a step binds to in `chunks`: each chunk's model, and its routers (the MoE
    hooks read their step from the router: megatron.core.fork.mtp.router_losses, router_metrics)."""
    from megatron.core.transformer.moe.router import Router

    models = [innermost(chunk) for chunk in chunks]
    return models + [module for model in models for module in model.modules() if isinstance(module, Router)]


def bind(modules, step) -> None:
    """`step` (None: unbind) is the running step of each of `modules`."""
    for module in modules:
        if step is None:
            module.__dict__.pop(_STEP, None)
        else:
            module.__dict__[_STEP] = step


def step_of(module):
    """The running step bound to `module` (a model or a router), or None: a plain forward."""
    return module.__dict__.get(_STEP)


@dataclass(frozen=True)
class ForwardSettings:
    """What one MTP forward computes: the draft objective (megatron.core.fork.mtp.draft_objectives)
    and its temperature tau; whether the branch reads the main head at t + k, p^k_t (a draft
    objective trains on it; under ``ce`` a forward that measures the sampled and greedy-draft
    acceptances reads it); whether each depth's rows are those that its loss or a deeper depth's
    chain reads (``sparse``: sparse_loss.rows_needed), or every row; whether the chunked projection
    computes the losses (``chunked``: the sparse loss or a draft objective; else upstream's dense
    cross-entropy at every position); and the step it answers to: the model's running step (None:
    a plain forward), whether that step normalizes the losses (``exact``) and seeds the MTP branch
    whole (``seeds_whole``: a framework's step), and where the forward's statistics go."""

    objective: str
    temperature: float
    reads_main_head: bool
    sparse: bool
    chunked: bool
    step: Optional[object]
    exact: bool
    seeds_whole: bool
    statistics: MTPStatistics

    @staticmethod
    def sparse_loss(config) -> bool:
        """Whether the MTP loss reads only the rows that count (``mtp_sparse_loss``)."""
        return bool(config.mtp_sparse_loss)

    @classmethod
    def of(cls, model) -> "ForwardSettings":
        config, step = model.config, step_of(model)
        objective = objective_of(config)
        measures = step.measures_metrics if step is not None else STEP_STATISTICS.reporting
        projections = bool(config.mtp_sampled_acceptance) and measures  # the metric projections
        sparse = cls.sparse_loss(config)
        normalization = step.normalization if step is not None else None
        return cls(objective, config.mtp_draft_temperature, objective != "ce" or projections, sparse,
                   sparse or objective != "ce", step, normalization is not None,
                   normalization is not None and normalization.seeds_mtp,
                   step.statistics if step is not None else STEP_STATISTICS)

    def mtp_loss_weight(self, config, main_valid_tokens):
        """Backward weight of a depth's raw masked sum: lambda / D times what the step's
        normalization (megatron.core.fork.mtp.step.normalization) gives the MTP branch up front,
        the whole seed in a framework's step (which counts the forward's main valid targets);
        outside an exact step, upstream's calculate_per_token_loss mode takes the raw sum, and its
        default mode (each micro-batch normalized by its own counts) the micro-batch's main-token
        count in place of N_tok."""
        weight = config.mtp_loss_scaling_factor / config.mtp_num_layers
        if self.seeds_whole:
            self.step.normalization.observe(main_valid_tokens)
            return weight * self.step.normalization.mtp_scale()
        if config.calculate_per_token_loss:
            return weight * self.step.normalization.mtp_scale() if self.exact else weight
        return weight / main_valid_tokens.clamp(min=1)

    def refuse(self, message: str) -> None:
        """Refuse the forward's step: held in an exact step until every rank raises it (its
        ``refuse``), raised at once otherwise."""
        if self.exact:
            self.step.refuse(message)
        else:
            raise StepRefused(message)
