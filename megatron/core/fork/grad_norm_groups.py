"""Gradient-norm groups: each group of parameters is measured and clipped by its own norm.

A parameter joins a group through its ``grad_norm_group`` attribute (default "main");
the MTP heads join "mtp" when they are isolated (spec section 6). The optimizer's
parameter groups carry the name (``param_group["grad_norm_group"]``), so the main
(fp32) copies that mixed-precision and distributed optimizers step are grouped the
same way as the model parameters. With one group this is exactly upstream's global
norm and clip; the returned norm is the "main" group's, and every group's norm is
kept in ``optimizer.grad_norms_by_group``.
"""

import math

from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, get_grad_norm_fp32

MAIN_GROUP = "main"


def group_name(param_or_group) -> str:
    if isinstance(param_or_group, dict):
        return param_or_group.get("grad_norm_group", MAIN_GROUP)
    return getattr(param_or_group, "grad_norm_group", MAIN_GROUP)


def _params_by_group(optimizer) -> dict:
    groups = {}
    for param_group in getattr(optimizer.optimizer, "param_groups", []):
        groups.setdefault(group_name(param_group), []).extend(param_group["params"])
    return groups


def _ordered(names) -> list:
    return sorted(set(names), key=lambda name: (name != MAIN_GROUP, name))


def clip_grad_norm_by_group(optimizers, clip_grad: float | None = None) -> float:
    """Norm of every group over `optimizers` (each with its own reduction group), then clip
    each group by its own norm with each optimizer's clip_grad (or `clip_grad` if given).

    Every rank holds the same group names (megatron-core aligns parameter groups across
    ranks for checkpointing), so the collectives inside match even where a group is empty.
    """
    per_optimizer = [_params_by_group(opt) for opt in optimizers]
    names = _ordered([MAIN_GROUP] + [n for groups in per_optimizer for n in groups])
    norms = {}
    for name in names:
        squares = 0.0
        for opt, groups in zip(optimizers, per_optimizer):
            grads = opt.get_main_grads_for_grad_norm(params=groups.get(name, []))
            norm = get_grad_norm_fp32(grads, grad_stats_parallel_group=opt.get_grad_stats_parallel_group())
            squares += norm ** 2
        norms[name] = math.sqrt(squares)
    for opt, groups in zip(optimizers, per_optimizer):
        max_norm = opt.config.clip_grad if clip_grad is None else clip_grad
        if max_norm <= 0.0:
            continue
        for name, params in groups.items():
            if params:
                clip_grad_by_total_norm_fp32(
                    params, max_norm, norms[name],
                    opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
                )
    for opt in optimizers:
        opt.grad_norms_by_group = norms
    return norms[MAIN_GROUP]
