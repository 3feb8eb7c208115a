# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The running step: everything one step owns while it runs, in one object.

Every exact step is a ``RunningStep``: a framework's own step (``framework.ExactMTPStep``), a
controller's step in chunks (``split.SplitStep``) and megatron.training's ``train_step``
(megatron.core.fork.training_loop.exact_step) differ only in who draws the data, who normalizes the
main loss and who calls finalize_model_grads and the optimizer. A ``RunningStep`` owns:

- its normalization (megatron.core.fork.mtp.step.normalization: the main-loss level, the counts up
  front or observed, the seeds and the division after the reduce), or none (the trainer's steps
  without exact normalization, and its evaluations, which only measure);
- whether its forwards measure the metric projections (``measures_metrics``), its MTP statistics
  (``statistics``), its MTP depths' router losses (``router_metrics``), and the refusals its
  forwards found (``refuse``);
- the MoE routers' scale (the loss scale over the step's routed tokens T).

``RunningStep(...)`` checks everything a step can refuse and changes nothing. ``enter(overrides)``
binds the step to its own model chunks (megatron.core.fork.mtp.forward_settings: their models and
routers; a forward of another model in the process is not the step's), sets the config hooks in
`overrides` and the routers' scale, and saves upstream's class-level loss scales; ``exit()``
restores all of them and unbinds. State outside the object, set and restored by the step that owns
it: the TransformerConfig's hooks (``finalize_model_grads_func``, ``grad_scale_func``,
``moe_grad_scale_func``, ... as each adapter overrides them; a second model sharing the config sees
them for the step's duration), ``MTPLossAutoScaler.main_loss_backward_scale`` and
``MoEAuxLossAutoScaler.main_loss_backward_scale`` (class attributes: the schedules set them from
``grad_scale_func`` in each micro-batch's forward), and this module's open step. One step is open
per process at a time (those scales are the process's); ``main_loss`` (loss_function) reads the
open one's level, as a loss function has no handle on its model.

A refusal found inside the step's forward on one rank (an MTP forward without a loss mask, the
router losses' checks of a packed or padded forward) is held while the forward goes on, and
``refuse_what_any_rank_found()``, which each driver calls before its gradient reduce, raises it on
every rank (one collective of one number per step; the message is fetched from the rank that found
it only then). Raised at once it would leave the other ranks waiting in a pipeline receive or a
collective until the process group's timeout.
"""

import inspect

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed.finalize_model_grads import reset_model_temporary_tensors
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler
from megatron.core.utils import get_model_config

from megatron.core.fork.mtp import router_losses
from megatron.core.fork.mtp.forward_settings import StepRefused, bind, bound_modules, innermost, step_of
from megatron.core.fork.mtp.router_metrics import RouterMetrics
from megatron.core.fork.mtp.statistics import FIELDS, MTPStatistics
from megatron.core.fork.runtime import device as compute_device

MOE_SCALE_HOOK = "moe_grad_scale_func"
_SCALERS = (MTPLossAutoScaler, MoEAuxLossAutoScaler)  # upstream's class-level loss scales

_OPEN: "RunningStep | None" = None  # the step open in this process, between its enter and exit


def active() -> "RunningStep | None":
    """The step open in this process, or None."""
    return _OPEN


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


def _check_packed_forward(model, args, kwargs):
    """Before a model forward: the router losses' refusals (padding masks, seq_aux_loss on packed rows),
    held by the model's step until every rank raises them."""
    bound = inspect.signature(model.forward).bind_partial(*args, **kwargs).arguments
    try:
        router_losses.check_packed_forward(model.config, bound.get("packed_seq_params"), bound.get("padding_mask"))
    except ValueError as refusal:
        step_of(model).refuse(str(refusal))


class RunningStep:
    def __init__(self, model_chunks, normalization=None, *, main_loss_level: str | None = None,
                 routed_tokens: int | None = None, grad_scale_func=None, metrics: bool = False,
                 router_losses_in_evaluation: bool = False):
        """`normalization`: the step's (normalization.StepNormalization or FrameworkNormalization),
        None for a step that only measures (`main_loss_level`: the level ``main_loss`` reads
        there); `routed_tokens`: the step's input positions over all chunks and data-parallel ranks
        (T of spec section 11), needed with MoE router losses; `grad_scale_func`: the optimizer's
        loss scale the routers carry; `metrics`: True for a step whose metrics its caller reads (the
        metric projections); `router_losses_in_evaluation`: its routers compute their losses in eval
        mode (an evaluation that reports them)."""
        self.chunks = list(model_chunks)
        self.config = config = get_model_config(self.chunks[0])
        self.normalization = normalization
        self._level = main_loss_level
        self.moe_scale = None
        if normalization is not None:
            router_losses.check_exact_step(config)
            if router_losses.active(config):
                if routed_tokens is None:
                    raise ValueError(
                        "the MoE router losses are normalized by the step's routed tokens T (every input "
                        "position of every chunk and data-parallel rank), which a router cannot see: pass "
                        "begin(..., routed_tokens=T)"
                    )
                if normalization.counts is None and not normalization.seeds_mtp:
                    raise ValueError(
                        "the MoE router losses need the step's counts up front: a step without them divides every "
                        "backbone gradient by the main count after the reduce, and the routers' terms (normalized "
                        "by the routed tokens T) must not be divided again; pass begin(counts=...) "
                        "(step_counts), or turn the router losses off"
                    )
                self.moe_scale = router_losses.scale_func(config, routed_tokens, grad_scale_func)
        self.measures_metrics = metrics
        self.router_losses_in_evaluation = router_losses_in_evaluation
        self.statistics = MTPStatistics()
        self.router_metrics = RouterMetrics()
        self._held: list[str] = []
        self._saved = None
        self._bound: list = []
        self._forward_checks: list = []

    @property
    def main_loss_level(self) -> str | None:
        """The main loss's level (token or sequence) that ``main_loss`` takes in this step; None in
        a framework's step, whose main loss is its own."""
        return self.normalization.main_loss if self.normalization is not None else self._level

    def enter(self, overrides: dict | None = None) -> None:
        """Open the step: bound to its chunks, the config hooks in `overrides` (and the routers'
        scale) set for its duration."""
        global _OPEN
        if _OPEN is not None:
            raise RuntimeError("a training step is already in progress; finish() or abort() it first")
        overrides = dict(overrides or {})
        if self.moe_scale is not None:
            overrides[MOE_SCALE_HOOK] = self.moe_scale
        self._saved = ({name: getattr(self.config, name) for name in overrides if hasattr(self.config, name)},
                       [scaler.main_loss_backward_scale for scaler in _SCALERS],
                       [_value(scaler.main_loss_backward_scale) for scaler in _SCALERS])
        _OPEN = self
        self._bound = bound_modules(self.chunks)
        bind(self._bound, self)
        if self.normalization is not None and router_losses.active(self.config):
            self._forward_checks = [innermost(chunk).register_forward_pre_hook(_check_packed_forward, with_kwargs=True)
                                    for chunk in self.chunks]
        for name, value in overrides.items():
            setattr(self.config, name, value)

    def exit(self) -> None:
        """The config, upstream's scales and the chunks as before ``enter``; the step closed.
        Idempotent."""
        global _OPEN
        if self._saved is not None:
            hooks, scales, values = self._saved
            for name, value in hooks.items():
                setattr(self.config, name, value)
            for scaler, scale, value in zip(_SCALERS, scales, values, strict=True):
                if scale is not None:
                    scale.copy_(value)  # MoEAuxLossAutoScaler's is set in place
                scaler.main_loss_backward_scale = scale
            self._saved = None
        for handle in self._forward_checks:
            handle.remove()
        self._forward_checks = []
        bind(self._bound, None)
        self._bound = []
        if _OPEN is self:
            _OPEN = None

    def abort(self) -> None:
        """Drop the step: hooks restored, gradients zeroed, nothing recorded kept."""
        self.exit()
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        reset_model_temporary_tensors(self.config, self.chunks)  # the routers' per-step token counts
        self.statistics.reset()
        self._held.clear()

    def refuse(self, message: str) -> None:
        """Refuse the step in `message`: held until every rank raises it (see the module) in an exact
        step, raised at once in one that only measures (nothing raises what it would hold)."""
        if self.normalization is None:
            raise StepRefused(message)
        self._held.append(message)

    def refuse_what_any_rank_found(self) -> None:
        """Raise on every rank the first refusal any rank found in the step (collectives: every rank of
        the step calls it, before its gradient reduce)."""
        found = torch.tensor([float(bool(self._held))], device=compute_device.current_device())
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        if not found.item():
            return
        messages = [None] * dist.get_world_size()
        dist.all_gather_object(messages, self._held[0] if self._held else None)
        self._held.clear()
        raise StepRefused(next(message for message in messages if message))

    def reduced_sums(self, extra: torch.Tensor | None = None) -> tuple:
        """(extra summed, MTP sums [D, FIELDS] or None without MTP) over the last stage's
        data-parallel and context-parallel ranks, known to every rank: one collective, which every
        rank calls. The step's MTP sums are consumed."""
        depths = self.config.mtp_num_layers or 0
        parts = [] if extra is None else [extra.double().flatten()]
        if depths:
            local = self.statistics.local_sums()
            if local is None:
                local = torch.zeros(depths, FIELDS, dtype=torch.float64, device=compute_device.current_device())
            parts.append(local.flatten())
        if not parts:
            return None, None
        totals = last_stage_sum(torch.cat(parts))
        self.statistics.reset()
        size = 0 if extra is None else extra.numel()
        mtp = totals[size:].view(depths, FIELDS) if depths else None
        return (None if extra is None else totals[:size]), mtp


def _value(scale):
    return None if scale is None else scale.detach().clone()
