# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""One place that decides which device megatron-core computes on.

Upstream megatron-core (0.16.1 and 0.19.2 alike) names ``cuda`` in schedules, DDP
buffers, optimizers, gradient clipping, RNG trackers and checkpointing. The fork routes
each of those choices through this module: on a machine with CUDA every helper
returns exactly what the upstream call returned, so GPU behaviour is unchanged;
without CUDA the stack runs on CPU with the gloo backend.
"""

import torch


def cuda_available() -> bool:
    return torch.cuda.is_available()


def current_device() -> int | torch.device:
    """The device this rank computes on: on GPUs exactly what ``torch.cuda.current_device()``
    returns (the device index, an int, as the calls it replaces gave; the rerun state machine
    stores it in checkpoints), else the CPU device (there is no index to give)."""
    if torch.cuda.is_available():
        return torch.cuda.current_device()
    return torch.device("cpu")


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def synchronize() -> None:
    """Wait for queued device work; CPU work is already complete when a call returns."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def distributed_backend() -> str:
    """The collective backend matching ``current_device()``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def get_rng_state() -> torch.Tensor:
    """RNG state of the generator that drives ``current_device()`` (dropout, init)."""
    if torch.cuda.is_available():
        return torch.cuda.get_rng_state()
    return torch.get_rng_state()


def set_rng_state(state: torch.Tensor) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def manual_seed(seed: int) -> None:
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


def current_stream():
    """The current stream of the compute device (a CPU stream, whose waits are no-ops, on CPU)."""
    if torch.cuda.is_available():
        return torch.cuda.current_stream()
    return torch.cpu.current_stream()


def legacy_type(tensor: torch.Tensor) -> str:
    """``tensor.type()`` as upstream compares it: on a CPU-only machine a CPU tensor reports
    the CUDA type name (``torch.cuda.FloatTensor``), so type checks written for the compute
    device hold on either."""
    name = tensor.type()
    if not torch.cuda.is_available() and tensor.device.type == "cpu":
        return name.replace("torch.", "torch.cuda.", 1)
    return name


def device_count() -> int:
    """Compute devices this process can use: its CUDA devices, or the CPU (one)."""
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return 1


def new_stream():
    """A new stream on the compute device (a CPU stream runs in order, like no stream)."""
    if torch.cuda.is_available():
        return torch.cuda.Stream()
    return torch.cpu.Stream()


def use_stream(stream):
    """Context manager making `stream` current on the compute device."""
    if torch.cuda.is_available():
        return torch.cuda.stream(stream)
    return torch.cpu.stream(stream)


def empty_cache() -> None:
    """Release cached device memory; the CPU allocator has no cache to release."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def jit_fuser_on_cuda(function):
    """megatron-core's ``jit_fuser`` (torch.compile) on a machine with CUDA, as upstream applies
    it; elsewhere the function as written (compiling on CPU needs a C++ toolchain and costs more
    than it saves at the sizes run there)."""
    from megatron.core.jit import jit_fuser

    return jit_fuser(function) if torch.cuda.is_available() else function
