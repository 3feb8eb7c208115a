# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""GPU path: local and Transformer Engine layers, bf16 and NCCL, and detached heads that leave
the backbone bit-identical on CUDA (the MTP streams through the CUDA RNG tracker). Skipped on
CPU-only machines; tools/gpu_check.sh runs these with the trainer's GPU runs."""

import importlib.util

import pytest

from tests.harness import launch
from tests.test_detached_heads import check_bit_identical

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_bf16_training_step_on_gpu_matches_the_sdpa_spec():
    (result,) = launch("tests.bodies.gpu:bf16_steps", 1, {}, timeout=600, use_gpus=True)
    assert result["device"] == "cuda"
    assert result["current_device"] == ["int", True]  # upstream's value, not a torch.device
    for step in result["local"]:
        assert step["lm loss"] == step["lm loss"] and step["grad norm"] > 0
    if result["transformer_engine"] is not None:
        for te, local in zip(result["transformer_engine"], result["local"], strict=True):
            assert abs(te["lm loss"] - local["lm loss"]) / local["lm loss"] < 5e-2


def test_detached_heads_leave_the_backbone_bit_identical_on_gpu(tmp_path):
    # deterministic kernels (Megatron-LM's --deterministic-mode): the comparison is of two runs
    impl = "transformer_engine" if importlib.util.find_spec("transformer_engine") else "local"
    check_bit_identical(tmp_path, 1, ("--transformer-impl", impl, "--deterministic-mode"),
                        env={"CUDA_VISIBLE_DEVICES": "0"})


def test_packed_gated_deltanet_with_fla_matches_the_recurrent_reference():
    """Packed rows with Gated DeltaNet on upstream's GPU path (flash-linear-attention's
    causal_conv1d and chunk_gated_delta_rule with cu_seqlens, bf16): the logits within 3e-2 of the
    float32 reference's (relative to their largest), and within a fifth of how far the reference
    moves when the sequences are not separated."""
    if importlib.util.find_spec("fla") is None:
        pytest.skip("flash-linear-attention is not installed (upstream's Gated DeltaNet needs it on GPUs)")
    (result,) = launch("tests.bodies.gpu:packed_delta_net", 1, {}, timeout=600, use_gpus=True)
    assert result["device"] == "cuda" and result["fla"], result
    assert result["error"] < 3e-2 and result["error"] < result["boundary_effect"] / 5, result
