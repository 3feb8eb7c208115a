# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""What every exact step does around its forward/backward, for both step drivers.

SplitStep (a controller's step, in chunks), trainer/exact_step (megatron.training's
``train_step``) and a framework's own step differ in who draws the data, who normalizes the main
loss and who calls finalize_model_grads and the optimizer. The rest is one ``StepScope``, which
each of them enters through its public front, megatron.core.fork.mtp.exact_mtp_step.ExactMTPStep:

- ``StepScope(...)`` checks everything a step can refuse (the router losses' kind, the
  normalization's mode, the routed-token count the router losses need) and changes nothing;
- ``enter(overrides)`` saves the config hooks the step overrides, sets them, activates the
  step's normalization (megatron.core.fork.mtp.step_loss), gives the routers their exact scale
  (megatron.core.fork.mtp.router_losses) and starts the step's MTP and router statistics afresh,
  with the metric projections on only in a step built with ``metrics=True`` (statistics.metric_projections);
- ``exit()`` restores the hooks and the metric projections' setting, and deactivates the normalization;
- ``reduced_sums(config, extra)`` reduces the step's MTP sums, and any sums the driver keeps,
  over the last pipeline stage's data-parallel ranks in one collective;
- ``refuse_in_step(message)``: a refusal found inside the step's forward on one rank (an MTP forward
  without a loss mask, the router losses' checks of a packed or padded forward) is held there while
  the forward goes on, and ``refuse_what_any_rank_found()``, which each driver calls before its
  gradient reduce, raises it on every rank (one collective of one number per step; the message is
  fetched from the rank that found it only then). Raised at once it would leave the other ranks
  waiting in a pipeline receive or a collective until the process group's timeout.
"""

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron.core.fork.mtp import router_losses, router_metrics, step_loss
from megatron.core.fork.mtp.statistics import FIELDS, STEP_STATISTICS
from megatron.core.fork.runtime import device as compute_device

MOE_SCALE_HOOK = "moe_grad_scale_func"


class StepRefused(ValueError):
    """A refusal found inside a step, raised alike on every rank before the gradient reduce."""


_OPEN: "StepScope | None" = None  # the step whose forward runs now
_held: list[str] = []  # the refusals this rank found in it


def refuse_in_step(message: str) -> None:
    """Refuse the step in `message`: held until every rank raises it (see the module) while a step
    is open, raised at once otherwise."""
    if _OPEN is None:
        raise StepRefused(message)
    _held.append(message)


def refuse_what_any_rank_found() -> None:
    """Raise on every rank the first refusal any rank found in the step (collectives: every rank of
    the step calls it, before its gradient reduce)."""
    found = torch.tensor([float(bool(_held))], device=compute_device.current_device())
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    if not found.item():
        return
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, _held[0] if _held else None)
    _held.clear()
    raise StepRefused(next(message for message in messages if message))


def last_stage_sum(local: torch.Tensor) -> torch.Tensor:
    """Sum over data-parallel (and context-parallel: each holds a piece of every sequence) ranks
    of what the last pipeline stage holds, on every rank."""
    total = local.clone()
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        dist.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    else:
        total.zero_()
    dist.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
    return total


def reduced_sums(config, extra: torch.Tensor | None = None) -> tuple:
    """(extra summed, MTP sums [D, FIELDS] or None without MTP) over the last stage's
    data-parallel and context-parallel ranks, known to every rank: one collective, which every rank calls. The MTP
    sums recorded since the last reset are consumed."""
    depths = config.mtp_num_layers or 0
    parts = [] if extra is None else [extra.double().flatten()]
    if depths:
        local = STEP_STATISTICS.local_sums()
        if local is None:
            local = torch.zeros(depths, FIELDS, dtype=torch.float64, device=compute_device.current_device())
        parts.append(local.flatten())
    if not parts:
        return None, None
    totals = last_stage_sum(torch.cat(parts))
    STEP_STATISTICS.reset()
    size = 0 if extra is None else extra.numel()
    mtp = totals[size:].view(depths, FIELDS) if depths else None
    return (None if extra is None else totals[:size]), mtp


class StepScope:
    def __init__(self, config, main_loss: str, counts: "step_loss.StepCounts | None", *,
                 routed_tokens: int | None, grad_scale_func, normalization=None, metrics: bool = False):
        """`counts`: the step's global counts if known up front; `routed_tokens`: its input
        positions over all chunks and data-parallel ranks (T of spec section 11), needed with
        MoE router losses; `grad_scale_func`: the optimizer's loss scale the routers carry;
        `normalization`: a framework's (step_loss.FrameworkNormalization), else the step's own
        at the `main_loss` level; `metrics`: True for a step whose metrics its caller reads."""
        router_losses.check_exact_step(config)
        self.normalization = normalization or step_loss.StepNormalization(main_loss, bool(config.mtp_detach_heads),
                                                                          counts)
        self.moe_scale = None
        if router_losses.active(config):
            if routed_tokens is None:
                raise ValueError(
                    "the MoE router losses are normalized by the step's routed tokens T (every input "
                    "position of every chunk and data-parallel rank), which a router cannot see: pass "
                    "begin(..., routed_tokens=T)"
                )
            if counts is None and normalization is None:
                raise ValueError(
                    "the MoE router losses need the step's counts up front: a step without them divides every "
                    "backbone gradient by the main count after the reduce, and the routers' terms (normalized by "
                    "the routed tokens T) must not be divided again; pass begin(counts=...) "
                    "(step_loss.step_counts), or turn the router losses off"
                )
            self.moe_scale = router_losses.scale_func(config, routed_tokens, grad_scale_func)
        self.config = config
        self.metrics = metrics
        self.saved = None
        self.reporting_before = None

    def enter(self, overrides: dict) -> None:
        """Set the config hooks in `overrides` (and the routers' scale) for the step's duration."""
        if self.moe_scale is not None:
            overrides = dict(overrides, **{MOE_SCALE_HOOK: self.moe_scale})
        self.saved = {name: getattr(self.config, name) for name in overrides if hasattr(self.config, name)}
        global _OPEN
        step_loss.activate(self.normalization)
        _OPEN = self
        _held.clear()
        STEP_STATISTICS.reset()
        self.reporting_before, STEP_STATISTICS.reporting = STEP_STATISTICS.reporting, self.metrics
        router_metrics.reset()
        for name, value in overrides.items():
            setattr(self.config, name, value)

    def exit(self) -> None:
        """The config as before ``enter``; the normalization inactive. Idempotent."""
        global _OPEN
        if _OPEN is self:
            _OPEN = None
            _held.clear()
        if self.saved is not None:
            for name, value in self.saved.items():
                setattr(self.config, name, value)
            self.saved = None
        if self.reporting_before is not None:
            STEP_STATISTICS.reporting, self.reporting_before = self.reporting_before, None
        if step_loss.active() is self.normalization:
            step_loss.deactivate()
