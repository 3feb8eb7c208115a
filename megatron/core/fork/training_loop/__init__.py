# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Part "training-loop": the MTP-exact steps and metrics of Megatron-LM's own training loop
(megatron.training, shipped in the megatron-core sdist from 0.17 on). megatron.training calls these from a few
hooks (patch "MTP: exact steps and metrics in megatron.training"); nothing here runs in
megatron-core without it.

- exact_step: each step is the spec's objective, with counts up front (spec section 4), a running
  step (megatron.core.fork.mtp.step.running) bound to the trainer's model; evaluations too.
- checkpoint, model_shape: what checkpoints carry for MTP training, checked on load.
- loss_contract: the loss function's returns the exact step reads.
- metrics: per-depth MTP metrics for the console, TensorBoard and W&B, with counters that
  span steps and survive a checkpoint.
"""
