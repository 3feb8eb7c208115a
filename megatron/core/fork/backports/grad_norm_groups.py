# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Gradient-norm groups for megatron-core 0.16.1 (spec section 6).

A parameter tagged with a ``grad_norm_group`` attribute (the isolated MTP heads: "mtp")
is measured and clipped by the norm of its group alone; every other parameter belongs to
the main group. The optimizer's ``step()`` returns the main norm and keeps the separate
groups' norms in ``optimizer.grad_norms_by_group``. megatron-core 0.17 and later do this
upstream with the same attribute and the same result; these functions give 0.16.1's
optimizers that behaviour (patch "Optimizer: measure and clip each gradient-norm group").

The tag follows the parameter to the fp32 main copies that mixed-precision and distributed
optimizers step (``copy_group``), so the optimizer's parameter groups, and therefore its
checkpoints, are the same with and without isolation.
"""

import math

import torch
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, get_grad_norm_fp32

from megatron.core.fork.runtime import device as compute_device

GRAD_NORM_GROUP_ATTR = "grad_norm_group"
SEPARATE_GROUPS = ("mtp",)


def group_of(param) -> str | None:
    """The separate group a parameter is measured in, or None for the main group."""
    return getattr(param, GRAD_NORM_GROUP_ATTR, None)


def copy_group(destination, source) -> None:
    """Carry the tag from a model parameter to the copy the optimizer steps."""
    if hasattr(source, GRAD_NORM_GROUP_ATTR):
        setattr(destination, GRAD_NORM_GROUP_ATTR, getattr(source, GRAD_NORM_GROUP_ATTR))


def _has_group(optimizer, name: str) -> bool:
    """Whether any rank of the optimizer's grad-stats group holds the group (computed once:
    tags are set when the model is built). Every rank then runs the same collectives."""
    cache = optimizer.__dict__.setdefault("_fork_has_grad_norm_group", {})
    if name not in cache:
        local = any(group_of(p) == name for p in optimizer.get_parameters())
        flag = torch.tensor([int(local)], dtype=torch.int, device=compute_device.current_device())
        torch.distributed.all_reduce(
            flag, op=torch.distributed.ReduceOp.MAX, group=optimizer.get_grad_stats_parallel_group()
        )
        cache[name] = bool(flag.item())
    return cache[name]


def _norm(optimizers, select) -> float:
    """Global norm of the selected parameters' gradients over all `optimizers`."""
    squares = 0.0
    for optimizer in optimizers:
        params = [p for p in optimizer.get_parameters() if select(p)]
        grads = optimizer.get_main_grads_for_grad_norm(params=params)
        norm = get_grad_norm_fp32(grads, grad_stats_parallel_group=optimizer.get_grad_stats_parallel_group())
        squares += float(norm) ** 2
    return math.sqrt(squares)


def clip_grad_norm_by_group(optimizers, clip_grad: float | None = None) -> tuple[float, dict]:
    """Measure the main group and every separate group over `optimizers`, clip each group by
    its own norm (with each optimizer's clip_grad, or `clip_grad` if given), and return the
    main norm and {separate group: norm}. With no tagged parameter this is upstream's global
    norm and clip."""
    optimizers = [opt for opt in optimizers if not getattr(opt, "is_stub_optimizer", False)]
    main_norm = _norm(optimizers, lambda p: group_of(p) is None)
    norms = {name: _norm(optimizers, lambda p, name=name: group_of(p) == name)
             for name in SEPARATE_GROUPS if any(_has_group(opt, name) for opt in optimizers)}
    for optimizer in optimizers:
        max_norm = optimizer.config.clip_grad if clip_grad is None else clip_grad
        if max_norm <= 0.0:
            continue
        by_group = {}
        for param in optimizer.get_parameters():
            by_group.setdefault(group_of(param), []).append(param)
        for name, params in by_group.items():
            clip_grad_by_total_norm_fp32(
                params, max_norm, main_norm if name is None else norms[name],
                optimizer.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
            )
    return main_norm, norms
