# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The weights of a live distributed model as the rollout engine takes them: `weights(chunks, args)`
yields (name, tensor) in the family's Hugging Face names, MTP depths included in the engine's
layout, equal bit for bit to the files `convert_checkpoint.py export` writes from a checkpoint of
the same model (serving.export is the one mapping of both).

The model is gathered as the export reads a checkpoint: every rank's main-replica shards of the
model's sharded state dict (the one dist checkpointing saves, at any TP / PP / VPP / EP layout) are
assembled into global tensors by checkpoint key, then mapped. Every rank of the world takes part
(a collective: all ranks iterate the generator) and every rank receives every tensor, so the ranks
that feed an engine are free to be any of them. The gathered model is held once per rank while it
streams.

Where a serving engine is known to run the MTP layout otherwise than megatron-core trained it,
`warnings(args, ...)` says so (the same sentences the export's output line carries).
"""

import torch
import torch.distributed as dist

from megatron_mtp.serving import ServingError, export


def _shards(chunks) -> list:
    """This rank's (key, global shape, dtype, slices, local tensor) of every main-replica shard."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories, is_main_replica

    metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    shards = []
    for chunk in chunks:
        module = chunk.module if hasattr(chunk, "module") else chunk
        state = module.sharded_state_dict(metadata=metadata)
        apply_factories(state)
        for item in nested_values(state):
            if not isinstance(item, ShardedTensor) or "_extra_state" in item.key:
                continue
            if not is_main_replica(item.replica_id):  # the copy dist checkpointing saves is the main replica's
                continue
            if item.flattened_range is not None:
                raise ServingError(f"{item.key}: a flattened shard (a distributed optimizer's), not a model tensor")
            lead = item.prepend_axis_num
            slices = tuple(slice(offset, offset + 1) for offset in item.global_offset[:lead]) + tuple(
                slice(offset, offset + size) for offset, size in zip(item.global_offset[lead:],
                                                                    item.local_shape, strict=True))
            shards.append((item.key, tuple(item.global_shape), item.data.dtype, slices, item.data))
    return shards


def gather(chunks) -> dict:
    """Every model tensor as a global tensor by checkpoint key, on every rank (a collective)."""
    mine = _shards(chunks)
    described = [None] * dist.get_world_size()
    dist.all_gather_object(described, [(key, shape, dtype, slices) for key, shape, dtype, slices, _ in mine])
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    tensors, own = {}, iter(mine)
    for rank, shards in enumerate(described):
        for key, shape, dtype, slices in shards:
            if key not in tensors:
                tensors[key] = torch.empty(shape, dtype=dtype, device=device)
            elif tensors[key].shape != shape or tensors[key].dtype != dtype:
                raise ServingError(f"{key}: ranks disagree on its global shape or dtype")
            if rank == dist.get_rank():
                buffer = next(own)[4].detach().to(device).reshape(tensors[key][slices].shape).contiguous()
            else:
                buffer = torch.empty(tensors[key][slices].shape, dtype=dtype, device=device)
            dist.broadcast(buffer, src=rank)
            tensors[key][slices] = buffer
    return tensors


def weights(chunks, args, mtp_layout: str | None = None, architecture: str | None = None,
            expert_layout: str | None = None, dtype: str = "fp32"):
    """(Hugging Face name, tensor) of the live model `chunks` (its DDP-wrapped or bare modules, one per
    virtual pipeline stage) trained with `args` (the trainer's arguments), in the order and dtype
    `convert_checkpoint.py export` writes them with the same options; a collective."""
    plan = export.plan(args, mtp_layout, architecture, expert_layout)  # refused before any collective
    hf = export.hf_tensors(plan, gather(chunks), "the live model")
    yield from export.cast(hf, dtype)


def warnings(args, mtp_layout: str | None = None, architecture: str | None = None) -> list[str]:
    """Where an engine is known to serve the streamed MTP layout otherwise than it was trained."""
    plan = export.plan(args, mtp_layout, architecture)
    return export.engine_warnings(plan.cfg, plan.layout)
