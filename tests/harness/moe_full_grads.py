# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""tests.harness.full_grads for MoE layouts: expert-parallel experts gathered by global index.

Under expert parallelism (EP) each EP rank holds num_experts / EP experts, named
`local_experts.{j}` (j local); their global index is ep_rank * local + j. Expert parameters are
split over the expert-tensor-parallel group (ETP) and replicated over the expert-data-parallel
group (their gradients reduced there), not over the dense data-parallel group. Everything else is
as in full_grads: TP shards joined in TP order, each TP replica and each pipeline stage's copy
one entry, taken from (expert-)data-parallel rank 0; under context parallelism each CP rank's
copy of a dense parameter is one entry too (their gradients are reduced over DP x CP). With SwiGLU
(gated_linear_unit) a column-parallel fc1 shard holds [gate shard; up shard]: the full weight is
[all gates; all ups]; a Gated DeltaNet's input projection and convolution are joined section by
section likewise (full_grads.shard_sections).
"""

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from tests.harness.full_grads import global_name, shard_sections


def expert_global_name(name: str, ep_rank: int, local_experts: int) -> str:
    parts = name.split(".")
    if "local_experts" in parts:
        i = parts.index("local_experts") + 1
        parts[i] = str(ep_rank * local_experts + int(parts[i]))
    return ".".join(parts)


def _join(shards: list, dim: int, split):
    """The full tensor of TP / ETP shards: rank after rank (split True), or each shard made of
    sections of these sizes (a list), every rank's first section, then every rank's second, ..."""
    if split is True:
        return torch.cat(shards, dim=dim)
    parts = [shard.split(split, dim=dim) for shard in shards]
    return torch.cat([part[k] for k in range(len(split)) for part in parts], dim=dim)


def gathered_full_grads_and_buffers(chunks, config) -> tuple[dict, dict]:
    """({global name: [full gradient of each copy]}, {global name of each expert_bias: [copies]}),
    the same on every rank."""
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    local = (config.num_moe_experts or 1) // parallel_state.get_expert_model_parallel_world_size()
    coords = dict(pp=parallel_state.get_pipeline_model_parallel_rank(), dp=parallel_state.get_data_parallel_rank(),
                  cp=parallel_state.get_context_parallel_rank(),
                  tp=parallel_state.get_tensor_model_parallel_rank(),
                  edp=parallel_state.get_expert_data_parallel_rank(),
                  etp=parallel_state.get_expert_tensor_parallel_rank())
    glu = bool(config.gated_linear_unit)
    pieces, buffers = [], []
    for chunk in chunks:
        module = chunk.module
        sections = shard_sections(chunk)
        for name, param in module.named_parameters():
            expert = ".local_experts." in name
            split, dim = bool(getattr(param, "tensor_model_parallel", False)), getattr(param, "partition_dim", 0)
            if split and glu and name.endswith("linear_fc1.weight") and dim == 0:  # experts' and shared experts' too
                split = [param.size(0) // 2] * 2
            elif split:
                split = sections.get(name, True)
            pieces.append((expert_global_name(global_name(module, name), ep_rank, local), expert, split, dim,
                           param.main_grad.detach().float().cpu()))
        for name, buf in module.named_buffers():
            if name.endswith("expert_bias"):
                buffers.append((global_name(module, name), buf.detach().float().cpu().clone()))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (coords, pieces, buffers))
    groups, bias = {}, {}
    for coords, pieces, buffers in everyone:
        for name, value in buffers:
            bias.setdefault(name, []).append(value)
        for name, expert, split, dim, grad in pieces:
            replica_rank, shard_rank = (coords["edp"], coords["etp"]) if expert else (coords["dp"], coords["tp"])
            if replica_rank != 0:
                continue
            replica = (coords["pp"], None if expert else coords["cp"])
            key = (name, replica, None if split else shard_rank)
            groups.setdefault(key, (split, dim, {}))[2][shard_rank] = grad
    full = {}
    for (name, _, _), (split, dim, shards) in sorted(groups.items(), key=lambda kv: str(kv[0])):
        ordered = [shards[r] for r in sorted(shards)]
        full.setdefault(name, []).append(_join(ordered, dim, split) if split else ordered[0])
    return full, bias
