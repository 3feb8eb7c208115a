# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""megatron.core.fork.runtime.device stands in for upstream's torch.cuda calls (patch 0002): on GPUs
current_device() returns exactly what torch.cuda.current_device() returns (an int, which the
rerun state machine stores in checkpoints), on the CPU the CPU device."""

import torch

from megatron.core.fork.runtime import device as compute_device


def test_on_a_gpu_current_device_is_upstreams_index(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert compute_device.current_device() == 3 and type(compute_device.current_device()) is int


def test_on_the_cpu_current_device_is_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert compute_device.current_device() == torch.device("cpu")
