# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""A step counts its own model only (issue 65): an actor's exact step beside a second model of the
same architecture, MTP depths and TransformerConfig included, which runs forwards with labels and on
input ids alone, before the step and before each of the actor's micro-batches
(tests/bodies/second_model.py). The actor's step is AReaL's train_batch in exact_mtp_step (attached
heads with counts, detached heads with counts and streaming) or a SplitStep in two chunks (attached
with counts and streaming, detached streaming), on TP = 2 x DP = 2: every copy of every parameter's
full gradient equals the reference's (the spec's objective on the whole global batch), and the
step's per-depth metrics are the actor's data's, as if no other model ran.

Before the step was bound to its own model, the second model's labelled forwards inside the step
were counted as the actor's: a step with counts refused ("the counts given ... differ from the step's
data"), a streaming one with detached heads ran with its MTP gradients off by a factor of two; and a
forward on input ids alone inside the step refused the actor's step ("needs a loss_mask").
"""

import pytest

from tests.harness import launch

pytestmark = pytest.mark.slow
TOL = 1e-5


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return launch("tests.bodies.second_model:suite", 4,
                  {"ckpt_root": str(tmp_path_factory.mktemp("second-model"))}, timeout=900)


def test_the_actor_s_gradients_are_the_reference_s(suite):
    for results in suite:
        assert results["dp"] == 2
        cases = {name: result for name, result in results.items() if "/" in name}
        assert len(cases) == 12, sorted(cases)
        for name, result in cases.items():
            assert "refused" not in result, (name, result)
            assert result["rel"] < TOL, (name, result["rel"])


def test_the_actor_s_metrics_are_its_own_data_s(suite):
    for results in suite:
        for name, result in results.items():
            if "/" not in name:
                continue
            metrics, want = result["metrics"], result["want_metrics"]
            for key, value in want.items():
                assert abs(metrics[key] - value) <= TOL * max(abs(value), 1.0), (name, key, metrics[key], value)
    assert suite[0]["areal/attached/counts/labels"]["metrics"] == suite[1]["areal/attached/counts/labels"]["metrics"]
