# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""exact_mtp_step around RL frameworks' own steps (issue 40): AReaL's train_batch, verl's
update_policy, NeMo-RL's train and its split path, each a controller making the framework's calls
in its order with its loss-function shape (tests/bodies/frameworks.py; sources cited in
docs/integrations/README.md).

With the one call added, every copy of every parameter's full gradient equals the reference's (the
framework's main loss on the whole global batch plus the spec's (lambda / D) sum_k S_k / N_tok) under
uneven masks; without it the same controller's differ (its MTP branch normalized per micro-batch, or
by the framework's sequence count). NeMo-RL's train is the exception: it sets mtp_grad_scale_func to
1/global valid tokens itself, which on this fork's raw MTP sums is already exact, so only its run with
the call is compared. Also: the tv draft objective through the call, a CP rank without a single
target, and the refusals (an MTP forward without a loss mask, counts that contradict the data,
streaming with attached heads, router losses in a schedule that averages micro-batches), each before
the gradient reduce and the optimizer step, leaving parameters, gradients and hooks as they were.

Default tier: one four-rank launch, CP=2 x DP=2 (uneven valid tokens per rank), and the refusals.
Matrix tier: TP=2 x PP=2, TP=2 x DP=2, PP=2 x DP=2, DP=4, and MoE experts over EP=2.
"""

import pytest

from tests.harness import launch

pytestmark = pytest.mark.slow
TOL = 1e-5
# (name, TP, PP, CP, EP) on four ranks
LAYOUTS = [("cp2_dp2", 1, 1, 2, 1)]
MATRIX_LAYOUTS = [("tp2_pp2", 2, 2, 1, 1), ("tp2_dp2", 2, 1, 1, 1), ("pp2_dp2", 1, 2, 1, 1), ("dp4", 1, 1, 1, 1)]
MOE_LAYOUTS = [("ep2_dp4", 1, 1, 1, 2)]  # MoE experts over two expert-parallel ranks
FRAMEWORKS = ("areal", "verl", "nemo", "nemo_split")
DIFFERS_WITHOUT = ("areal", "verl", "nemo_split")


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return launch("tests.bodies.frameworks:suite", 4,
                  {"ckpt_root": str(tmp_path_factory.mktemp("frameworks")), "layouts": LAYOUTS}, timeout=900)


def check_layouts(ranks: list, layouts: list) -> None:
    for results in ranks:
        for name, *_ in layouts:
            for framework in FRAMEWORKS:
                call = results[f"{name}/{framework}/call"]["rel"]
                assert call < TOL, (name, framework, call)
            for framework in DIFFERS_WITHOUT:
                without = results[f"{name}/{framework}/without"]["rel"]
                assert without > 1e-2, (name, framework, without)


def test_each_framework_step_with_the_call_matches_the_reference(suite):
    check_layouts([rank["layouts"] for rank in suite], LAYOUTS)


def test_a_draft_objective_through_the_call(suite):
    for rank in suite:
        assert rank["layouts"]["cp2_dp2/verl_tv/call"]["rel"] < TOL


def test_the_metrics_are_the_steps(suite):
    metrics = suite[0]["layouts"]["cp2_dp2/areal/call"]["metrics"]
    assert metrics["tokens"] > 0 and 0.0 <= metrics["mtp_2 acceptance"] <= 1.0
    # by default the step skips the sampled and greedy-draft acceptances' work, and leaves them out
    assert not [key for key in metrics if "sampl" in key or "greedy" in key], metrics
    assert "mtp grad norm" not in metrics  # attached heads: one gradient-norm group
    assert suite[0]["layouts"]["cp2_dp2/verl/call"]["metrics"]["mtp grad norm"] > 0  # isolated: their own
    for rank in suite[1:]:  # the same on every rank
        assert rank["layouts"]["cp2_dp2/areal/call"]["metrics"] == metrics


def test_a_logged_step_reports_the_trainer_s_acceptances(suite):
    """exact_mtp_step(..., metrics=True), on a step the framework logs: its gradients are the
    reference's, and its sampled and greedy-draft acceptances those of the trainer's step on the same
    weights and data (which reports every metric)."""
    for rank in suite:
        logged = rank["layouts"]["cp2_dp2/areal_logged/call"]
        assert logged["rel"] < TOL, logged["rel"]
        metrics, trainer = logged["metrics"], logged["trainer"]
        keys = [key for key in trainer if "sampl" in key or "greedy" in key]
        assert len(keys) == 6, trainer  # per depth (D = 2) two, and the two expected lengths
        for key in keys + ["mtp_1 acceptance", "mtp_2 chain acceptance", "tokens"]:
            assert abs(metrics[key] - trainer[key]) <= TOL * abs(trainer[key]), (key, metrics[key], trainer[key])
        assert 0.0 < metrics["mtp_2 sampled acceptance"] < 1.0, metrics


def test_a_cp_rank_without_targets(suite):
    ranks = [rank["layouts"]["cp2_dp2/cp_rank_without_targets"] for rank in suite]
    assert sorted(r["local_targets"] == 0.0 for r in ranks) == [False, False, True, True]
    assert all(r["cp_rank"] == 0 for r in ranks if r["local_targets"] == 0.0)
    for result in ranks:
        assert result["rel"] < TOL, result["rel"]


def test_refusals_change_nothing(suite):
    refusals = suite[0]["refusals"]
    assert "needs a loss_mask" in refusals["no_loss_mask"]["message"]
    assert "differ from the step's data" in refusals["wrong_counts"]["message"]
    for name in ("no_loss_mask", "wrong_counts"):
        result = refusals[name]
        assert result["hooks"] and result["params"] and result["grads_zero"] and result["inactive"], (name, result)
        assert "\n" not in result["message"]
    assert "isolate the heads" in refusals["streaming_attached"]
    assert "calculate_per_token_loss=True" in refusals["router_losses_averaging"]


@pytest.fixture(scope="module")
def matrix_suite(tmp_path_factory):
    root = tmp_path_factory.mktemp("frameworks-matrix")
    dense = launch("tests.bodies.frameworks:run_layouts", 4, {"ckpt_root": str(root), "layouts": MATRIX_LAYOUTS},
                   timeout=900)
    moe = launch("tests.bodies.frameworks:run_layouts", 4,
                 {"ckpt_root": str(root), "layouts": MOE_LAYOUTS, "moe": True}, timeout=900)
    return dense, moe


@pytest.mark.matrix
def test_router_losses_through_the_call_in_nemo_rl_s_train(tmp_path):
    """MoE experts over EP=2 with an auxiliary loss per micro-batch and a z-loss, on the backbone
    and the MTP depths: NeMo-RL's train with the call given T (every input position) and its
    moe_grad_scale_func line removed, as its guide's diff says, gives the reference's full gradients
    with spec section 11's router terms; without the call (its own 1 / valid tokens on the routers)
    it differs. AReaL's and verl's averaging schedules are refused with router losses
    (test_refusals_change_nothing), and so is NeMo-RL's split path as it stands, with counts and
    without (docs/integrations/nemo-rl.md)."""
    ranks = launch("tests.bodies.frameworks:run_layouts", 4,
                   {"ckpt_root": str(tmp_path), "layouts": MOE_LAYOUTS, "moe": True, "router": True}, timeout=900)
    for results in ranks:
        for name, *_ in MOE_LAYOUTS:
            for framework in ("nemo",):
                call = results[f"{name}/{framework}/call"]["rel"]
                without = results[f"{name}/{framework}/without"]["rel"]
                assert call < TOL and without > 1e-2, (name, framework, call, without)


@pytest.mark.matrix
def test_more_layouts_and_expert_parallelism(matrix_suite):
    dense, moe = matrix_suite
    check_layouts(dense, MATRIX_LAYOUTS)
    check_layouts(moe, MOE_LAYOUTS)
