# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The fork's CPU Gated DeltaNet kernels take packed rows (cu_seqlens) with flash-linear-attention's
semantics (issue 39 A): on a row of sequences of 5, 1, 70 and 3 tokens, the chunked form
(upstream's torch kernel per sequence) and the recurrent form each equal the same kernel run on
every sequence alone (outputs, per-sequence final states, from zero or from per-sequence initial
states, and input gradients); the two forms agree; the causal convolution reads nothing across a
boundary (the single token's output is its own window's). The packed output differs from the
whole row's, so the row does cross boundaries. Inputs that break FLA's convention (two rows,
cu_seqlens not strictly increasing from 0 to the row's length, a count of initial states that is
not the count of sequences) are refused in one line. 0.19.2 only (0.16.1 has no GatedDeltaNet
package). Tolerance 1e-5 relative (float32; the chunked kernel's arithmetic)."""

import pytest

from tests.harness import launch

TOL = 1e-5


@pytest.fixture(scope="module")
def checks(build):
    if build != "0.19.2":
        pytest.skip("megatron-core 0.16.1 has no ssm/gated_delta_net package (the chunked torch kernel's home)")
    (result,) = launch("tests.bodies.gated_delta_rule:checks", 1, {}, timeout=300, build=build)
    return result


@pytest.mark.parametrize("case", ["chunk", "chunk_states", "recurrent", "recurrent_states"])
def test_each_packed_sequence_is_computed_as_a_row_of_its_own(checks, case):
    got = checks[case]
    assert got["shapes"] == [[1, 79, 2, 3], [4, 2, 4, 3]], got
    for key in ("out", "finals", "grads"):
        assert got[key] < TOL, (case, key, got)
    if got["whole_row_differs"] is not None:
        assert got["whole_row_differs"] > 1e-2, got


def test_the_chunked_and_recurrent_forms_agree_on_packed_rows(checks):
    assert checks["chunk_vs_recurrent"] < TOL


def test_the_convolution_does_not_read_across_a_boundary(checks):
    conv = checks["conv"]
    assert conv["out"] < TOL and conv["single_token"] < TOL and conv["grads"] < TOL, conv
    assert conv["whole_row_differs"] > 1e-2, conv


def test_packed_inputs_against_fla_convention_are_refused_in_one_line(checks):
    expected = ["the batch is 2", "not strictly increasing", "not strictly increasing",
                "holds 2 states for 4 packed sequences", "not strictly increasing"]
    for got, want in zip(checks["refusals"], expected, strict=True):
        assert got is not None and want in got and "\n" not in got, (got, want)
