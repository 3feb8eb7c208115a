# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Gated DeltaNet's layer pattern both ways: megatron-core's --linear-attention-freq N and
Hugging Face's full_attention_interval N name the same layers."""


def interval_pattern(interval: int, num_layers: int) -> list:
    """Every interval-th layer full attention (0), the others Gated DeltaNet (1)."""
    return [int((i + 1) % interval != 0) for i in range(num_layers)]


def full_attention_interval(layers: list) -> int | None:
    """N when the Gated DeltaNet layers are `interval_pattern(N)`, else None."""
    return next((n for n in range(1, len(layers) + 1) if list(layers) == interval_pattern(n, len(layers))), None)
