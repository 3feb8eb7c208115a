# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""An optimizer state saved by a chain of optimizers of another length (the expert parallel
size changed): the common state follows this run's chain, and a per-bucket layout is refused.

The states here have the shape a dist checkpoint load returns: the saved chain's common
state (param groups without their parameter indices, the shared step) merged with this
run's loaded tensors and parameter indices. tests/test_trainer_moe.py trains on from real
checkpoints across EP = 2 -> 1 and EP = 1 -> 2.
"""

from types import SimpleNamespace

import pytest
import torch

from megatron.core.fork.upstream_fixes import chained_optimizer_state
from megatron.core.fork.upstream_fixes.checkpoint_files import CheckpointError

HYPER = {"wd_mult": 1.0, "lr_mult": 1.0, "is_decoupled_lr": False, "lr": 5e-4, "weight_decay": 0.01}
NO_DECAY = {**HYPER, "wd_mult": 0.0, "weight_decay": 0.0}


def optimizer(*groups, expert=False):
    """A stand-in for one MegatronOptimizer: its torch optimizer's param groups."""
    return SimpleNamespace(optimizer=SimpleNamespace(
        param_groups=[{**group, "is_expert_parallel": expert, "params": []} for group in groups]))


def saved(*groups, expert=False, step=3.0):
    return {"state": {"common_step": torch.tensor(step)},
            "param_groups": [{**group, "is_expert_parallel": expert, "lr": 7e-4} for group in groups]}


def loaded(params, first):
    """This run's part of the load: its tensors, and its parameter indices per group."""
    return {"state": {first: {"exp_avg": torch.full((2,), float(first))}},
            "param_groups": [{"params": indices} for indices in params]}


def test_a_chain_of_two_loads_into_one_optimizer():
    state = {0: saved(NO_DECAY, HYPER), 1: saved(HYPER, expert=True), **loaded([[0], [1, 2]], first=1)}
    run = optimizer(HYPER, NO_DECAY)  # another group order than the saved one
    regrouped = chained_optimizer_state.regroup(state, [run])
    assert regrouped["state"]["common_step"].item() == 3.0
    assert regrouped["state"][1]["exp_avg"].tolist() == [1.0, 1.0]
    groups = regrouped["param_groups"]
    assert [(g["wd_mult"], g["params"], g["is_expert_parallel"], g["lr"]) for g in groups] == [
        (1.0, [0], False, 7e-4), (0.0, [1, 2], False, 7e-4)]


def test_one_optimizer_loads_into_a_chain_of_two():
    state = {**saved(HYPER, NO_DECAY), 0: loaded([[0], [1]], first=0), 1: loaded([[0]], first=0)}
    dense, expert = optimizer(HYPER, NO_DECAY), optimizer(HYPER, expert=True)
    regrouped = chained_optimizer_state.regroup(state, [dense, expert])
    assert len(regrouped) == 2
    assert [g["is_expert_parallel"] for g in regrouped[0]["param_groups"]] == [False, False]
    assert [(g["is_expert_parallel"], g["params"]) for g in regrouped[1]["param_groups"]] == [(True, [0])]
    assert all(part["state"]["common_step"].item() == 3.0 for part in regrouped)


def test_each_optimizer_of_the_chain_gets_its_own_nested_groups():
    """The distributed optimizer nests its groups under "optimizer"; one shared dict for the
    chain once gave the dense optimizer the expert's groups."""
    state = {"optimizer": {"param_groups": [{**HYPER, "is_expert_parallel": False}]},
             "param_state_sharding_type": "fully_reshardable",
             0: {"param_state": {"exp_avg": torch.zeros(2)}}, 1: {"param_state": {"exp_avg": torch.ones(2)}}}
    dense, expert = optimizer(HYPER), optimizer(HYPER, expert=True)
    regrouped = chained_optimizer_state.regroup(state, [dense, expert])
    assert [part["optimizer"]["param_groups"][0]["is_expert_parallel"] for part in regrouped] == [False, True]
    assert [part["param_state"]["exp_avg"].tolist() for part in regrouped] == [[0.0, 0.0], [1.0, 1.0]]
    assert all(part["param_state_sharding_type"] == "fully_reshardable" for part in regrouped)


def test_a_state_of_the_same_chain_passes_unchanged():
    single = {**saved(HYPER), **loaded([[0]], first=0)}
    assert chained_optimizer_state.regroup(single, [optimizer(HYPER)]) is single
    chain = {0: {**saved(HYPER)}, 1: {**saved(HYPER, expert=True)}}
    assert chained_optimizer_state.regroup(chain, [optimizer(HYPER), optimizer(HYPER, expert=True)]) is chain


def test_a_group_the_checkpoint_lacks_is_named():
    state = {0: saved(HYPER), 1: saved(HYPER, expert=True), **loaded([[0], [1]], first=0)}
    with pytest.raises(ValueError, match="no optimizer param group with .*0.0"):
        chained_optimizer_state.regroup(state, [optimizer(HYPER, NO_DECAY)])


def chain_of(n):
    return SimpleNamespace(chained_optimizers=[object()] * n)


def test_a_per_bucket_layout_of_another_chain_is_refused_in_one_line():
    per_bucket = {part: {"param_state_sharding_type": "dp_reshardable"} for part in (0, 1)}
    with pytest.raises(CheckpointError) as refused:
        chained_optimizer_state.check_reshardable(per_bucket, chain_of(1))
    message = str(refused.value)
    assert "\n" not in message and "'dp_reshardable' of 2 optimizer(s)" in message and "this run's 1" in message
    assert "--dist-ckpt-optim-fully-reshardable" in message and "--no-load-optim" in message
    chained_optimizer_state.check_reshardable(per_bucket, chain_of(2))  # the same chain: upstream's load
    model_space = {part: {"param_state_sharding_type": "fully_reshardable"} for part in (0, 1)}
    chained_optimizer_state.check_reshardable(model_space, chain_of(1))
    chained_optimizer_state.check_reshardable(saved(HYPER), chain_of(2))  # not distributed: model-keyed
    chained_optimizer_state.check_reshardable(per_bucket, None)  # the optimizer state is not loaded
