# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Bodies for tests/test_step_refusals.py: a refusal found inside exact_mtp_step's forward on some
ranks only (the last data-parallel rank's micro-batches; under PP, the last stage sees it), in a
NeMo-RL-shaped step (per-token mode, counts given: tests/bodies/frameworks.py)."""

import time

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron.core.fork.mtp.step import StepCounts, active, exact_mtp_step
from megatron_mtp.library.batches import rank_microbatches
from megatron_mtp.library.step import gpt_per_token_loss
from tests.bodies.frameworks import LAMBDA, MICRO_BATCH, MOE, ROUTER, _state_of, _unchanged
from tests.bodies.normalization import SEQ, batch, build
from tests.harness.layout import model_parallel


def _forward_of(model, case: str, refusing: bool):
    """The model's forward as this rank's step calls it: on a refusing rank without its loss mask
    (no_loss_mask), or with a padding mask (padding_mask, which the router losses refuse)."""
    if not refusing:
        return model
    if case == "no_loss_mask":
        return lambda *args, loss_mask=None, **kwargs: model(*args, **kwargs)
    return lambda inputs, *args, **kwargs: model(inputs, *args, padding_mask=torch.zeros_like(inputs, dtype=torch.bool),
                                                 **kwargs)


def refuse_in_step(ckpt_root: str, layout: list, case: str) -> dict:
    """One step through exact_mtp_step whose last data-parallel rank's forwards are refused (`case`):
    how each rank ended, after how long, and what the step left behind."""
    tp, pp, cp, ep = layout
    tokens, mask = batch()
    with model_parallel(tp=tp, pp=pp, cp=cp, ep=ep):
        fields = {}
        if ep > 1:
            fields = dict(MOE, expert_model_parallel_size=ep, **(ROUTER if case == "padding_mask" else {}))
        torch.manual_seed(5)
        chunks, optimizer, config = build(False, lam=LAMBDA, calculate_per_token_loss=True, **fields)
        microbatches = rank_microbatches(tokens, mask, MICRO_BATCH)
        counts = StepCounts(tokens=int(mask.sum()), sequences=int((mask.sum(dim=1) > 0).sum()))
        refusing = parallel_state.get_data_parallel_rank() == parallel_state.get_data_parallel_world_size() - 1

        def forward_step(data_iterator, model):
            batch_tokens, batch_mask = next(data_iterator)
            output, piece = gpt_per_token_loss(_forward_of(model, case, refusing), batch_tokens, batch_mask)
            return output, lambda out: ((out * piece).sum() / counts.tokens, {})

        before = _state_of(chunks, config, optimizer)
        started = time.monotonic()
        outcome = {"refused": None, "message": None}
        try:
            with exact_mtp_step(chunks, counts, optimizer=optimizer,
                                routed_tokens=tokens[:, :-1].numel() if case == "padding_mask" else None):
                many = len(chunks) > 1
                get_forward_backward_func()(
                    forward_step_func=forward_step,
                    data_iterator=[iter(microbatches) for _ in chunks] if many else iter(microbatches),
                    model=chunks if many else chunks[0], num_microbatches=len(microbatches), seq_length=SEQ,
                    micro_batch_size=MICRO_BATCH, forward_only=False)
                optimizer.step()
        except Exception as error:  # noqa: BLE001 (what each rank ended with is the result)
            outcome = {"refused": type(error).__name__, "message": str(error)}
        return {**outcome, "seconds": time.monotonic() - started, "refusing": refusing,
                **_unchanged(before, _state_of(chunks, config, optimizer)), "inactive": active() is None}
