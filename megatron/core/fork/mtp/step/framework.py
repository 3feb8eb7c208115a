# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""One call around a training step: MTP, router losses, clipping groups and metrics as the spec says.

    with exact_mtp_step(model_chunks, counts=StepCounts(tokens=N_tok, sequences=N_seq),
                        optimizer=optimizer, metrics=logged) as step:
        ...   # the framework's own step: zero_grad, forward_backward_func, optimizer.step()
    step.metrics   # per-depth MTP metrics, mtp grad norm, the MTP depths' router losses

``metrics=True`` (on the steps the framework logs) also measures the sampled and greedy-draft
acceptances, which under ``ce`` need what nothing else does: every MTP row read against the main
head at t + k. The default skips that work; the step's gradients are the same, and its metrics
leave those acceptances out (the per-depth loss, acceptance and chain acceptance are always there).

A framework's step (AReaL's train_batch, NeMo-RL's train, verl's update_policy) is a running step
(megatron.core.fork.mtp.step.running, the one mechanism of every exact step) whose main loss keeps
the framework's normalization, and whose forward_backward_func, finalize_model_grads and optimizer
step run as the framework runs them. The step owns the rest (spec sections 4-7, 11, 12), for its
own model chunks only (a reference model's forwards in the same process are not the step's):

- the MTP branch's seed (normalization.FrameworkNormalization): (lambda / D) S_k / N_tok after the
  framework's gradient reduce, whatever its schedule sets on MTPLossAutoScaler, every draft
  objective of section 12 alike (mtp_loss_type is the model's);
- the routers' scale (loss scale / T) through moe_grad_scale_func, refused where the schedule would
  change it (a framework step that averages micro-batches divides it by their count);
- the MTP clipping group: the optimizer's groups, measured and clipped in its step;
- the metrics: the step's MTP sums and router values reduced once (in its finalize).

A framework whose loss function returns (loss, count, report) in per-token mode, so that
finalize_model_grads divides every gradient by the step's count (verl's per-token regime: its routed
tokens), announces that count up front (``finalize_divisor``): the MTP seed carries it, and the
division leaves the MTP branch exact.

Refused in one line before anything changes: what a running step refuses (section 11's kinds, router
losses with CP), streaming with attached heads, a framework without finalize_model_grads, MoE
router losses in a step that averages micro-batches; found in a forward, on the ranks whose forward
sees it, and raised on every rank in finalize, before the gradient reduce (RunningStep.refuse: no
rank is left waiting): an MTP forward with no loss mask, router losses with upstream's padding
mask, seq_aux_loss on packed rows (megatron.core.fork.mtp.router_losses.check_packed_forward); in
finalize, before the gradient reduce and the optimizer step: counts that contradict the data, a finalize that would
divide every gradient by a count (MTP's too), a router scale the framework replaced, a framework
factor with counts given. A refused or failed step is aborted:
hooks restored, gradients zeroed, no optimizer step.
"""

import torch
from megatron.core import parallel_state
from megatron.core.utils import get_model_config

from megatron.core.fork.mtp import router_losses
from megatron.core.fork.mtp.isolation import MTP_GRAD_NORM_GROUP
from megatron.core.fork.mtp.statistics import metrics_from_sums
from megatron.core.fork.mtp.step.normalization import FrameworkNormalization, StepCounts
from megatron.core.fork.mtp.step.running import MOE_SCALE_HOOK, RunningStep
from megatron.core.fork.runtime import device as compute_device


def _loss_scale(optimizer, config):
    """The loss scale of the moment: the optimizer's, else the config's grad_scale_func's, else 1."""
    def scale() -> float:
        if optimizer is not None and hasattr(optimizer, "get_loss_scale"):
            return float(optimizer.get_loss_scale())
        if config.grad_scale_func is not None:
            return float(config.grad_scale_func(torch.ones(1, device=compute_device.current_device())).item())
        return 1.0
    return scale


class ExactMTPStep(RunningStep):
    def __init__(self, model_chunks, counts=None, *, optimizer=None, routed_tokens: int | None = None,
                 metrics: bool = False, finalize_divisor: int | None = None):
        """`counts`: the step's global StepCounts if known up front (else the streaming form);
        `routed_tokens`: T of spec section 11, needed with MoE router losses; `optimizer`: the one
        the framework steps (its loss scale; its group norms in the metrics); `metrics`: True
        measures the metric projections (megatron.core.fork.mtp.forward_settings.ForwardSettings);
        `finalize_divisor`: the count finalize_model_grads divides every gradient by (see the module)."""
        chunks = list(model_chunks)
        config = get_model_config(chunks[0])
        if config.finalize_model_grads_func is None:
            raise ValueError("a framework step reduces its gradients through config.finalize_model_grads_func "
                             "(megatron-core's finalize_model_grads), which is not set: set it before the step")
        if router_losses.active(config) and not config.calculate_per_token_loss:
            raise ValueError("MoE router losses in a framework's step are exact only with "
                             "calculate_per_token_loss=True: otherwise its schedule divides them by its "
                             "micro-batch count, which the step cannot see. Set calculate_per_token_loss=True "
                             "(as NeMo-RL does), or turn the router losses off (moe_aux_loss_coeff=0, no z-loss)")
        if finalize_divisor is not None and not (config.calculate_per_token_loss and finalize_divisor > 0
                                                 and not router_losses.active(config)):
            raise ValueError(f"finalize_divisor={finalize_divisor}: finalize_model_grads divides by a count only "
                             "with calculate_per_token_loss=True, the count must be > 0, and MoE router losses "
                             "are not normalized under that division")
        if finalize_divisor is not None:
            average = 1.0 / finalize_divisor  # finalize_model_grads, on every gradient
        else:  # the framework's DDP, after backward, on every gradient
            average = 1.0 if config.calculate_per_token_loss else 1.0 / parallel_state.get_data_parallel_world_size(
                with_context_parallel=True)
        normalization = FrameworkNormalization(bool(config.mtp_detach_heads), counts, average,
                                               _loss_scale(optimizer, config))
        if router_losses.active(config) and counts is None:
            raise ValueError("MoE router losses in a framework step need its counts: without them the MTP "
                             "depths' parameters are corrected after the reduce, and their router losses with "
                             "them. Pass exact_mtp_step(chunks, counts=StepCounts(...), routed_tokens=T)")
        super().__init__(chunks, normalization, routed_tokens=routed_tokens,
                         grad_scale_func=optimizer.scale_loss if optimizer is not None else None, metrics=metrics)
        self.optimizer = optimizer
        self.metrics: dict = {}
        self._scaled = 1.0  # the factors the framework applied through scale_gradients
        self.finalize_divisor = finalize_divisor
        self._finalized = False
        self._sums = None
        self._microbatches = 0

    def enter(self, overrides: dict | None = None) -> None:
        """Start the step: finalize_model_grads runs through the step's checks, and the factors the
        framework applies through scale_gradients are recorded."""
        super().enter({"finalize_model_grads_func": self._finalize_through(self.config.finalize_model_grads_func),
                       **(overrides or {})})
        for chunk in self.chunks:
            chunk.scale_gradients = self._recording(chunk.scale_gradients)

    def exit(self) -> None:
        """The config and the chunks as before ``enter``. Idempotent."""
        super().exit()
        for chunk in self.chunks:
            chunk.__dict__.pop("scale_gradients", None)

    def abort(self) -> None:
        """Drop the step: hooks restored, gradients zeroed, no optimizer step taken here."""
        super().abort()
        if self.optimizer is not None:
            self.optimizer.zero_grad()

    def __enter__(self) -> "ExactMTPStep":
        self.enter()
        return self

    def close(self) -> dict:
        """End a framework's step after its optimizer step: hooks restored; its metrics (also kept
        in ``metrics``), the same on every rank (collectives: every rank calls it)."""
        self.exit()
        self.metrics = self._framework_metrics()
        return self.metrics

    def __exit__(self, kind, error, trace) -> bool:
        if kind is not None:
            self.abort()
        else:
            self.close()
        return False

    def _recording(self, scale_gradients):
        def recorded(factor):
            self._scaled *= float(factor)
            return scale_gradients(factor)
        return recorded

    def _finalize_through(self, finalize):
        def finalize_exactly(model, num_tokens=None, **kwargs):
            self.refuse_what_any_rank_found()
            self._check_before_reduce(num_tokens)
            finalize(model, num_tokens, **kwargs)
            for chunk in self.chunks:  # the announced division is in the seed already
                self.normalization.normalize_reduced_gradients(chunk, self._scaled * (self.finalize_divisor or 1))
        return finalize_exactly

    def _check_before_reduce(self, num_tokens) -> None:
        config, step = self.config, self.normalization
        if self._finalized:
            raise RuntimeError("finalize_model_grads ran twice in one exact_mtp_step: one step reduces its "
                               "gradients once (null the hook between chunks and call it once, as NeMo-RL's split "
                               "path does)")
        self._finalized = True
        divisor = torch.zeros(1, dtype=torch.float64, device=step.observed.device)
        if num_tokens is not None:
            divisor += num_tokens.double().sum().to(divisor.device)
        extra, self._sums = self.reduced_sums(torch.cat([step.observed, divisor]))
        tokens, microbatches, divisor = extra.tolist()
        self._microbatches = round(microbatches / parallel_state.get_data_parallel_world_size(
            with_context_parallel=True))
        step.final_counts = StepCounts(tokens=round(tokens), sequences=-1)
        if round(divisor) != (self.finalize_divisor or 0):
            if self.finalize_divisor:
                raise ValueError(f"finalize_model_grads divides by {divisor:.0f}, not by the finalize_divisor given "
                                 f"({self.finalize_divisor}); no gradient was reduced and no optimizer step taken")
            raise ValueError(f"finalize_model_grads would divide every gradient, MTP's too, by the step's count "
                             f"({divisor:.0f}, from (loss, count, report) loss functions in per-token mode): return "
                             "(loss, report) normalized by your counts (as NeMo-RL does), announce the count up "
                             "front (exact_mtp_step(..., finalize_divisor=count)), or drive a SplitStep")
        if step.counts is not None and step.counts.tokens != round(tokens):
            raise ValueError(f"the counts given ({step.counts.tokens} valid next-token targets) differ from the "
                             f"step's data ({round(tokens)}); no gradient was reduced and no optimizer step taken")
        if step.counts is not None and self._scaled != 1.0:
            raise ValueError(f"the framework scaled every gradient by {self._scaled:g} inside a step with counts "
                             "given, which would scale the MTP branch too: normalize the main loss in its loss "
                             "function, or drop the counts (the streaming form)")
        if self.moe_scale is not None and getattr(config, MOE_SCALE_HOOK) is not self.moe_scale:
            raise ValueError("the framework replaced moe_grad_scale_func inside exact_mtp_step, which gives the "
                             "routers the spec's scale (loss scale / routed tokens): drop that assignment")

    def _framework_metrics(self) -> dict:
        if not self._finalized:
            raise RuntimeError("the framework's step never ran finalize_model_grads (no gradient was reduced): "
                               "exact_mtp_step wraps a training step")
        metrics = {"tokens": self.normalization.final_counts.tokens}
        if self._sums is not None:
            metrics["mtp sums"] = self._sums.tolist()
            metrics.update(metrics_from_sums(self._sums))
        norms = getattr(self.optimizer, "grad_norms_by_group", {}) if self.optimizer is not None else {}
        if MTP_GRAD_NORM_GROUP in norms:
            metrics["mtp grad norm"] = float(norms[MTP_GRAD_NORM_GROUP])
        metrics.update(self.router_metrics.step_values(self.config, max(self._microbatches, 1)))
        return metrics


def exact_mtp_step(model_chunks, counts=None, *, optimizer=None, routed_tokens: int | None = None,
                   metrics: bool = False, finalize_divisor: int | None = None) -> ExactMTPStep:
    """A framework's training step made exact for MTP (see the module): use it as a context manager
    around the step, or call ``enter()`` before and ``close()`` after where the step is split over
    calls (``abort()`` drops it)."""
    return ExactMTPStep(model_chunks, counts, optimizer=optimizer, routed_tokens=routed_tokens, metrics=metrics,
                        finalize_divisor=finalize_divisor)
