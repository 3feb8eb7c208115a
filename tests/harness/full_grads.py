# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Every rank's gradients reassembled into full tensors by global parameter name.

After a step's finalize_model_grads, each rank holds the reduced gradient of its own
parameters: tensor-parallel shards (split along `partition_dim`), replicas of the others
(one per TP rank, e.g. norms, which sequence parallelism reduces over TP), one pipeline
stage's decoder layers (local indices), and, for MTP on the last stage, a second copy of
the word embedding. `gathered_full_grads` returns, for each global name, every copy of
its full gradient that the layout holds (TP shards concatenated in TP-rank order, one
entry per replica and per stage holding it), taken from data-parallel rank 0 (DP replicas
are equal after the reduce). Every copy must equal the reference's gradient.
"""

import torch
import torch.distributed as dist
from megatron.core import parallel_state


def global_name(model, name: str) -> str:
    """Local parameter name with the decoder layer index made global (PP and VPP offsets)."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(model.decoder.layers[int(parts[2])].layer_number - 1)
    return ".".join(parts)


def shard_sections(chunk) -> dict:
    """{local parameter name: the sizes of the sections each TP rank's shard is made of}, for the
    parameters whose full tensor is every rank's first section, then every rank's second, and so
    on, rather than rank after rank: a gated linear unit's first MLP projection ([gate; up], SwiGLU)
    and a Gated DeltaNet's input projection (q, k, v, gate, beta, alpha) and convolution (q, k, v)."""
    sections = {}
    gated = bool(chunk.module.config.gated_linear_unit)
    for module_name, module in chunk.module.named_modules():
        prefix = f"{module_name}." if module_name else ""
        if gated and module_name.endswith("mlp") and ".experts" not in module_name and hasattr(module, "linear_fc1"):
            for param_name, param in module.linear_fc1.named_parameters():
                sections[f"{prefix}linear_fc1.{param_name}"] = [param.size(0) // 2] * 2
        if hasattr(module, "in_proj_split_sections"):
            parts = list(module.in_proj_split_sections)
            sections[f"{prefix}in_proj.weight"] = parts
            sections[f"{prefix}conv1d.weight"] = parts[:3]
    return sections


def _local_pieces(chunks) -> list:
    pieces = []
    for chunk in chunks:
        sections = shard_sections(chunk)
        for name, param in chunk.module.named_parameters():
            split = bool(getattr(param, "tensor_model_parallel", False))
            split = sections.get(name, True) if split else False
            pieces.append((global_name(chunk.module, name), split, getattr(param, "partition_dim", 0),
                           param.main_grad.detach().float().cpu()))
    return pieces


def gathered_full_grads(chunks) -> dict:
    """{global name: [full gradient of each copy]}, the same on every rank."""
    mine = (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_data_parallel_rank(),
            parallel_state.get_tensor_model_parallel_rank(), _local_pieces(chunks))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    stages = {}
    for pp, dp, tp, pieces in everyone:
        if dp == 0:
            stages.setdefault(pp, {})[tp] = pieces
    full = {}
    for pp in sorted(stages):
        by_tp = [stages[pp][tp] for tp in sorted(stages[pp])]
        for i, (name, split, dim, _) in enumerate(by_tp[0]):
            shards = [pieces[i][3] for pieces in by_tp]
            assert all(pieces[i][0] == name for pieces in by_tp), "TP ranks disagree on the parameters"
            if isinstance(split, list):  # section by section (shard_sections)
                parts = [shard.split(split, dim=dim) for shard in shards]
                full.setdefault(name, []).append(
                    torch.cat([part[k] for k in range(len(split)) for part in parts], dim=dim))
            elif split:
                full.setdefault(name, []).append(torch.cat(shards, dim=dim))
            else:
                full.setdefault(name, []).extend(shards)
    return full


def all_gather_distributed_optimizer_shards(chunks) -> None:
    """With the distributed optimizer each data-parallel rank holds only its shard of every
    gradient bucket reduced (reduce-scatter; the rest of the bucket is its local, unreduced
    gradient): all-gather the reduced shards into every rank's buckets, so that `main_grad`
    holds the full reduced gradient for `gathered_full_grads`. The optimizer reads only its
    own shard, which this leaves as it was."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    for chunk in chunks:
        for group in list(chunk.bucket_groups) + list(getattr(chunk, "expert_parallel_bucket_groups", [])):
            size = group.intra_distributed_optimizer_instance_size
            rank = group.intra_distributed_optimizer_instance_rank
            for bucket in group.buckets:
                shards = shard_buffer(bucket.grad_data, size)
                mine = shards[rank].clone()
                dist.all_gather(list(shards), mine, group=group.intra_distributed_optimizer_instance_group)


def max_rel_to_reference(full: dict, reference: dict) -> float:
    """Largest deviation of any copy from the reference gradient, relative to the reference's
    largest magnitude; infinite if a parameter is missing, extra, or of another shape."""
    if sorted(full) != sorted(reference):
        return float("inf")
    worst = 0.0
    for name, want in reference.items():
        for got in full[name]:
            if got.shape != want.shape:
                return float("inf")
            error = ((got - want).abs().max() / want.abs().max().clamp(min=1e-12)).item()
            worst = max(worst, error if error == error else float("inf"))
    return worst
