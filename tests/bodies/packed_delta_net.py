# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Packed rows (THD) with Gated DeltaNet layers over MoE through the library's exact step
(megatron_mtp.library.step.train_step with a packed forward step) on tensor-, pipeline- and
expert-parallel layouts, against the plain-PyTorch reference (tests/reference/moe.py over
tests/reference/gpt_mtp.py's recurrent Gated DeltaNet within packed segments).

The global batch is ROWS packed rows (one per micro-batch: a packed row is one batch entry) of
the given sequence lengths (default tests.bodies.hybrid.DELTA_NET_PACKED's), each padded to a
multiple of `step` (default 4, as CP = 2 requires; 1: no padding), holes in the mask. The step's
objective is the spec's: every row's objective sums over the step's valid targets, plus the MoE
router losses of section 11 where the setup has them (T: every position of the ROWS rows, each
row one micro-batch of aux_loss). The one-rank run saves the weights, the reference's gradient and
its MTP depths' router-loss values; every layout loads them (tests.bodies.moe_gradients' harness).
`refusals` runs the steps the router losses refuse on packed rows.
"""

from functools import partial

import torch
from megatron.core import parallel_state

from megatron.core.fork.mtp.step import main_loss
from megatron.core.fork.runtime import context_parallel
from megatron_mtp.library.checkpointing import load_checkpoint, save_checkpoint
from megatron_mtp.library.step import train_step
from tests.bodies.context_parallel import packed_params, packed_row
from tests.bodies.hybrid import DELTA_NET_PACKED, slow_decay
from tests.bodies.moe_gradients import compare, depth_router_losses, fresh_build, one_step, reference_model
from tests.harness.layout import model_parallel
from tests.harness.tiny_gpt import Setup
from tests.reference.moe import router_loss_terms

ROWS = 4
PAD_TO = 4  # 2 x CP at CP = 2


def packed_rows(lengths=DELTA_NET_PACKED, step=PAD_TO) -> list:
    """ROWS micro-batches (input ids [1, T], loss mask [1, T], labels, segments, padded and
    unpadded cu_seqlens); the loss mask second, where the library's step counts it."""
    rows = []
    for row in range(ROWS):
        (input_ids, labels, mask, segments), padded, unpadded = packed_row(40 + row, 1, lengths, step=step)
        rows.append((input_ids, mask, labels, segments, padded, unpadded))
    return rows


def packed_forward_step(data_iterator, model, padding_mask: bool = False):
    """A packed row's per-token loss on this rank's pieces (cut by the padded cu_seqlens under CP);
    `padding_mask`: with upstream's padding mask for the routers (none of the row's positions)."""
    input_ids, mask, labels, _, padded, unpadded = next(data_iterator)
    positions = torch.arange(input_ids.size(1)).unsqueeze(0)
    if parallel_state.get_context_parallel_world_size() > 1:
        group = parallel_state.get_context_parallel_group()
        input_ids, mask, labels, positions = (context_parallel.shard(t, 1, group, padded)
                                              for t in (input_ids, mask, labels, positions))
    extra = {"padding_mask": torch.zeros_like(input_ids, dtype=torch.bool)} if padding_mask else {}
    output = model(input_ids, positions, None, labels=labels, loss_mask=mask,
                   packed_seq_params=packed_params(padded, unpadded), **extra)
    return output, partial(main_loss, loss_mask=mask)


def this_rank_rows(rows: list) -> list:
    dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    per_rank = ROWS // dp
    return rows[rank * per_rank:(rank + 1) * per_rank]


def packed_step(chunks, optimizer, rows: list, padding_mask: bool = False):
    return lambda: train_step(chunks, optimizer, this_rank_rows(rows), rows[0][0].size(1),
                              forward_step=partial(packed_forward_step, padding_mask=padding_mask))


def stacked_entries(entries: list, rows: int) -> list:
    """The reference's router entries of `rows` rows run one after another, as one batch of
    `rows` rows per router call (the router losses' statistics over the step)."""
    calls, left = divmod(len(entries), rows)
    assert not left, (len(entries), rows)
    return [{key: torch.cat([entries[row * calls + call][key] for row in range(rows)]) for key in entries[call]}
            for call in range(calls)]


def reference_grads(ref, model_names: dict, setup: Setup, rows: list) -> tuple[dict, dict]:
    """The reference's gradient of the step objective (the rows' objective sums over the step's
    valid targets, plus the router losses over the step's tokens, each row a micro-batch), by the
    model's names, and its MTP depths' router-loss values as the step reports them."""
    ref.zero_grad(set_to_none=True)
    ref.router_entries.clear()
    total = sum(ref.objective_sums(input_ids, labels, mask, segments)
                for input_ids, mask, labels, segments, _, _ in rows)
    ref.router_entries[:] = stacked_entries(ref.router_entries, len(rows))
    terms = router_loss_terms(ref.router_entries, ref.options, 1)
    (total / sum(row[1].sum() for row in rows) + sum(terms.values(), torch.zeros(()))).backward()
    grads = {model_names[n]: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
             for n, p in ref.named_parameters()}
    return grads, depth_router_losses(ref, setup, 1)


def setup_of(kwargs: dict, rows: list) -> Setup:
    return Setup(**kwargs, seq_length=rows[0][0].size(1), global_batch=ROWS, micro_batch=1)


def result(got: dict, want: dict) -> dict:
    return {"grads": compare(got["grads"], want["grads"]), "metrics": got["metrics"],
            "depth_router_losses": want["depth_router_losses"]}


def reference(ckpt_root: str, setups: dict, lengths=DELTA_NET_PACKED, step=PAD_TO) -> dict:
    """One rank against the reference; saves each setup's weights and reference values."""
    out, rows = {}, packed_rows(lengths, step)
    with model_parallel():
        for name, kwargs in setups.items():
            setup = setup_of(kwargs, rows)
            torch.manual_seed(12)
            chunks, optimizer, config = fresh_build(setup)
            slow_decay(chunks[0].module)  # (tests.bodies.hybrid: a decay whose gradient the kernel resolves)
            save_checkpoint(f"{ckpt_root}/{name}", chunks)
            ref, model_names = reference_model(setup, chunks, config)
            grads, depth_losses = reference_grads(ref, model_names, setup, rows)
            want = {"grads": grads, "depth_router_losses": depth_losses}
            torch.save(want, f"{ckpt_root}/{name}-reference.pt")
            out[name] = result(one_step(setup, chunks, optimizer, config, step=packed_step(chunks, optimizer, rows)),
                               want)
    return out


def layouts(ckpt_root: str, layouts: list, setups: dict, lengths=DELTA_NET_PACKED, step=PAD_TO) -> dict:
    out, rows = {}, packed_rows(lengths, step)
    for layout in layouts:
        with model_parallel(tp=layout["tp"], pp=layout["pp"], ep=layout["ep"], cp=layout.get("cp", 1)):
            for name, kwargs in setups.items():
                setup = setup_of({**kwargs, **layout.get("setup", {})}, rows)
                chunks, optimizer, config = fresh_build(setup)
                load_checkpoint(f"{ckpt_root}/{name}", chunks)
                got = one_step(setup, chunks, optimizer, config, step=packed_step(chunks, optimizer, rows))
                out[f"{layout['name']}/{name}"] = result(got, torch.load(f"{ckpt_root}/{name}-reference.pt"))
    return out


def refusals(cases: dict) -> dict:
    """Each case's step (`setup` on packed rows of `lengths` padded to multiples of `step`, with
    upstream's padding mask where `padding_mask`) at one rank: its one-line refusal (None: it
    ran), and whether the weights are untouched."""
    out = {}
    with model_parallel():
        for name, case in cases.items():
            rows = packed_rows(case["lengths"], case["step"])
            chunks, optimizer, _ = fresh_build(setup_of(case["setup"], rows))
            before = {n: p.detach().clone() for n, p in chunks[0].module.named_parameters()}
            try:
                packed_step(chunks, optimizer, rows, case.get("padding_mask", False))()
                message = None
            except ValueError as error:
                message = str(error)
            out[name] = {"message": message, "unchanged": all(torch.equal(p, before[n])
                                                              for n, p in chunks[0].module.named_parameters())}
    return out
