# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The draft objectives of spec section 12 (--mtp-loss-type kl | tv | e2e_tv, and ce's sampled
acceptance at --mtp-draft-temperature) in the model, against the plain-PyTorch reference; the
greedy-draft acceptance of section 12.1 beside the sampled one, for every objective.

One launch of one process. Default tier: each objective at D = 3 distinct (padded rows,
sparse loss) and at D = 2 repeated (tied, packed rows, dense loss), plus ce on packed rows;
the matrix tier: every objective x D in {1, 2, 3} x distinct / repeated x tied / untied x
padded / packed x sparse / dense. Tolerance: relative 1e-5 of the largest magnitude of each
compared tensor (float32 round-off; measured <= 7.2e-7 for gradients, 1e-7 for the sums);
counts exact.
"""

import pytest

from tests.harness import launch

pytestmark = pytest.mark.slow
TOL = 1e-5
OBJECTIVES = ("kl", "tv", "e2e_tv", "ce")


@pytest.fixture(scope="module")
def suite(matrix):
    """The current build's (0.16.1's series trains ce only: the test below)."""
    (result,) = launch("tests.bodies.draft_objectives:suite", 1, {"tier": "matrix" if matrix else "default"},
                       timeout=900)
    return result


def test_each_series_builds_or_refuses_the_draft_objectives(build):
    (refusal,) = launch("tests.bodies.draft_objectives:refusal_on_this_build", 1, timeout=300, build=build)
    if build == "0.16.1":
        assert "needs megatron-core 0.19.2's series" in refusal and "--mtp-loss-type ce" in refusal, refusal
    else:
        assert refusal is None


def test_every_case_ran(suite, matrix):
    expected = 4 * (3 + 2) * 2 * 2 * 2 if matrix else 7
    assert len(suite["cases"]) == expected


def test_gradients_and_sums_match_the_reference(suite):
    assert sorted(suite["greedy_aligned"]) == ["ce", "e2e_tv"]
    for name, errors in [*suite["cases"].items(), *suite["greedy_aligned"].items()]:
        assert errors["grad_names"], name
        assert errors["mtp_grads_nonzero"] or (name.startswith("e2e_tv") and errors["complete_chains"] == 0), name
        assert errors["grads"] < TOL, (name, errors)
        assert errors["sums"] < TOL, (name, errors)
        assert errors["greedy_sums"] < TOL, (name, errors)
        assert errors["counts_exact"], (name, errors)


def test_cases_are_not_degenerate(suite):
    # alpha near 0 or 1 would make every objective flat: the cases draw distinct p and q.
    for name, errors in [*suite["cases"].items(), *suite["greedy_aligned"].items()]:
        assert all(0.05 < a < 0.95 for a in errors["sampled_acceptance"]), (name, errors["sampled_acceptance"])
        # p(argmax q) > 0 and not alpha. In these cases the depths' argmax is rarely the main head's
        # (p(argmax q) 0.004 .. 0.03: unrelated random heads); the aligned cases put it mid-range
        greedy = errors["greedy_draft_acceptance"]
        assert all(b > 0 for b in greedy), (name, greedy)
        assert all(abs(a - b) > 0.01 for a, b in zip(errors["sampled_acceptance"], greedy, strict=True)), name
    for name, errors in suite["greedy_aligned"].items():
        assert all(0.2 < b < 0.8 for b in errors["greedy_draft_acceptance"]), (name, errors)


def test_the_backbone_is_bit_identical_to_a_run_without_mtp(suite):
    assert sorted(suite["backbone"]) == sorted(OBJECTIVES)
    for objective, result in suite["backbone"].items():
        assert result == {"shared_names": True, "bit_identical": True, "mtp_grads_nonzero": True}, objective


def test_the_decoder_measures_the_trainer_s_sampled_acceptance(suite):
    # tools/eval_speculative.py's teacher-forced sampled acceptance and the trainer's metric: the
    # same positions, the same sums (float32 logits on both sides; measured 1e-7 relative).
    decoder = suite["decoder"]
    assert decoder["trainer_valid"] == decoder["decoder_valid"] == [11.0, 10.0, 9.0]  # SEQ - k positions
    for trainer, measured in zip(decoder["trainer"], decoder["decoder"], strict=True):
        assert abs(trainer - measured) <= TOL * abs(measured), decoder
    # the greedy-draft acceptance p(argmax q) and both chains (products over depths 1..k at each anchor)
    pairs = [*zip(decoder["trainer_greedy"], decoder["decoder_greedy"], strict=True),
             *zip(decoder["trainer_chains"][0], decoder["decoder_chains"][0], strict=True),
             *zip(decoder["trainer_chains"][1], decoder["decoder_chains"][1], strict=True)]
    for trainer, measured in pairs:
        assert measured > 0 and abs(trainer - measured) <= TOL * abs(measured), decoder


def test_the_mtp_only_sample_mask_reaches_the_mtp_depths_only(suite):
    # the library's gpt_per_token_loss with r against the reference (r on the depths' masks, not on
    # the main loss); without r the same step differs (measured 1.5), so the mask is in effect
    assert suite["sample_mask"]["with_r"] < TOL, suite["sample_mask"]
    assert suite["sample_mask"]["without_r"] > 0.1, suite["sample_mask"]


def test_ce_without_the_sampled_metrics_skips_them_and_trains_alike(suite):
    result = suite["without_sampled_metrics"]
    assert result["grads"] < TOL and result["first_fields"] < TOL, result
    assert result["sampled_unknown"] and result["reported"] == [], result


def test_a_step_that_reports_no_metrics_makes_no_metric_projection_and_one_that_does_is_exact(suite):
    result = suite["metric_steps"]
    # metrics off and on alike: the main head's rows and each depth's MTP rows, once; on, the main
    # head at t + k is read from the main head's own logits, not projected again (it was: rows_off +
    # the MTP rows, before megatron.core.fork.mtp.loss_branch.main_head_output)
    mtp_rows = result["rows_off"] - result["main_rows"]
    assert mtp_rows > 0 and result["rows_on"] == result["rows_off"], result
    assert result["off_first_fields"] < TOL and result["off_counts_exact"], result
    assert result["off_sampled_fields"] == 0 and result["off_reported"] == [], result
    assert result["on_sums"] < TOL and result["on_counts_exact"], result
    assert all(0.05 < a < 0.95 for a in result["on_sampled"]), result  # measured, not a trivial 0 or 1
    assert result["reporting_after"] == [False, False], result  # the library's default, as before the scope


def test_a_library_forward_with_the_defaults_does_no_metric_work_and_one_asked_is_exact(suite):
    """A framework calling GPTModel with the defaults computes no distribution over the vocabulary
    for the sampled and greedy-draft acceptances (measured nowhere); inside report_metrics() the
    same forward measures them at every MTP row, exactly (the reference's sums)."""
    result = suite["library_defaults"]
    assert result["reporting"] is False and result["reporting_after"] is False, result
    defaults, asked = result["defaults"], result["asked"]
    assert defaults["softmax_rows"] == 0 and defaults["sampled_fields"] == 0, result
    assert defaults["first_fields"] < TOL, result
    assert asked["softmax_rows"] >= 2 * asked["mtp_rows"] > 0, result  # p and q at each valid MTP row at least
    assert asked["sums"] < TOL and asked["counts_exact"], result


def test_refusals_name_the_fix(suite):
    refusals = suite["refusals"]
    for objective in ("kl", "tv", "e2e_tv"):
        assert "--mtp-detach-heads" in refusals[f"{objective}_attached"], objective
    assert "ce, kl, tv, e2e_tv" in refusals["unknown"]
    assert "must be > 0" in refusals["temperature"]
    assert refusals["upstream_name"] is None  # upstream's 'cross_entropy' is today's objective
    assert refusals["ce_attached"] is None
