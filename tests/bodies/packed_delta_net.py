# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Packed rows (THD) with Gated DeltaNet layers over MoE through the library's exact step
(megatron_mtp.library.step.train_step with a packed forward step) on tensor-, pipeline- and
expert-parallel layouts, against the plain-PyTorch reference (tests/reference/moe.py over
tests/reference/gpt_mtp.py's recurrent Gated DeltaNet within packed segments).

The global batch is ROWS packed rows (one per micro-batch: a packed row is one batch entry) of
tests.bodies.hybrid.DELTA_NET_PACKED's sequences, each padded to a multiple of 4 (as CP = 2
requires), holes in the mask. The step's objective is the spec's: every row's objective sums
over the step's valid targets (no router losses: their per-sequence statistics on packed rows
are not this check's). The one-rank run saves the weights and the reference's gradient; every
layout loads both (tests.bodies.moe_gradients' harness).
"""

from functools import partial

import torch
from megatron.core import parallel_state

from megatron.core.fork.mtp.step_loss import main_loss
from megatron.core.fork.runtime import context_parallel
from megatron_mtp.library.checkpointing import load_checkpoint, save_checkpoint
from megatron_mtp.library.step import train_step
from tests.bodies.context_parallel import packed_params, packed_row
from tests.bodies.hybrid import DELTA_NET_PACKED, slow_decay
from tests.bodies.moe_gradients import compare, fresh_build, one_step, reference_model
from tests.harness.layout import model_parallel
from tests.harness.tiny_gpt import Setup

ROWS = 4
PAD_TO = 4  # 2 x CP at CP = 2


def packed_rows() -> list:
    """ROWS micro-batches (input ids [1, T], loss mask [1, T], labels, segments, padded and
    unpadded cu_seqlens); the loss mask second, where the library's step counts it."""
    rows = []
    for row in range(ROWS):
        (input_ids, labels, mask, segments), padded, unpadded = packed_row(40 + row, 1, DELTA_NET_PACKED,
                                                                           step=PAD_TO)
        rows.append((input_ids, mask, labels, segments, padded, unpadded))
    return rows


def seq_length() -> int:
    return packed_rows()[0][0].size(1)


def packed_forward_step(data_iterator, model):
    """A packed row's per-token loss on this rank's pieces (cut by the padded cu_seqlens under CP)."""
    input_ids, mask, labels, _, padded, unpadded = next(data_iterator)
    positions = torch.arange(input_ids.size(1)).unsqueeze(0)
    if parallel_state.get_context_parallel_world_size() > 1:
        group = parallel_state.get_context_parallel_group()
        input_ids, mask, labels, positions = (context_parallel.shard(t, 1, group, padded)
                                              for t in (input_ids, mask, labels, positions))
    output = model(input_ids, positions, None, labels=labels, loss_mask=mask,
                   packed_seq_params=packed_params(padded, unpadded))
    return output, partial(main_loss, loss_mask=mask)


def this_rank_rows() -> list:
    dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    per_rank = ROWS // dp
    return packed_rows()[rank * per_rank:(rank + 1) * per_rank]


def packed_step(chunks, optimizer):
    return lambda: train_step(chunks, optimizer, this_rank_rows(), seq_length(), forward_step=packed_forward_step)


def reference_grads(ref, model_names: dict) -> dict:
    """The reference's gradient of the step objective (sum of the rows' objective sums over the
    step's valid targets), by the model's names."""
    rows = packed_rows()
    ref.zero_grad(set_to_none=True)
    total = sum(ref.objective_sums(input_ids, labels, mask, segments)
                for input_ids, mask, labels, segments, _, _ in rows)
    (total / sum(row[1].sum() for row in rows)).backward()
    return {model_names[n]: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
            for n, p in ref.named_parameters()}


def setup_of(kwargs: dict) -> Setup:
    return Setup(**kwargs, seq_length=seq_length(), global_batch=ROWS, micro_batch=1)


def reference(ckpt_root: str, setups: dict) -> dict:
    """One rank against the reference; saves each setup's weights and reference gradient."""
    out = {}
    with model_parallel():
        for name, kwargs in setups.items():
            setup = setup_of(kwargs)
            torch.manual_seed(12)
            chunks, optimizer, config = fresh_build(setup)
            slow_decay(chunks[0].module)  # (tests.bodies.hybrid: a decay whose gradient the kernel resolves)
            save_checkpoint(f"{ckpt_root}/{name}", chunks)
            ref, model_names = reference_model(setup, chunks, config)
            want = reference_grads(ref, model_names)
            torch.save(want, f"{ckpt_root}/{name}-reference.pt")
            got = one_step(setup, chunks, optimizer, config, step=packed_step(chunks, optimizer))
            out[name] = compare(got["grads"], want)
    return out


def layouts(ckpt_root: str, layouts: list, setups: dict) -> dict:
    out = {}
    for layout in layouts:
        with model_parallel(tp=layout["tp"], pp=layout["pp"], ep=layout["ep"], cp=layout.get("cp", 1)):
            for name, kwargs in setups.items():
                setup = setup_of({**kwargs, **layout.get("setup", {})})
                chunks, optimizer, config = fresh_build(setup)
                load_checkpoint(f"{ckpt_root}/{name}", chunks)
                got = one_step(setup, chunks, optimizer, config, step=packed_step(chunks, optimizer))
                out[f"{layout['name']}/{name}"] = compare(got["grads"], torch.load(f"{ckpt_root}/{name}-reference.pt"))
    return out
