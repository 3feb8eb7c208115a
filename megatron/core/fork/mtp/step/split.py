# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""One optimizer step, driven as begin -> accumulate(chunk) x n -> finish (or abort).

An RL or SFT controller that sends a step in chunks calls ``accumulate`` once per chunk;
a plain trainer calls it once. Chunks run forward/backward through megatron-core's own
schedules (``get_forward_backward_func``) on raw loss sums, with gradient
synchronisation and finalize_model_grads held back; ``finish`` reduces the step's counts
once, runs finalize_model_grads once (which reduces the gradients), applies the exact
normalization of megatron.core.fork.mtp.step.normalization, clips each gradient-norm group by its
own norm, steps the optimizer and returns the step's exact metrics. What every exact step
does around that (checks, config hooks, binding to its chunks, normalization, router scale, the
one reduce of its sums) is the running step's (megatron.core.fork.mtp.step.running), which each
``begin`` opens.

Requires ``calculate_per_token_loss=True`` and a forward step whose loss function is
``main_loss`` (megatron.core.fork.mtp.step.loss_function, or one returning the same triple).
Micro-batches are opaque to the step (tensors, tuples or dicts, whatever the forward step reads);
the schedule's shapes are given to the constructor. Not thread-safe: one step per process at a
time.
"""

import contextlib

import torch
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron.core.fork.mtp.isolation import MTP_GRAD_NORM_GROUP
from megatron.core.fork.mtp.statistics import metrics_from_sums
from megatron.core.fork.mtp.step.normalization import MAIN_LOSS_LEVELS, TOKEN, StepCounts, StepNormalization
from megatron.core.fork.mtp.step.running import RunningStep
from megatron.core.fork.runtime import device as compute_device

MAIN_GRAD_NORM_GROUP = "main"


def _no_sync_inside_step():
    return contextlib.nullcontext()


class SplitStep:
    """One exact optimizer step sent in chunks: ``begin``, ``accumulate`` once per chunk, ``finish``
    (or ``abort``). Every chunk split of the same data gives the same step (spec section 5).

    Args:
        model_chunks (list[MegatronModule]): the DDP-wrapped model chunks of this rank (one, or
            one per virtual pipeline stage), as megatron-core's schedules take them; their
            config needs ``calculate_per_token_loss=True``.
        optimizer (MegatronOptimizer): the optimizer whose ``step()`` ends the step; with
            ``--mtp-detach-heads`` built with the MTP gradient-norm group (its own clipping).
        forward_step_func (callable): megatron-core's forward step, ``(data_iterator, model) ->
            (output, loss_func)``, its loss function ``main_loss`` or one returning the same triple
            (loss sum, token count, a report with "main loss sums").
        seq_length (int): the schedule's sequence length (every chunk's micro-batches).
        micro_batch_size (int): the schedule's micro-batch size.
        main_loss (str): the main loss's level, ``"token"`` (sum over valid tokens / N_tok) or
            ``"sequence"`` (sum of per-sequence means / N_seq); the loss function reads it from
            the running step.
    """

    def __init__(self, model_chunks, optimizer, forward_step_func, *, seq_length: int, micro_batch_size: int,
                 main_loss: str = TOKEN):
        self.chunks = list(model_chunks)
        self.config = self.chunks[0].config
        if main_loss not in MAIN_LOSS_LEVELS:
            raise ValueError(f"main loss level must be one of {MAIN_LOSS_LEVELS}, got {main_loss!r}")
        self.optimizer = optimizer
        self.forward_step_func = forward_step_func
        self.seq_length = seq_length
        self.micro_batch_size = micro_batch_size
        self.main_loss = main_loss
        self._step = None  # the running step, between begin and finish
        self._no_sync = None
        self._main_sums = None
        self._microbatches = 0

    @property
    def in_progress(self) -> bool:
        """Whether a step has begun and neither finished nor been aborted."""
        return self._step is not None

    def begin(self, counts: "StepCounts | None" = None, *, routed_tokens: int | None = None,
              metrics: bool = False) -> None:
        """Start a step: checks the model and the counts, zeroes the gradients, holds back the
        gradient sync and finalize_model_grads until ``finish``.

        Args:
            counts (StepCounts, optional): the step's global counts (N_tok, N_seq) over every
                chunk and data-parallel rank, if known. Given, each loss is scaled as it runs;
                omitted, the step is normalized in ``finish`` by the counts it observed (exact
                in both modes; given counts that the data contradicts fail ``finish``).
            routed_tokens (int, optional): with MoE router losses, the step's input positions
                over all chunks and data-parallel ranks (T of spec section 11, known from the
                shapes even when the valid counts are not); required up front in either mode.
            metrics (bool): True (on a step whose metrics are logged) also measures the sampled
                and greedy-draft acceptances, which under ``ce`` need every MTP row read against
                the main head at t + k; the default skips that work and leaves those metrics out.
                The gradients are the same either way.

        Raises:
            RuntimeError: a step is already in progress.
            ValueError: what spec section 10 refuses, in one line, before any state changes.
        """
        if self.in_progress:
            raise RuntimeError("this step is already in progress; finish() or abort() it first")
        if not self.config.calculate_per_token_loss:
            raise ValueError("split steps need calculate_per_token_loss=True (raw loss sums per micro-batch)")
        step = RunningStep(self.chunks, StepNormalization(self.main_loss, bool(self.config.mtp_detach_heads), counts),
                           routed_tokens=routed_tokens, grad_scale_func=self.optimizer.scale_loss, metrics=metrics)
        # Nothing has changed yet: everything above may refuse.
        # The schedules neither finalize nor synchronize inside a step. The optimizer's
        # (dynamic, for fp16) loss scale reaches the main loss through the schedules and every
        # MTP depth through MTPLossAutoScaler; unscaling then restores each branch exactly
        # (pinning a branch to 1 would leave it 1/S too small).
        step.enter({"finalize_model_grads_func": None, "no_sync_func": _no_sync_inside_step,
                    "grad_sync_func": None, "grad_scale_func": self.optimizer.scale_loss})
        self._step = step
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._no_sync = contextlib.ExitStack()
        for chunk in self.chunks:
            self._no_sync.enter_context(chunk.no_sync())
        self._microbatches = 0
        self._main_sums = torch.zeros(3, dtype=torch.float64, device=compute_device.current_device())

    def accumulate(self, microbatches: list) -> None:
        """Forward and backward over one chunk's micro-batches through megatron-core's schedule:
        raw loss sums into the gradients, no gradient sync. An error aborts the step.

        Args:
            microbatches (list): the chunk's micro-batches, whatever ``forward_step_func`` reads
                from its iterator (an empty list is a no-op).
        """
        if not self.in_progress:
            raise RuntimeError("begin() the step before accumulate()")
        if not microbatches:
            return
        try:
            many = len(self.chunks) > 1
            losses = get_forward_backward_func()(
                forward_step_func=self.forward_step_func,
                data_iterator=[iter(microbatches) for _ in self.chunks] if many else iter(microbatches),
                model=self.chunks if many else self.chunks[0],
                num_microbatches=len(microbatches),
                seq_length=self.seq_length,
                micro_batch_size=self.micro_batch_size,
                forward_only=False,
            )
            for entry in losses:  # the last pipeline stage's loss reports
                self._main_sums += entry["main loss sums"].double()
            self._microbatches += len(microbatches)
        except BaseException:
            self.abort()
            raise

    def finish(self) -> dict:
        """Reduce the step's counts and sums once, run finalize_model_grads, normalize, clip each
        gradient-norm group by its own norm and step the optimizer. An error aborts the step.

        Returns:
            dict: "lm loss" (the main loss, exact over the step), "tokens" and "sequences" (the
            observed global counts), "grad norm" and "grad norms" (by group; "mtp grad norm"
            with detached heads), "skipped" (the optimizer skipped the update), and with MTP the
            per-depth metrics of spec section 7 (``statistics.metrics_from_sums``) with their
            raw "mtp sums", and each MTP depth's router losses with MoE.
        """
        if not self.in_progress:
            raise RuntimeError("begin() the step before finish()")
        try:
            self._step.refuse_what_any_rank_found()  # what a rank found in the forwards, on every rank
            self._release_step_hooks()
            # The step's one reduce of counts and metric sums.
            main_sums, mtp_sums = self._step.reduced_sums(self._main_sums)
            main_sum, tokens, sequences = main_sums.tolist()
            observed = StepCounts(tokens=int(round(tokens)), sequences=int(round(sequences)))
            router = self._step.router_metrics.step_values(self.config, self._microbatches)
            step = self._step.normalization
            if step.counts is not None and step.counts != observed:
                raise ValueError(
                    f"the counts given to begin() ({step.counts}) differ from the step's data ({observed}); "
                    "no optimizer step was taken"
                )
            step.final_counts = observed
            # Without a token count finalize_model_grads reduces and divides by nothing; the
            # step's normalization then divides by its global counts (if not seeded up front).
            finalize_model_grads(self.chunks, num_tokens=None)
            for chunk in self.chunks:
                step.normalize_reduced_gradients(chunk)
            update_successful, grad_norm, _ = self.optimizer.step()
        except BaseException:
            self.abort()
            raise
        self._end()
        denominator = observed.tokens if self.main_loss == TOKEN else observed.sequences
        # The optimizer returns the main group's norm and keeps separate groups' by name.
        grad_norms = {}
        if update_successful and grad_norm is not None:
            grad_norms[MAIN_GRAD_NORM_GROUP] = float(grad_norm)
            grad_norms.update({k: float(v) for k, v in getattr(self.optimizer, "grad_norms_by_group", {}).items()})
        result = {
            "lm loss": main_sum / denominator if denominator else 0.0,
            "tokens": observed.tokens,
            "sequences": observed.sequences,
            "grad norm": grad_norms.get(MAIN_GRAD_NORM_GROUP, float("nan")),
            "grad norms": grad_norms,
            "skipped": not update_successful,
        }
        if MTP_GRAD_NORM_GROUP in grad_norms:
            result["mtp grad norm"] = grad_norms[MTP_GRAD_NORM_GROUP]
        if mtp_sums is not None:
            result["mtp sums"] = mtp_sums.tolist()
            result.update(metrics_from_sums(mtp_sums))
        result.update(router)  # each MTP depth's router losses (MoE)
        return result

    def abort(self) -> None:
        """Drop the step: gradients zeroed, hooks and scales as before begin(), no optimizer step."""
        if not self.in_progress:
            return
        self._release_step_hooks()
        self._step.abort()
        self.optimizer.zero_grad()
        self._end()

    def _release_step_hooks(self) -> None:
        if self._no_sync is not None:
            self._no_sync.close()
            self._no_sync = None
        self._step.exit()

    def _end(self) -> None:
        self._step = None
