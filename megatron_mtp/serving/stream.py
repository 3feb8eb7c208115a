# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The weights of a live distributed model as the rollout engine takes them: `weights(chunks, args)`
yields (name, tensor) in the family's Hugging Face names, MTP depths included in the engine's
layout, equal bit for bit to the files `convert_checkpoint.py export` writes from a checkpoint of
the same model (serving.mapping's parts are the one mapping of both); `buckets` groups them into
batches of bounded size, as an engine's weight update takes them (engines.vllm_engine).

The model is gathered as the export reads a checkpoint, one part of the export at a time
(mapping.hf_parts: the embedding, each decoder layer, the final norm and head, each MTP depth):
every rank's main-replica shards of the model's sharded state dict (the one dist checkpointing
saves, at any TP / PP / VPP / EP layout) that the part reads are assembled into global tensors,
mapped, yielded, and dropped before the next part is gathered. A rank holds at most one part's
global tensors (its largest: a decoder layer with all its experts, or the embedding) and the batch
its consumer keeps, never the whole model (benchmarks/weight_stream_bench.py measures it). Every
rank of the world takes part (a collective: all ranks iterate the generator, in the same order)
and every rank receives every tensor, so the ranks that feed an engine are free to be any of them.

Where a serving engine is known to run the MTP layout otherwise than megatron-core trained it,
`warnings(args, ...)` says so (the same sentences the export's output line carries).
"""

import hashlib

import torch
import torch.distributed as dist

from megatron_mtp.serving import ServingError, experts, export, mapping


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


def _layer_stacked(key: str) -> bool:
    """A key of megatron-core's decoder that holds every layer (a leading layer axis), as local_names reads it."""
    return key.startswith("decoder.layers.") and not key[len("decoder.layers."):].split(".")[0].isdigit()


class _Model:
    """Where every shard of the model lives (a collective to build): each piece a model tensor name
    (a layer-stacked key cut into one name per layer), its global shape and dtype, and its shards
    as (rank, index in that rank's shards, slices)."""

    def __init__(self, chunks):
        self.mine = _shards(chunks)
        described = [None] * dist.get_world_size()
        dist.all_gather_object(described, [(key, shape, dtype, slices) for key, shape, dtype, slices, _ in self.mine])
        self.device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
            else torch.device("cpu")
        self.pieces = {}  # name -> (shape, dtype, [(rank, index, slices)]), in the order the ranks describe
        for rank, shards in enumerate(described):
            for index, (key, shape, dtype, slices) in enumerate(shards):
                if _layer_stacked(key):
                    name = f"decoder.layers.{slices[0].start}.{key[len('decoder.layers.'):]}"
                    shape, slices = shape[1:], slices[1:]
                else:
                    name = key
                held = self.pieces.setdefault(name, (shape, dtype, []))
                if held[0] != shape or held[1] != dtype:
                    raise ServingError(f"{key}: ranks disagree on its global shape or dtype")
                held[2].append((rank, index, slices))

    def gather(self, prefixes: tuple) -> dict:
        """The global tensors of the pieces whose names start with one of `prefixes` (a collective)."""
        tensors = {}
        for name, (shape, dtype, shards) in self.pieces.items():
            if not name.startswith(prefixes):
                continue
            tensors[name] = torch.empty(shape, dtype=dtype, device=self.device)
            for rank, index, slices in shards:
                target = tensors[name][slices]
                if rank == dist.get_rank():
                    target.copy_(self.mine[index][4].detach().reshape(target.shape))
                    dist.broadcast(target if target.is_contiguous() else target.contiguous(), src=rank)
                elif target.is_contiguous():  # a shard along the first axis: received in place
                    dist.broadcast(target, src=rank)
                else:
                    buffer = torch.empty(target.shape, dtype=dtype, device=self.device)
                    dist.broadcast(buffer, src=rank)
                    target.copy_(buffer)
        return tensors


def weights(chunks, args, mtp_layout: str | None = None, architecture: str | None = None,
            expert_layout: str | None = None, dtype: str = "fp32", mtp: bool | None = None):
    """(Hugging Face name, tensor) of the live model `chunks` (its DDP-wrapped or bare modules, one per
    virtual pipeline stage) trained with `args` (the trainer's arguments), in the order and dtype
    `convert_checkpoint.py export` writes them with the same options; a collective. `mtp`: True, the
    MTP depths' tensors only (a drafter's own); False, all but theirs (the target's); None, all."""
    from megatron_mtp.serving.model import local_names

    plan = export.plan(args, mtp_layout, architecture, expert_layout)  # refused before any collective
    cfg, expected = plan.cfg, plan.expected()
    model, mapped, streamed, repeated = _Model(chunks), set(), set(), {}
    plan.check_mtp_tensors(model.pieces, "the live model")
    for is_mtp, reads, part in mapping.hf_parts(cfg, plan.layout):
        if mtp is not None and is_mtp != mtp:
            continue
        hf = part(local_names(model.gather(reads), cfg.num_layers))
        if unknown := sorted(set(hf) - set(expected)):
            raise ServingError(f"internal: streamed names the loaders do not know ({unknown[:3]})")
        mapped.update(hf)
        for name, value in export.cast(experts.stack(hf, cfg.adapter.published_experts, plan.expert_layout,
                                                     cfg.num_layers), dtype):
            if name in streamed:  # a layout that holds one tensor for every depth: sent once, the same each time
                if repeated.get(name) != _digest(value):  # mapping.join's check, without holding the first
                    raise mapping.depths_differ("the live model", name)
                continue
            streamed.add(name)
            if is_mtp:
                repeated[name] = _digest(value)
            yield name, value
        del hf
    if mtp is None:
        plan.check_names(mapped, "the streamed")


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().cpu().contiguous().view(torch.uint8).numpy()).hexdigest()


def buckets(named_tensors, bucket_bytes: int):
    """Lists of (name, tensor) of at most `bucket_bytes` each (a tensor larger than that alone), in order."""
    if bucket_bytes <= 0:
        raise ServingError(f"bucket size {bucket_bytes}: must be positive")
    bucket, size = [], 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def update_engine(engine, chunks, args, bucket_bytes: int, drafts: bool, **options) -> int:
    """The live model's weights into a running engine in place, no restart, as an RL framework's refit
    pushes them after a step (a collective: every rank streams; the rank that holds the engine
    passes it, the others None). `drafts`: the engine drafts with the MTP depths, so the drafter's
    weights go too, in a weight update of their own (vLLM updates one model per update; a drafter
    left out drafts with its old weights: verl #6947, SGLang #34495); the target's update takes the
    rest. Batches of at most `bucket_bytes`; `options` as weights()'s. Returns the bytes this rank sent."""
    sent = 0
    for mtp, draft in (((True, True),) if drafts else ()) + ((False, False),):
        batches = buckets(weights(chunks, args, mtp=mtp, **options), bucket_bytes)
        if engine is None:
            for _ in batches:  # the other ranks' share of the gathers
                pass
        else:
            sent += engine.update_weights(batches, draft=draft)
    return sent


def warnings(args, mtp_layout: str | None = None, architecture: str | None = None) -> list[str]:
    """Where an engine is known to serve the streamed MTP layout otherwise than it was trained."""
    plan = export.plan(args, mtp_layout, architecture)
    return export.engine_warnings(plan.cfg, plan.layout)
