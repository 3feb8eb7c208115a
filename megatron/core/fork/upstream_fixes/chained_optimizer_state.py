# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""An optimizer state saved by one chain of optimizers, loaded into another.

megatron-core builds one optimizer for every parameter when the experts share the dense
process groups (expert parallel size 1 and expert TP equal to TP), and a ChainedOptimizer of
two, dense and expert, when they do not. A dist checkpoint nests its common optimizer state
(the param groups, the shared step, the sharding type) by that chain, ``{0: dense, 1:
expert}`` or one dict, while the state tensors are keyed by the model's parameters
(``chained_optim_avoid_prefix``) and so reshard across expert parallel sizes by themselves.
Loaded with a chain of another length, upstream looks for the common state under keys that
are not there ("Could not find parameter group", KeyError 'optimizer'): a checkpoint saved
with EP = 2 could not resume with EP = 1, nor the other way round.

``regroup`` hands each optimizer of this run the saved chain's common state with the loaded
tensors in place: for each of its param groups the saved group with the same identifier
(megatron-core's ``param_group_identifier_keys``; the dense and expert groups carry the same
hyperparameters and differ only in ``is_expert_parallel``, which follows the receiving
optimizer), and the first saved optimizer's other common entries (the chain's steps are
synchronized, so any one holds the step). ``check_reshardable`` refuses, before any tensor
is read, a distributed-optimizer state whose layout is per DP bucket and so cannot follow
the parameters to another chain.
"""

import torch

from megatron.core.fork.upstream_fixes.checkpoint_files import CheckpointError

# DistributedOptimizer's layouts keyed by the model's parameters (the others are per bucket).
MODEL_SPACE_LAYOUTS = ("fully_reshardable", "fully_sharded_model_space", "fsdp_dtensor")


def chain_length(optimizer) -> int:
    """How many optimizers `optimizer` (a MegatronOptimizer, chained or not) holds."""
    return len(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def saved_chain(state: dict) -> list:
    """The saved optimizers' common state dicts in chain order (one unless chained)."""
    positions = sorted(key for key in state if isinstance(key, int))
    return [state[key] for key in positions] if positions else [state]


def check_reshardable(saved_state: dict | None, optimizer) -> None:
    """Raise CheckpointError, naming the way out, if the common optimizer state `saved_state` was
    written by a chain of another length than `optimizer`'s in a layout that cannot follow
    the parameters there."""
    if not saved_state or optimizer is None:
        return
    saved = saved_chain(saved_state)
    if len(saved) == chain_length(optimizer):
        return
    layouts = {part.get("param_state_sharding_type") for part in saved if isinstance(part, dict)}
    per_bucket = sorted(str(layout) for layout in layouts - {None} if layout not in MODEL_SPACE_LAYOUTS)
    if per_bucket:
        raise CheckpointError(
            f"the checkpoint's optimizer state is in the per-bucket layout {per_bucket[0]!r} of "
            f"{len(saved)} optimizer(s), which cannot be resharded to this run's "
            f"{chain_length(optimizer)} (the expert parallel size changed): save it with "
            "--dist-ckpt-optim-fully-reshardable, or load with --no-load-optim")


def regroup(state_dict: dict, optimizers: list):
    """`state_dict` (as a dist checkpoint load returns it: the saved chain's common state
    merged with this run's loaded tensors) for `optimizers`, this run's chain: a dict for one
    optimizer, a list in chain order for several; unchanged when the chains agree."""
    positions = sorted(key for key in state_dict if isinstance(key, int))
    rest = {key: value for key, value in state_dict.items() if not isinstance(key, int)}
    if len(optimizers) == 1:
        if not positions:
            return state_dict
        saved, loaded = [state_dict[key] for key in positions], [rest]
    else:
        if not rest:
            return state_dict
        saved, loaded = [rest], [state_dict[key] for key in positions]
    if len(loaded) != len(optimizers):
        raise ValueError(f"the loaded optimizer state has {len(loaded)} parts for this run's "
                         f"{len(optimizers)} optimizers")
    saved_groups = {}
    for group in (group for part in saved for group in _param_groups(part)):
        saved_groups.setdefault(_identifier(group), group)
    regrouped = []
    for optimizer, tensors in zip(optimizers, loaded):
        state = _with_tensors(saved[0], tensors)
        _set_param_groups(state, _groups_for(optimizer, saved_groups, _param_groups(tensors)))
        regrouped.append(state)
    return regrouped[0] if len(optimizers) == 1 else regrouped


def _groups_for(optimizer, saved_groups: dict, placeholders: list) -> list:
    """The saved groups in the order of `optimizer`'s own, each with this run's parameter
    indices (the load's placeholders, which a dist checkpoint keeps out of the saved state)
    and this optimizer's ``is_expert_parallel``."""
    own = optimizer.optimizer.param_groups
    if placeholders and len(placeholders) != len(own):
        raise ValueError(f"the loaded optimizer state has {len(placeholders)} param groups for "
                         f"this optimizer's {len(own)}")
    groups = []
    for index, group in enumerate(own):
        key = _identifier(group)
        if key not in saved_groups:
            raise ValueError(f"the checkpoint has no optimizer param group with {key}; it has "
                             f"{sorted(saved_groups, key=str)}")
        regrouped = {**saved_groups[key], "is_expert_parallel": group.get("is_expert_parallel", False)}
        if placeholders:
            regrouped["params"] = placeholders[index]["params"]
        groups.append(regrouped)
    return groups


def _identifier(group: dict) -> tuple:
    """The group's identifier as megatron-core matches saved groups, but for the dense/expert
    flag (a chain of another length puts the same parameters on the other side)."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    return tuple(group.get(key, group.get(f"pre_{key}")) for key in param_group_identifier_keys
                 if key != "is_expert_parallel")


def _param_groups(state: dict) -> list:
    """Every param group in `state`, wherever the optimizer type nests them."""
    found = []
    for key, value in state.items():
        if key == "param_groups" and isinstance(value, list):
            found.extend(value)
        elif isinstance(value, dict):
            found.extend(_param_groups(value))
    return found


def _set_param_groups(state: dict, groups: list) -> None:
    for key, value in state.items():
        if key == "param_groups" and isinstance(value, list):
            state[key] = groups
        elif isinstance(value, dict):
            _set_param_groups(value, groups)


def _with_tensors(common: dict, loaded: dict) -> dict:
    """A copy of `common`'s nested dicts (each optimizer of the chain gets its own), with
    every tensor of `loaded` at its place, as a dist checkpoint load merges the common state
    with the tensors it read."""
    merged = {key: _with_tensors(value, {}) if isinstance(value, dict) else value for key, value in common.items()}
    for key, value in loaded.items():
        if isinstance(value, dict):
            merged[key] = _with_tensors(merged.get(key) if isinstance(merged.get(key), dict) else {}, value)
        elif isinstance(value, torch.Tensor) or key not in merged:
            merged[key] = value
    return merged
