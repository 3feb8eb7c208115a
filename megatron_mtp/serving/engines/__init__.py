# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Serving engines run as RL frameworks run them: a process of their own, in their own environment,
driven from here (vllm_engine: vLLM's CPU build in `.venv-vllm`, `tools/bootstrap --engine vllm`)."""
