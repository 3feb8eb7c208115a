# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""MTP in the model (spec sections 1-3, 6, 7) against the plain-PyTorch reference.

One launch of one process runs every case; the tests below read its results.
Tolerance: relative 1e-5 of the largest magnitude of each compared tensor (float32
round-off; measured <= 7e-7). Counts (valid, correct, chain-correct) must be exact.
"""

import pytest

from tests.harness import launch
from tests.harness.reference_checks import failed_checks

pytestmark = pytest.mark.slow
TOL = 1e-5


@pytest.fixture(scope="module")
def suite(build, tmp_path_factory):
    ckpt_dir = str(tmp_path_factory.mktemp("mtp-model"))
    (result,) = launch("tests.bodies.mtp_model:model_suite", 1, {"ckpt_dir": ckpt_dir}, timeout=900,
                       build=build)
    return result


def test_matrix_covers_every_combination(suite):
    # D in {1,2,3} x distinct/repeated (repeated needs D >= 2) x tied/untied x isolation
    # x recompute x padded/packed rows x sparse/dense MTP loss.
    assert len(suite["matrix"]) == (3 + 2) * 2 * 2 * 2 * 2 * 2


def test_logits_losses_gradients_and_statistics_match_the_reference(suite):
    failures = {name: failed for name, errors in suite["matrix"].items()
                if (failed := failed_checks(name, errors, TOL))}
    assert not failures, failures


def test_isolation_leaves_backbone_embedding_and_output_weight_as_without_mtp(suite):
    for name, result in suite["isolation"].items():
        assert result["shared_names"], name
        assert result["max_abs_diff"] == 0.0, (name, result)
        assert result["mtp_grads_nonzero"], name
        assert result["mtp_tagged"], name


def test_labels_derived_from_input_ids(suite):
    result = suite["derived_labels"]
    assert result["logits_shape"] == [4, 12, 48]
    assert result["sums_equal"] and result["mtp_grads_equal"]


def test_bad_input_is_refused_with_the_fix(suite):
    messages = suite["refusals"]
    assert "--mtp-num-layers" in messages["detach_without_depths"]
    assert "--mtp-num-layers" in messages["repeated_without_depths"]
    assert "mtp_loss_scaling_factor" in messages["negative_weight"]
    assert "loss_mask must have the shape of labels" in messages["mask_shape"]
    assert messages["statistics_untouched"] is True
    assert "output-layer bias" in messages["trainable_bias"]


def test_repeated_layer_gradient_after_checkpoint_resume(suite):
    for mode, error in suite["repeated_after_resume"].items():
        assert error <= TOL, (mode, error)


def test_zero_mtp_depths_trains_as_no_mtp(suite):
    """TransformerConfig(mtp_num_layers=0) is upstream's "no MTP"; it used to divide by zero."""
    assert suite["zero_depths"] == {"same_loss": True, "same_grads": True}
