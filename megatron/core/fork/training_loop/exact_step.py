# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""One step of megatron.training's loop as the spec's objective (spec section 4).

``train_step`` calls ``begin`` before its forward/backward and ``end`` after the optimizer
step. ``begin`` draws the step's micro-batches from the data iterator(s) up front and
all-reduces the step's counts once: valid next-token targets and sequences with at least
one, counted where each sample's loss mask is read (tensor-parallel rank 0 of the last
pipeline stage, every data-parallel rank its own share). Those counts become the step's
normalization (megatron.core.fork.mtp.step_loss): the main loss and every MTP depth are
seeded with their exact global scales, and finalize_model_grads runs without a token
count, so it divides by nothing more. The step is then exact for token- and
sequence-level main losses, isolation on and off, every DP/TP/PP/VPP layout and
micro-batch count, which upstream's per-token mode is not for MTP (issue #7452).

With MoE router losses the step also counts its routed tokens T (every input position) and
gives the routers their exact scale, the loss scale over T (megatron.core.fork.mtp.router_losses).

``end`` restores the config, reduces the step's MTP sums (one collective) and hands them,
with the MTP gradient norm, to the metrics (megatron.core.fork.training_loop.metrics). A step
that training_log will not print (its iteration not a multiple of --log-interval) runs without
the metric projections (megatron.core.fork.mtp.statistics.metric_projections): the sampled
acceptance a line prints is its own iteration's step's, exact over its global batch. The checks,
config hooks, normalization and router scale around the step are megatron.core.fork.mtp.exact_mtp_step's
(the front of step_scope's core), as SplitStep's and a framework's own step's are. Exact
steps are on once the trainer calls ``enable`` (its loss function must then be
step_loss.main_loss); otherwise the steps are upstream's and only the metrics come
from here, so Megatron-LM's own pretrain_gpt.py keeps working with the series applied.
"""

import torch
from megatron.core import parallel_state
from megatron.core.rerun_state_machine import RerunDataIterator
from megatron.core.utils import get_model_config

from megatron.core.fork.mtp import router_losses, router_metrics, step_loss
from megatron.core.fork.mtp.exact_mtp_step import ExactMTPStep
from megatron.core.fork.mtp.statistics import STEP_STATISTICS
from megatron.core.fork.mtp.step_scope import reduced_sums, refuse_what_any_rank_found
from megatron.core.fork.training_loop import loss_contract, metrics


def loss_mask_of(batch) -> torch.Tensor:
    """The loss mask of a micro-batch as megatron-core's GPT datasets yield it."""
    return batch["loss_mask"]


class _Step:
    def __init__(self, config, num_microbatches, scope=None):
        self.config = config
        self.num_microbatches = num_microbatches
        self.scope = scope  # None: the step is not normalized here (exact steps off)

    @property
    def counts(self):
        return self.scope.normalization.counts if self.scope is not None else None


_main_loss_level: str | None = None  # set by enable(): exact steps on
_current: _Step | None = None


def enable(main_loss_level: str) -> None:
    """Make every step exact; the trainer's loss function must be step_loss.main_loss.
    Without this, steps are upstream's and only the MTP metrics come from here."""
    global _main_loss_level
    if main_loss_level not in step_loss.MAIN_LOSS_LEVELS:
        raise ValueError(f"main loss level must be one of {step_loss.MAIN_LOSS_LEVELS}, got {main_loss_level!r}")
    _main_loss_level = main_loss_level
    step_loss.set_default_level(main_loss_level)


def exact(config) -> bool:
    """Whether this run's steps are exact (the trainer's loss function, or --exact-steps)."""
    return _main_loss_level is not None or bool(config.exact_steps)


def begin_evaluation(config) -> None:
    """Before an evaluation: it measures every metric (the metric projections on, as after every
    step here); in exact steps, routers report their losses there too."""
    STEP_STATISTICS.reporting = True
    router_metrics.reset()
    router_losses.report_in_evaluation(exact(config) and router_losses.active(config))


def evaluation_router_losses(config, microbatches: int, pg_collection=None) -> dict:
    """After an evaluation of `microbatches` micro-batches (of equal size): its router losses
    as step values, {} unless ``begin_evaluation`` turned them on. The backbone's are
    reduced by upstream's MoE metrics tracker as it reduces a training step's (the mean over
    the MoE layers), each MTP depth's by router_metrics (collectives: every rank calls it)."""
    if not router_losses.reporting_in_evaluation():
        return {}
    router_losses.report_in_evaluation(False)
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker  # 0.19's tracker

    backbone = {}
    get_moe_metrics_tracker().report(
        loss_scale=1 / microbatches, iteration=0, force_initialize=True, track_names=router_metrics.names(config),
        num_layers=config.num_layers, moe_layer_freq=config.moe_layer_freq, mtp_num_layers=config.mtp_num_layers,
        pg_collection=pg_collection, total_loss_dict=backbone)
    values = {name: float(value) for name, value in backbone.items()}
    values.update(router_metrics.step_values(config, microbatches))
    return values


def _prefetch(data_iterator, num_microbatches: int):
    """The step's micro-batches of each iterator (one per virtual stage, or one)."""
    if data_iterator is None:
        return None
    if isinstance(data_iterator, list):
        return [_prefetch(it, num_microbatches) for it in data_iterator]
    return [next(data_iterator) for _ in range(num_microbatches)]


def _replayable(batches, virtual: bool):
    """Iterators over the prefetched micro-batches, shaped as the data iterator(s) were (a
    virtual stage whose rank reads no data has None)."""
    if batches is None:
        return None
    if virtual:
        return [None if b is None else RerunDataIterator(iter(b)) for b in batches]
    return RerunDataIterator(iter(batches))


def _counted_masks(batches, virtual: bool) -> list:
    """The loss masks this rank counts: its micro-batches' if it is the rank that counts
    (tensor-parallel and context-parallel rank 0 of the last stage; with virtual stages, the
    last one's: it computes the loss), else none. Each sample is counted by exactly one rank
    (the data iterator yields whole sequences; get_batch cuts them for context parallelism)."""
    counting = (parallel_state.get_tensor_model_parallel_rank() == 0
                and parallel_state.get_context_parallel_rank() == 0
                and parallel_state.is_pipeline_last_stage(ignore_virtual=True))
    mine = batches[-1] if virtual and batches else batches
    return [loss_mask_of(batch) for batch in mine] if counting and mine else []


def _finalize_without_count(finalize):
    def finalize_exactly(model, num_tokens=None, **kwargs):
        refuse_what_any_rank_found()  # what a rank found in the forward, on every rank, before the reduce
        finalize(model, None, **kwargs)  # seeded up front: nothing left to divide
    return finalize_exactly


def logged(iteration: int | None, log_interval: int | None) -> bool:
    """Whether training_log prints the step train_step runs at `iteration` (the count of steps
    before it: the line is printed after it, at iteration + 1, on multiples of the interval)."""
    return iteration is None or not log_interval or (iteration + 1) % log_interval == 0


def begin(model, data_iterator, num_microbatches: int, metrics: bool = True):
    """Start a step: returns the data iterator(s) the step's schedule reads from. `metrics`:
    False for a step whose metrics no line prints (``logged``): no metric projections."""
    global _current
    end()  # a step that exited early (rerun, signal) leaves nothing behind
    config = get_model_config(model[0])
    STEP_STATISTICS.reset()
    router_metrics.reset()
    upstream_loss = _main_loss_level is None and config.exact_steps  # --exact-steps, upstream's loss contract
    if not exact(config):
        STEP_STATISTICS.reporting = metrics
        _current = _Step(config, num_microbatches)
        return data_iterator
    level = step_loss.TOKEN if upstream_loss else _main_loss_level
    router_losses.check_exact_step(config)  # before the step's data is drawn
    virtual = isinstance(data_iterator, list)  # one iterator per virtual stage
    batches = _prefetch(data_iterator, num_microbatches)
    step_counts, routed = step_loss.step_counts(_counted_masks(batches, virtual))
    scope = ExactMTPStep(model, step_counts, main_loss=level, routed_tokens=routed,
                         grad_scale_func=config.grad_scale_func, metrics=metrics)
    overrides = {"finalize_model_grads_func": _finalize_without_count(config.finalize_model_grads_func)}
    if upstream_loss:
        overrides.update(loss_contract.main_loss_seed(config, scope.normalization.main_scale()))
    scope.enter(overrides)
    _current = _Step(config, num_microbatches, scope)
    return _replayable(batches, virtual)


def end(optimizer=None, update_successful: bool = False) -> None:
    """Close the step: config restored, MTP sums and norms handed to the metrics."""
    global _current
    if _current is None:
        return
    step, _current = _current, None
    if step.scope is not None:
        step.scope.exit()
    STEP_STATISTICS.reporting = True  # this loop's evaluations measure every metric (begin_evaluation)
    if optimizer is None:
        return
    norms = getattr(optimizer, "grad_norms_by_group", {}) if update_successful else {}
    metrics.record_step(step.counts, reduced_mtp_sums(step.config), norms.get("mtp"),
                        router_metrics.step_values(step.config, step.num_microbatches))


def reduced_mtp_sums(config) -> torch.Tensor | None:
    """The MTP sums recorded since the last reset, summed over data-parallel ranks and made
    known to every rank (one collective; every rank must call it); None without MTP."""
    return reduced_sums(config)[1]
