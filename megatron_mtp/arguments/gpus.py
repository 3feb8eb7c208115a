# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""What this machine has: the packages installed (Transformer Engine, apex's kernels,
flash-linear-attention), the NVIDIA GPUs its kernel driver exposes, and whether CUDA is usable."""

import glob
import os

from megatron_mtp import moe_arguments


def missing(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None


def nvidia_devices() -> list[str]:
    """The NVIDIA GPUs the kernel driver exposes: device nodes, or the driver's /proc entries."""
    return sorted(glob.glob("/dev/nvidia[0-9]*")) or sorted(glob.glob("/proc/driver/nvidia/gpus/*"))


def unusable_gpus() -> str | None:
    """Why a machine with NVIDIA GPUs cannot use them (torch finds no CUDA), or None: the CPU
    defaults are for machines without GPUs, or runs that hide them (CUDA_VISIBLE_DEVICES=)."""
    import torch

    if os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1"):
        return None
    devices = nvidia_devices()
    if not devices:
        return None
    if torch.version.cuda is None:
        why = f"torch {torch.__version__} is a CPU-only build (install a CUDA build of torch)"
    else:
        try:
            torch.cuda.init()
            why = "torch sees no CUDA device (check CUDA_VISIBLE_DEVICES and the driver)"
        except Exception as error:  # the driver's own reason
            why = " ".join(str(error).split())[:300] or type(error).__name__
    return (f"this machine has NVIDIA GPUs ({', '.join(devices[:2])}{', ...' if len(devices) > 2 else ''}) but "
            f"CUDA is unusable: {why}; fix that, or set CUDA_VISIBLE_DEVICES= to train on the CPU on purpose")


def capability_deferred(args) -> bool:
    """A --dry-run for GPUs (moe_arguments.targets_cuda) on a machine without CUDA: Megatron-LM's
    validate_args asks the GPU's compute capability for --moe-grouped-gemm (>= 8.0), which only
    that GPU answers; the dry run validates everything else, the run checks it when it starts."""
    import torch

    return args.moe_grouped_gemm and not torch.cuda.is_available() and moe_arguments.targets_cuda(args)
