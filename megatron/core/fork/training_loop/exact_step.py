# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""One step of megatron.training's loop as the spec's objective (spec section 4).

``train_step`` calls ``begin`` before its forward/backward and ``end`` after the optimizer
step. ``begin`` draws the step's micro-batches from the data iterator(s) up front and
all-reduces the step's counts once: valid next-token targets and sequences with at least
one, counted where each sample's loss mask is read (tensor-parallel rank 0 of the last
pipeline stage, every data-parallel rank its own share). Those counts become the step's
normalization (megatron.core.fork.mtp.step.normalization): the main loss and every MTP depth are
seeded with their exact global scales, and finalize_model_grads runs without a token
count, so it divides by nothing more. The step is then exact for token- and
sequence-level main losses, isolation on and off, every DP/TP/PP/VPP layout and
micro-batch count, which upstream's per-token mode is not for MTP (issue #7452).

With MoE router losses the step also counts its routed tokens T (every input position) and
gives the routers their exact scale, the loss scale over T (megatron.core.fork.mtp.router_losses).

Each step is a running step (megatron.core.fork.mtp.step.running, as SplitStep's and a framework's
own step's are), bound to the trainer's model chunks from ``begin`` to ``end``: its checks, config
hooks, normalization, router scale, statistics and router metrics. ``end`` restores the config,
reduces the step's MTP sums (one collective) and hands them, with the MTP gradient norm, to the
metrics (megatron.core.fork.training_loop.metrics). A step that training_log will not print (its
iteration not a multiple of --log-interval) runs without the metric projections: the sampled
acceptance a line prints is its own iteration's step's, exact over its global batch. An evaluation
is a running step of its own that only measures, every metric (``begin_evaluation`` to
``end_evaluation``). Exact steps are on once the trainer calls ``enable`` (its loss function must
then be megatron.core.fork.mtp.step.main_loss), or with --exact-steps (upstream's loss contract,
at the token level); otherwise the steps are upstream's and only the metrics come from here, so
Megatron-LM's own pretrain_gpt.py keeps working with the series applied.
"""

from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from megatron.core.rerun_state_machine import RerunDataIterator
from megatron.core.utils import get_model_config

from megatron.core.fork.mtp import router_losses, router_metrics
from megatron.core.fork.mtp.step.normalization import MAIN_LOSS_LEVELS, TOKEN, StepNormalization, step_counts
from megatron.core.fork.mtp.step.running import RunningStep
from megatron.core.fork.training_loop import loss_contract, metrics


def loss_mask_of(batch) -> torch.Tensor:
    """The loss mask of a micro-batch as megatron-core's GPT datasets yield it."""
    return batch["loss_mask"]


@dataclass
class _Open:
    step: RunningStep  # a training step, or an evaluation
    microbatches: int = 0


_main_loss_level: str | None = None  # set by enable(): exact steps on, at the run's level
_current: _Open | None = None  # the step or the evaluation between its two hooks


def enable(main_loss_level: str) -> None:
    """Make every step exact; the trainer's loss function must be megatron.core.fork.mtp.step.main_loss.
    Without this, steps are upstream's and only the MTP metrics come from here."""
    global _main_loss_level
    if main_loss_level not in MAIN_LOSS_LEVELS:
        raise ValueError(f"main loss level must be one of {MAIN_LOSS_LEVELS}, got {main_loss_level!r}")
    _main_loss_level = main_loss_level


def main_loss_level(config) -> str | None:
    """The run's main-loss level in exact steps (the trainer's, or the token level of upstream's loss
    contract with --exact-steps); None when its steps are upstream's."""
    if _main_loss_level is not None:
        return _main_loss_level
    return TOKEN if config.exact_steps else None


def begin_evaluation(model) -> None:
    """Before an evaluation: a running step that measures every metric (the metric projections on),
    at the run's main-loss level; in exact steps, routers report their losses there too."""
    global _current
    end()  # an evaluation cut short by the time limit leaves nothing behind
    config = get_model_config(model[0])
    level = main_loss_level(config)
    evaluation = RunningStep(model, main_loss_level=level, metrics=True,
                             router_losses_in_evaluation=level is not None and router_losses.active(config))
    evaluation.enter()
    _current = _Open(evaluation)


def evaluation_router_losses(config, microbatches: int, pg_collection=None) -> dict:
    """After an evaluation of `microbatches` micro-batches (of equal size): its router losses
    as step values, {} unless its routers reported them (``begin_evaluation``). The backbone's
    are reduced by upstream's MoE metrics tracker as it reduces a training step's (the mean over
    the MoE layers), each MTP depth's by the evaluation's router metrics (collectives: every rank
    calls it)."""
    evaluation = _current.step if _current is not None else None
    if evaluation is None or not evaluation.router_losses_in_evaluation:
        return {}
    evaluation.router_losses_in_evaluation = False
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker  # 0.19's tracker

    backbone = {}
    get_moe_metrics_tracker().report(
        loss_scale=1 / microbatches, iteration=0, force_initialize=True,
        track_names=router_metrics.names(config), num_layers=config.num_layers, moe_layer_freq=config.moe_layer_freq,
        mtp_num_layers=config.mtp_num_layers, pg_collection=pg_collection, total_loss_dict=backbone)
    values = {name: float(value) for name, value in backbone.items()}
    values.update(evaluation.router_metrics.step_values(config, microbatches))
    return values


def end_evaluation() -> torch.Tensor | None:
    """After an evaluation: its MTP sums, summed over data-parallel ranks and made known to every
    rank (one collective; every rank must call it), None without MTP; the evaluation closed."""
    evaluation = _current
    end()
    return evaluation.step.reduced_sums()[1] if evaluation is not None else None


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


def _finalize_without_count(step: RunningStep, finalize):
    def finalize_exactly(model, num_tokens=None, **kwargs):
        step.refuse_what_any_rank_found()  # what a rank found in the forward, on every rank, before the reduce
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
    level = main_loss_level(config)
    if level is None:  # upstream's step: only its metrics come from here
        step = RunningStep(model, metrics=metrics)
        step.enter()
        _current = _Open(step, num_microbatches)
        return data_iterator
    router_losses.check_exact_step(config)  # before the step's data is drawn
    virtual = isinstance(data_iterator, list)  # one iterator per virtual stage
    batches = _prefetch(data_iterator, num_microbatches)
    counts, routed = step_counts(_counted_masks(batches, virtual))
    step = RunningStep(model, StepNormalization(level, bool(config.mtp_detach_heads), counts), routed_tokens=routed,
                       grad_scale_func=config.grad_scale_func, metrics=metrics)
    overrides = {"finalize_model_grads_func": _finalize_without_count(step, config.finalize_model_grads_func)}
    if _main_loss_level is None:  # --exact-steps: upstream's loss contract
        overrides.update(loss_contract.main_loss_seed(config, step.normalization.main_scale()))
    step.enter(overrides)
    _current = _Open(step, num_microbatches)
    return _replayable(batches, virtual)


def end(optimizer=None, update_successful: bool = False) -> None:
    """Close the step: config restored, MTP sums and norms handed to the metrics."""
    global _current
    if _current is None:
        return
    (step, microbatches), _current = (_current.step, _current.microbatches), None
    step.exit()
    if optimizer is None:
        return
    norms = getattr(optimizer, "grad_norms_by_group", {}) if update_successful else {}
    counts = step.normalization.counts if step.normalization is not None else None
    metrics.record_step(counts, step.reduced_sums()[1], norms.get("mtp"),
                        step.router_metrics.step_values(step.config, microbatches))
