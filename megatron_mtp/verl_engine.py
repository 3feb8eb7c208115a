# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""verl's Megatron engine with exact MTP: every call the verl series makes into this project.

verl 0.9.1 trains MTP heads in MegatronEngine.forward_backward_batch
(verl/workers/engine/megatron/transformer_impl.py) through its own GPTModel postprocess
(verl/models/mcore/mtp_patch.py), which normalizes each micro-batch's MTP loss by that micro-batch's
count (calculate_per_token_loss off, verl's default) or weights it by routed / N tokens (its per-token
regime). The series (patches/verl-0.9.1/, applied by `tools/fork framework`) replaces that with the
spec's objective, (lambda / D) sum_k S_k / N_tok over the whole mini-batch, through
megatron.core.fork's exact step; verl's main loss keeps its own normalization:

- ``exact_schedule``: megatron-core's forward_backward_func, as forward_backward_batch calls it, inside
  one exact step (megatron.core.fork.mtp.step's exact_mtp_step) with the mini-batch's counts given up front
  (summed over the data-parallel ranks in one all-reduce; in the per-token regime also the routed tokens
  that finalize_model_grads divides every gradient by). The step ends when the schedule returns: the
  gradients are final then (the schedule reduces them), and the optimizer step is verl's, unchanged.
- ``mtp_block``: around verl's call of the MTP block, what the fork's GPTModel does around its own (the
  last depth's MLP at the rows its loss reads; detached heads' own random streams).
- ``attach_mtp_losses``: the MTP loss branch of verl's postprocess (megatron.core.fork.mtp.loss_branch).
- ``detached_heads``: verl's ``mtp.detach_encoder`` as the spec's detached heads (``mtp_detach_heads``:
  h^0 detached into depth 1 only, the embedding and the output weight detached for every depth, the
  heads' own gradient-norm group), in place of verl's detaching of each depth's inputs, which also cuts
  the chain between depths and leaves the output weight trained by the MTP loss.

Refused in one line before any gradient changes, on every rank: a mini-batch whose loss mask counts a
sequence's first token (no position predicts it: verl's shifted mask would train it across the
sequence's boundary), dynamic context parallelism (its micro-batches are scheduled across the DP x CP
plane, where the step's counts are not the mini-batch's), and what exact_mtp_step refuses.
"""

import contextlib
import re

import torch
import torch.distributed as dist

from megatron.core.fork.mtp import rng as mtp_rng
from megatron.core.fork.mtp.loss_branch import attach_mtp_losses as _attach_mtp_losses
from megatron.core.fork.mtp.loss_branch import rows_of_last_depth
from megatron.core.fork.mtp.step import StepCounts, exact_mtp_step
from megatron.core.fork.runtime import device as compute_device

LOSS = re.compile(r"^mtp_(\d+) loss$")
LEFT_OUT = ("tokens", "mtp sums", "mtp grad norm")  # the optimizer's step, verl's, comes after the metrics


def detached_heads(mtp, override_transformer_config: dict) -> None:
    """verl's ``mtp.detach_encoder`` as the model's ``mtp_detach_heads`` (a TransformerConfig field: the
    bridge builds the model with it); an override of that field that says otherwise is refused."""
    given = override_transformer_config.get("mtp_detach_heads")
    if given is not None and bool(given) != bool(mtp.detach_encoder):
        raise ValueError(f"override_transformer_config.mtp_detach_heads={given} contradicts "
                         f"mtp.detach_encoder={mtp.detach_encoder}, which sets it: drop the override")
    override_transformer_config["mtp_detach_heads"] = bool(mtp.detach_encoder)


def mtp_block(model, input_ids, labels, loss_mask, packed_seq_params) -> contextlib.ExitStack:
    """Entered around verl's call of the MTP block and left by the returned stack's ``close()`` (the
    block's call keeps verl's lines): its last depth's MLP at the rows the loss reads, and, with
    detached heads, the heads' own random streams (megatron.core.fork.mtp.rng)."""
    stack = contextlib.ExitStack()
    stack.enter_context(rows_of_last_depth(model, input_ids, labels, loss_mask, packed_seq_params))
    stack.enter_context(mtp_rng.own_streams(model.config))
    return stack


def attach_mtp_losses(model, hidden_states, input_ids, labels, loss_mask, output_weight, packed_seq_params,
                      runtime_gather_output):
    """The MTP losses attached as the spec normalizes them (megatron.core.fork.mtp.loss_branch): returns
    (h^0, the main head's (logits, bias) where the branch computed them, else None)."""
    return _attach_mtp_losses(model, hidden_states, input_ids, labels, loss_mask, output_weight,
                              packed_seq_params=packed_seq_params, runtime_gather_output=runtime_gather_output)


def _lengths(tensor) -> list:
    return tensor.offsets().diff().tolist()


def _local_counts(data) -> torch.Tensor:
    """[valid next-token targets, sequences with one, sequences whose first token is a target] of this
    rank's mini-batch: its loss mask (1 where a token is a target) spans each sequence's last tokens, the
    whole sequence or its response, as verl builds the model's mask (prompt zeros, then the mask)."""
    input_ids, loss_mask = data["input_ids"], data["loss_mask"]
    if not (input_ids.is_nested and loss_mask.is_nested):
        raise ValueError("verl's Megatron engine takes nested (unpadded) input_ids and loss_mask")
    values = loss_mask.values().double()
    counts = torch.zeros(3, dtype=torch.float64)
    start = 0
    for total, length in zip(_lengths(input_ids), _lengths(loss_mask), strict=True):
        mask = values[start:start + length]
        start += length
        counts[0] += mask.sum()
        counts[1] += float(mask.sum() > 0)
        counts[2] += float(total == length and length > 0 and mask[0] != 0)
    return counts


def _finalize_divisor(engine, micro_batches) -> float:
    """What verl's per-token regime makes finalize_model_grads divide by: each micro-batch's routed
    tokens, a context-parallel rank's share of them (postprocess_micro_batch_func), over the ranks."""
    cp = engine.engine_config.context_parallel_size
    return float(cp * sum(int(engine._routed_num_tokens(batch)) // cp for batch in micro_batches))


class ExactSchedule:
    """forward_backward_func inside one exact step (see the module); ``mtp_metrics``: verl's
    ``mtp_losses/mtp_k_loss`` of the step and, on a step verl logs, the acceptances."""

    def __init__(self, engine, data, micro_batches, forward_only: bool, schedule):
        self.schedule, self.step, self.mtp_metrics = schedule, None, {}
        mtp = engine.model_config.mtp
        if forward_only or not (mtp.enable and mtp.enable_train):
            return
        if engine.engine_config.dynamic_context_parallel:
            raise ValueError("exact MTP steps do not take dynamic context parallelism (its micro-batches are "
                             "scheduled over the DP x CP ranks): turn dynamic_context_parallel off")
        config = engine.tf_config
        per_token = bool(config.calculate_per_token_loss)
        local = torch.cat([_local_counts(data), torch.tensor(
            [_finalize_divisor(engine, micro_batches) if per_token else 0.0], dtype=torch.float64)])
        local = local.to(compute_device.current_device())
        dist.all_reduce(local, group=engine.get_data_parallel_group())
        tokens, sequences, first_targets, divisor = (round(x) for x in local.tolist())
        if first_targets:
            raise ValueError(f"{first_targets} sequence(s) of the mini-batch count their first token as a target, "
                             "which no position predicts (verl's shifted loss mask would train it across the "
                             "sequence's boundary): set loss_mask to 0 at each sequence's first token")
        from verl.utils import tensordict_utils as tu

        self.logged = bool(tu.get_non_tensor_data(data, key="update_lr_scheduler", default=False))
        self.step = exact_mtp_step(engine.module, StepCounts(tokens=tokens, sequences=sequences),
                                   optimizer=engine.optimizer, metrics=self.logged,
                                   finalize_divisor=divisor if per_token else None)

    def __call__(self, **kwargs):
        if self.step is None:
            return self.schedule(**kwargs)
        with self.step:  # a refused or failed step is aborted: gradients zeroed, hooks restored
            losses = self.schedule(**kwargs)
        self.mtp_metrics = verl_metrics(self.step.metrics, self.logged)
        return losses


def exact_schedule(engine, data, micro_batches, forward_only: bool, schedule) -> ExactSchedule:
    """forward_backward_batch's schedule, exact for MTP (see the module)."""
    return ExactSchedule(engine, data, micro_batches, forward_only, schedule)


def verl_metrics(metrics: dict, logged: bool) -> dict:
    """The step's metrics in verl's names: every step ``mtp_losses/mtp_k_loss`` (the spec's S_k / M_k), on
    a logged step also ``mtp_acceptance/...`` (each depth's acceptance, chain acceptance, sampled and
    greedy-draft acceptances, and the expected accepted lengths, the verifier's bonus token counted)."""
    out = {}
    for key, value in metrics.items():
        if key in LEFT_OUT or key.endswith(" tokens") or not isinstance(value, float | int):
            continue
        if LOSS.match(key):
            out[f"mtp_losses/{key.replace(' ', '_')}"] = float(value)
        elif logged:
            name = re.sub(r"[^0-9a-z]+", "_", key.replace("(incl. bonus token)", "").lower()).strip("_")
            out[f"mtp_acceptance/{name}"] = float(value)
    return out
