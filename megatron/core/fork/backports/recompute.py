# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Activation recompute of an MTP layer whose inputs include non-tensor arguments.

Upstream passes every keyword argument of the recomputed function to
``tensor_parallel.checkpoint`` positionally; a ``PackedSeqParams`` (packed THD rows)
then reaches ``save_for_backward`` and fails. Here tensors (and None) go through the
checkpoint, and everything else is bound by name in a closure.
"""

import torch
from megatron.core import tensor_parallel


def checkpoint_with_kwargs(forward_func, distribute_saved_activations: bool, *args, **kwargs):
    through = [name for name, value in kwargs.items() if value is None or isinstance(value, torch.Tensor)]
    bound = {name: value for name, value in kwargs.items() if name not in through}
    n_args = len(args)

    def run(*inputs):
        return forward_func(*inputs[:n_args], **bound, **dict(zip(through, inputs[n_args:])))

    return tensor_parallel.checkpoint(
        run, distribute_saved_activations, *args, *[kwargs[name] for name in through]
    )
