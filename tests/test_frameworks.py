"""exact_mtp_step around RL frameworks' own steps (issue 40): AReaL's train_batch, verl's
update_policy, NeMo-RL's train and its split path, each as a controller making the framework's
calls in its order with its loss-function shape (tests/bodies/frameworks.py; sources cited in
docs/integrations/README.md).

With the one call added, every copy of every parameter's full gradient equals the reference's
(the framework's main loss on the whole global batch plus the spec's (lambda / D) sum_k S_k / N_tok)
under uneven masks; without it the same controller's differ (its MTP branch normalized per micro-batch,
or by the framework's sequence count). A CP rank without a single target; the refusals (an MTP forward
without a loss mask, counts that contradict the data, streaming with attached heads, router losses in
an averaging schedule), each before the gradient reduce and the optimizer step, leaving everything as
it was.

Default tier: one four-rank launch, CP=2 x DP=2 and TP=2 x PP=2 x DP=1 (no DP...: see LAYOUTS), the
refusals. Matrix tier: DP=4, TP=2 x DP=2, PP=2 x DP=2, and MoE experts over EP=2.
"""

import pytest

from tests.harness import launch

pytestmark = pytest.mark.slow
TOL = 1e-5
# (name, TP, PP, CP) on four ranks
LAYOUTS = [("cp2_dp2", 1, 1, 2), ("tp2_pp2", 2, 2, 1)]
MATRIX_LAYOUTS = [("dp4", 1, 1, 1), ("tp2_dp2", 2, 1, 1), ("pp2_dp2", 1, 2, 1)]
FRAMEWORKS = ("areal", "verl", "nemo", "nemo_split")
# Without the call a framework's MTP branch is normalized per micro-batch (averaging mode) or by its
# sequence count (the split path): far from the reference. NeMo-RL's train sets mtp_grad_scale_func to
# 1/global valid tokens itself, which on this fork's raw MTP sums is already exact (see the README).
DIFFERS_WITHOUT = ("areal", "verl", "nemo_split")


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return launch("tests.bodies.frameworks:suite", 4,
                  {"ckpt_root": str(tmp_path_factory.mktemp("frameworks")), "layouts": LAYOUTS}, timeout=900)


def check_layouts(ranks, layouts):
    for rank in ranks:
        results = rank["layouts"]
        for name, *_ in layouts:
            for framework in FRAMEWORKS:
                call = results[f"{name}/{framework}/call"]
                assert call["rel"] < TOL, (name, framework, call["rel"])
                without = results[f"{name}/{framework}/without"]["rel"]
                if framework in DIFFERS_WITHOUT:
                    assert without > 1e-2, (name, framework, without)


def test_each_framework_step_with_the_call_matches_the_reference(suite):
    check_layouts(suite, LAYOUTS)


def test_the_metrics_are_the_steps(suite):
    metrics = suite[0]["layouts"]["cp2_dp2/areal/call"]["metrics"]
    assert metrics["tokens"] > 0 and 0.0 <= metrics["mtp_2 acceptance"] <= 1.0
    assert "mtp grad norm" not in metrics  # attached heads: one group
    assert "mtp grad norm" in suite[0]["layouts"]["cp2_dp2/verl/call"]["metrics"]  # isolated: their own group
    for rank in suite[1:]:  # the same on every rank
        assert rank["layouts"]["cp2_dp2/areal/call"]["metrics"] == metrics


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
    return launch("tests.bodies.frameworks:layouts", 4,
                  {"ckpt_root": str(tmp_path_factory.mktemp("frameworks-matrix")), "layouts": MATRIX_LAYOUTS},
                  timeout=900)


@pytest.mark.matrix
def test_more_layouts(matrix_suite):
    check_layouts([{"layouts": rank} for rank in matrix_suite], MATRIX_LAYOUTS)
