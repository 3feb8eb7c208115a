# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Exact steps for a loss function with upstream pretrain_gpt.py's per-token contract.

Megatron-LM's pretrain_gpt.py returns, per micro-batch, the raw masked CE sum and its token
count; with --calculate-per-token-loss the schedules back-propagate that raw sum (through
``config.grad_scale_func``, the optimizer's loss scale) and finalize_model_grads divides
every gradient by the step's token count, MTP and router-loss branches included, which
upstream then rescales by local counts (#7452). With ``--exact-steps`` the step instead
seeds the raw main sum with 1/N_tok here: ``grad_scale_func`` becomes the loss scale times
the step's main scale, and the MTP branch keeps the bare loss scale through
``mtp_grad_scale_func`` (its own 1/N_tok is seeded by megatron.core.fork.mtp.loss_branch), as the
router losses do through ``moe_grad_scale_func``. A user keeps their entry script and loss
function; the steps are pretrain_gpt_mtp.py's at the token level.
"""

import torch

from megatron.core.fork.runtime import device as compute_device


def main_loss_seed(config, main_scale: float) -> dict:
    """The config hooks that scale the main loss's raw sum by `main_scale` in the backward
    pass, and nothing else (the step sets them for its duration)."""
    grad_scale_func = config.grad_scale_func

    def loss_scale():
        one = torch.ones(1, device=compute_device.current_device())
        return grad_scale_func(one) if grad_scale_func is not None else one

    hooks = {"grad_scale_func": lambda loss: loss * (loss_scale() * main_scale).to(loss.device)}
    if config.mtp_grad_scale_func is None:
        hooks["mtp_grad_scale_func"] = loss_scale
    return hooks
