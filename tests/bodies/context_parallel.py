# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Context parallelism (CP) on CPU: the layout and the exact MTP roll (megatron.core.fork.
context_parallel), and the GPTModel with MTP at CP = 2 and 4 against the plain-PyTorch
reference (tests/reference/gpt_mtp.py) on the whole batch.

Each CP rank runs its pieces of the rows (upstream's load-balanced split: chunks r and
2*CP-1-r of every sequence, of every padded sequence of a packed row), the loss sums
(main and every MTP depth) are backpropagated there, and the gradients are summed over the
CP group, which is what DDP's reduce over data x context parallel ranks does; every
parameter's gradient must equal the reference's on the whole rows, as must the per-depth
MTP sums reduced over the group (counts exactly).
"""

import itertools

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import multi_token_prediction

from megatron.core.fork.mtp.statistics import STEP_STATISTICS
from megatron.core.fork.runtime import context_parallel
from megatron_mtp.library.model import build_gpt
from tests.bodies.mtp_model import VOCAB, counts_equal, make_config, max_rel, reference_for, reference_sums
from tests.harness.layout import model_parallel

ROW = 24  # a multiple of 2 x CP for CP = 2, 3, 4 and 6
PACKED_LENGTHS = (5, 3, 9, 1)  # odd lengths, one of a single token


def padded_rows(seed: int, length: int = ROW):
    """4 rows of `length` tokens: holes in the mask, row 1 almost fully masked, row 3 padded after 10."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB, (4, length + 1), generator=g)
    tokens[3, 11:] = 0
    mask = (torch.rand(4, length, generator=g) > 0.3).float()
    mask[1, 3:] = 0.0
    mask[3, 10:] = 0.0
    return tokens[:, :-1].clone(), tokens[:, 1:].clone(), mask, None


def packed_row(seed: int, cp: int, lengths=PACKED_LENGTHS, step: int | None = None):
    """One THD row of sequences of PACKED_LENGTHS tokens, each padded to a multiple of `step`
    (default 2 x CP; the padding belongs to its sequence, masked): (input ids, labels, mask,
    segment ids), and the padded and unpadded cu_seqlens."""
    g = torch.Generator().manual_seed(seed)
    step = step or 2 * cp
    padded = [-(-n // step) * step for n in lengths]
    total = sum(padded)
    input_ids = torch.randint(1, VOCAB, (1, total), generator=g)
    labels = torch.zeros_like(input_ids)
    mask = (torch.rand(1, total, generator=g) > 0.2).float()
    segments = torch.zeros_like(input_ids)
    start = 0
    for i, (n, p) in enumerate(zip(lengths, padded, strict=True)):
        labels[0, start:start + n - 1] = input_ids[0, start + 1:start + n]
        mask[0, start + n - 1:start + p] = 0.0  # the last token has no target; padding none
        input_ids[0, start + n:start + p] = 0
        segments[0, start:start + p] = i
        start += p

    def cumulative(lengths):
        return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)

    return (input_ids, labels, mask, segments), cumulative(padded), cumulative(lengths)


def same_weights(model, cp_group) -> None:
    """Every CP rank holds CP rank 0's parameters (they are replicas)."""
    source = dist.get_global_rank(cp_group, 0)
    for param in model.parameters():
        dist.broadcast(param.data, src=source, group=cp_group)


def cp_step(model, rows, cp_group, packed=None) -> dict:
    """This CP rank's forward/backward on its pieces of `rows`; gradients and MTP sums summed
    over the CP group."""
    input_ids, labels, mask, _ = rows
    positions = torch.arange(input_ids.size(1)).unsqueeze(0).expand_as(input_ids)
    padded = None if packed is None else packed.cu_seqlens_q_padded
    pieces = [context_parallel.shard(t, 1, cp_group, padded) for t in (input_ids, labels, mask, positions)]
    local_ids, local_labels, local_mask, local_positions = pieces
    multi_token_prediction.MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    STEP_STATISTICS.reset()
    model.zero_grad(set_to_none=True)
    model.train()
    with STEP_STATISTICS.report_metrics():  # every field is compared with the reference's
        per_token = model(local_ids, local_positions, None, labels=local_labels, loss_mask=local_mask,
                          packed_seq_params=packed)
    (per_token * local_mask).sum().backward()
    grads = {}
    for name, param in model.named_parameters():
        if param.grad is not None:  # the same parameters on every CP rank
            grads[name] = param.grad.clone()
            dist.all_reduce(grads[name], group=cp_group)
    sums = STEP_STATISTICS.local_sums()  # None on pristine upstream (it records none)
    if sums is not None:
        sums = sums.clone()
        dist.all_reduce(sums, group=cp_group)
    main = (per_token.detach() * local_mask).sum()
    dist.all_reduce(main, group=cp_group)
    return {"grads": grads, "sums": sums, "main": main}


def errors_against(got: dict, ref, rows, names=None) -> dict:
    """The CP step's gradients (by the reference's names: `names` maps them), main loss sum and
    MTP sums against the reference's on the whole rows."""
    input_ids, labels, mask, segments = rows
    logits, main_ce, per_depth = ref.losses(input_ids, labels, mask, segments)
    ref.objective_sums(input_ids, labels, mask, segments).backward()
    ref_grads = {name: p.grad for name, p in ref.named_parameters() if p.grad is not None}
    grads = {(names or {}).get(name, name): grad for name, grad in got["grads"].items()}
    names_match = sorted(grads) == sorted(ref_grads)
    ref_sums = reference_sums(logits, per_depth, segments)
    sums = got["sums"]
    return {
        "grad_names": names_match,
        "grads": max(max_rel(grads[n], ref_grads[n]) for n in ref_grads) if names_match else float("inf"),
        "main": max_rel(got["main"], (main_ce * mask).sum().detach()),
        "sums": None if sums is None else max_rel(sums, ref_sums),
        "counts_exact": None if sums is None else counts_equal(sums, ref_sums),
    }


def compare(cp_group, cp: int, depths: int, detach: bool, repeated: bool, layout: str, seed: int) -> dict:
    """`layout`: "padded" or "packed" rows with the default (sparse) MTP loss, or "padded_dense",
    padded rows with upstream's dense MTP loss."""
    dense = {"mtp_sparse_loss": False} if layout == "padded_dense" else {}  # (a field pristine upstream lacks)
    config = make_config(depths, repeated, detach, context_parallel_size=cp, **dense)
    torch.manual_seed(seed)
    model = build_gpt(config, VOCAB, 64, share_embeddings_and_output_weights=False)
    same_weights(model, cp_group)
    packed = None
    if layout in ("padded", "padded_dense"):
        rows = padded_rows(seed)
    else:
        rows, padded, unpadded = packed_row(seed, cp)
        packed = packed_params(padded, unpadded)
    got = cp_step(model, rows, cp_group, packed)
    return errors_against(got, reference_for(model, depths, False, repeated, detach), rows)


def packed_params(padded, unpadded) -> PackedSeqParams:
    longest = int((padded[1:] - padded[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=unpadded, cu_seqlens_kv=unpadded,
                           cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def delta_net_compare(cp_group, cp: int, depths: int, detach: bool, seed: int, packed: bool = False) -> dict:
    """Qwen3-Next's pattern ("G-*-", full attention in the MTP depths) on CP ranks: upstream's Gated
    DeltaNet with CP (an all-to-all from sequence to head parallelism), against the reference's
    recurrent Gated DeltaNet on whole rows longer than the torch kernel's chunk of 64; `packed`: on
    a packed row of tests.bodies.hybrid.DELTA_NET_PACKED's sequences, each padded to a multiple of
    2 x CP (upstream's THD all-to-all; the kernels reset at every padded sequence's start)."""
    from megatron_mtp.library.model import build_hybrid
    from tests.bodies.hybrid import DELTA_NET_FIELDS, DELTA_NET_PACKED, delta_net_reference, slow_decay

    config = make_config(depths, detach=detach, context_parallel_size=cp, **DELTA_NET_FIELDS)
    torch.manual_seed(seed)
    model = build_hybrid(config, VOCAB, 128, "G-*-" + "/*-" * depths)
    slow_decay(model)
    same_weights(model, cp_group)
    if packed:
        rows, padded, unpadded = packed_row(seed, cp, DELTA_NET_PACKED)
        got = cp_step(model, rows, cp_group, packed_params(padded, unpadded))
    else:
        rows = padded_rows(seed, length=72)
        got = cp_step(model, rows, cp_group)
    ref, names = delta_net_reference(model, depths, detach)
    return errors_against(got, ref, rows, names)


def against_reference(cp: int, cases: list) -> dict:
    """Each case (depths, detach, repeated, rows: "padded", "packed", "delta_net" or
    "delta_net_packed", the last two a HybridModel with Gated DeltaNet layers on padded or packed
    rows) at context_parallel_size = `cp` (the rest of the world data-parallel replicas of the
    same check)."""
    out = {}
    with model_parallel(cp=cp):
        cp_group = parallel_state.get_context_parallel_group()
        for i, (depths, detach, repeated, layout) in enumerate(cases):
            name = f"D{depths}-{'iso' if detach else 'att'}-{'rep' if repeated else 'dist'}-{layout}"
            if layout.startswith("delta_net"):
                out[name] = delta_net_compare(cp_group, cp, depths, detach, seed=100 + i,
                                              packed=layout == "delta_net_packed")
            else:
                out[name] = compare(cp_group, cp, depths, detach, repeated, layout, seed=100 + i)
    return out


def _recording_groups(calls: list):
    """Patch torch.distributed's point-to-point and gather calls to record the group each
    one runs on (None: the default, WORLD, group); returns an undo function."""
    names = ("isend", "irecv", "send", "recv", "all_gather", "all_gather_into_tensor", "batch_isend_irecv")
    saved = {name: getattr(dist, name) for name in names}

    def wrap(name, fn):
        def recorded(*args, **kwargs):
            group = kwargs.get("group")
            if name == "batch_isend_irecv":
                group = args[0][0].group if args and args[0] else None
            calls.append((name, group))
            return fn(*args, **kwargs)
        return recorded

    for name, fn in saved.items():
        setattr(dist, name, wrap(name, fn))
    return lambda: [setattr(dist, name, fn) for name, fn in saved.items()]


def rolled_in_sequences(row: torch.Tensor, bounds: list) -> torch.Tensor:
    """The global roll: each sequence [start, end) of `row` moved left by one, its last position 0."""
    want = torch.zeros_like(row)
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        want[..., start:end - 1] = row[..., start + 1:end]
    return want


def roll_checks(cases: list) -> dict:
    """`_roll_check` of each (CP, lengths or None for PACKED_LENGTHS) case, by "cp{CP}-{lengths}"."""
    cases = [(cp, tuple(lengths or PACKED_LENGTHS)) for cp, lengths in cases]
    return {f"cp{cp}-{lengths}": _roll_check(cp, lengths) for cp, lengths in cases}


def upstream_thd_split_is_the_layout(row, padded, cp_group, mine) -> bool:
    """Upstream's packed split (get_batch_on_this_cp_rank with cu_seqlens; without Transformer
    Engine the runtime part's) gives every sequence-dimension tensor the layout's piece. Without
    Transformer Engine that split reads the layout (local_positions) itself, so this checks its
    wiring only: the layout is checked against hand-written indices in tests/in_build/
    test_context_parallel_layout.py."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    batch = {key: row.clone() for key in ("tokens", "labels", "loss_mask", "position_ids")}
    batch.update(cu_seqlens=padded.unsqueeze(0), cu_seqlens_padded=padded.unsqueeze(0))
    split = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=cp_group)
    return all(torch.equal(split[key], mine) for key in ("tokens", "labels", "loss_mask", "position_ids"))


def _roll_check(cp: int, lengths: tuple) -> dict:
    """The MTP roll of a CP rank's pieces (TP = world / CP, so that at CP < world the CP group is
    a strict subgroup): whether every exchange runs on the CP group (#6746); whether whole rows
    and a packed row of sequences of `lengths` tokens, each padded to a multiple of 2 x CP, come
    out as the global roll (#4494); and whether the pieces reassemble into the row. On whichever
    megatron-core runs the body: the series', or pristine upstream with its runtime part (whose
    packed roll fails outright on some rows, e.g. with a sequence of one token)."""
    out = {}
    with model_parallel(tp=dist.get_world_size() // cp, cp=cp):
        cp_group = parallel_state.get_context_parallel_group()
        rows = torch.arange(1, 2 * 8 * cp + 1, dtype=torch.float).view(2, 8 * cp)
        calls = []
        undo = _recording_groups(calls)
        try:
            got, _ = multi_token_prediction.roll_tensor(context_parallel.shard(rows, 1, cp_group), -1, -1, cp_group)
        finally:
            undo()
        want = rolled_in_sequences(rows, [0, rows.size(1)])
        out["row"] = bool(torch.equal(got, context_parallel.shard(want, 1, cp_group)))
        out["on_the_cp_group"] = bool(calls) and all(group is cp_group for _, group in calls)
        _, padded, unpadded = packed_row(0, cp, lengths)
        row = torch.arange(1, int(padded[-1]) + 1, dtype=torch.float).unsqueeze(0)
        want = rolled_in_sequences(row, padded.tolist())
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=unpadded, cu_seqlens_kv=unpadded,
                                 cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded)
        mine = context_parallel.shard(row, 1, cp_group, padded)
        out["unshard"] = bool(torch.equal(context_parallel.unshard(mine, 1, cp_group, padded), row))
        out["thd_split"] = upstream_thd_split_is_the_layout(row, padded, cp_group, mine)
        try:
            got, _ = multi_token_prediction.roll_tensor(mine, -1, -1, cp_group, packed)
            out["packed"] = bool(torch.equal(got, context_parallel.shard(want, 1, cp_group, padded)))
        except Exception as error:  # noqa: BLE001 (upstream's packed roll fails outright on some rows)
            out["packed"] = f"{type(error).__name__}: {error}"
    return out


def refusal_on_this_build():
    """The one-line error of a config with MTP and context_parallel_size = 2, or None if built."""
    try:
        make_config(1, context_parallel_size=2)
    except ValueError as error:
        return str(error)
    return None


def gated_delta_net_head_split_refusal():
    """The one-line error of Gated DeltaNet layers with 2 key heads on 4 context-parallel ranks."""
    from megatron_mtp.library.model import build_hybrid
    from tests.bodies.hybrid import DELTA_NET_FIELDS

    with model_parallel(cp=4):
        try:
            build_hybrid(make_config(1, context_parallel_size=4, **DELTA_NET_FIELDS), VOCAB, 128, "G-*-/*-")
        except ValueError as error:
            return str(error)
    return None
