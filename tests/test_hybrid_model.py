# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""HybridModel, upstream's successor of GPTModel, trains MTP exactly through the same fork hooks
(issue 18): a hybrid pattern that is the GPT network ("*-" per layer: attention layer, then MLP
layer; "/*-" per MTP depth) on the GPT's weights gives the plain-PyTorch reference's main loss,
MTP loss, per-depth statistics (counts exact) and every parameter's gradient, for D in {1, 2},
isolation off and on, sparse and dense MTP loss. Upstream's HybridModel normalizes each depth
by a local count (process_mtp_loss, #7452) and fails it.

Tolerance: relative 1e-5 of each compared tensor's largest magnitude (float32 round-off).
0.16.1's hybrid model predates the pattern's MTP part: 0.19.2 only.
"""

import pytest

from tests.harness import launch

pytestmark = pytest.mark.slow
TOL = 1e-5


@pytest.fixture(scope="module")
def cases(build):
    if build != "0.19.2":
        pytest.skip("HybridModel's MTP depths (the pattern's '/' parts) exist from megatron-core 0.19")
    (result,) = launch("tests.bodies.hybrid:gpt_equivalence", 1, {}, timeout=600, build=build)
    return result


def test_a_gpt_shaped_hybrid_pattern_matches_the_reference(cases):
    assert len(cases) == 8
    for name, errors in cases.items():
        assert "error" not in errors, (name, errors)
        assert errors["same_parameters"] and errors["grad_names"], (name, errors)
        assert errors["counts_exact"], (name, errors)
        for key in ("main_ce", "mtp_loss", "grads", "sums"):
            assert errors[key] < TOL, (name, key, errors[key])


@pytest.fixture(scope="module", params=["hybrid", "gpt"])
def delta_net_cases(build, request):
    if build != "0.19.2":
        pytest.skip("HybridModel's MTP depths (the pattern's '/' parts) exist from megatron-core 0.19, and the "
                    "GPTModel form's layer selection is the 0.19.2 series'")
    (result,) = launch("tests.bodies.hybrid:delta_net", 1, {"form": request.param}, timeout=600, build=build)
    return result


def test_gated_deltanet_layers_match_the_recurrent_reference(delta_net_cases):
    """Qwen3-Next's layers "G-*-" with MTP depths "/*-" (issue 27), both ways upstream expresses
    them: the HybridModel pattern, and GPTModel with --experimental-attention-variant
    gated_delta_net --linear-attention-freq 2 (its MTP layer the decoder's last, as Megatron-LM's
    gpt_builders.py builds it). Upstream's GatedDeltaNet (its chunked torch kernel, with the
    runtime part's convolution and L2 norm on CPU) against the Gated DeltaNet paper's recurrence
    in the reference, over 70 tokens (two of the kernel's chunks), for D in {1, 2}, isolation off
    and on, and one MTP layer repeated at D = 2; gates of slow decay (tests/bodies/hybrid.py:
    slow_decay says why). Measured: gradients within 4.6e-6, losses 1.2e-7 (relative), both forms."""
    assert sorted(delta_net_cases) == ["D1_attached", "D1_isolated", "D2_attached", "D2_attached_repeated",
                                       "D2_isolated"]
    for name, errors in delta_net_cases.items():
        assert "error" not in errors, (name, errors.get("error"))
        assert errors["grad_names"] and errors["delta_net_grads"] == 2, (name, errors)
        assert errors["counts_exact"], (name, errors)
        for key in ("main_ce", "grads", "sums"):
            assert errors[key] < TOL, (name, key, errors[key])
