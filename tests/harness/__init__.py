# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Run a test body on N real gloo processes with a TP x PP x DP layout; see launcher.py."""

from tests.harness.launcher import DistributedTestFailure, launch

__all__ = ["launch", "DistributedTestFailure"]
