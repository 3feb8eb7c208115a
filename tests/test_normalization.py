# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Exact normalization and split steps (spec sections 4-7) against the single-process
plain-PyTorch reference of the spec objective on the whole global batch.

Launch 1 (one process): chunks 1/2/4, micro-batch sizes 1/2/4, token- and sequence-level
main loss x isolation on/off x counts up front or streaming, the refused combination,
zero-token steps, lambda independence of the main norm, fp16 loss scaling and overflow,
abort. Launches 2 and 3 (four and two processes), every copy of every parameter's full
gradient: DP=4 (very uneven valid tokens per rank, and a rank with none), TP=2 x DP=2 with
and without sequence parallelism, TP=2 with it, PP=2 x DP=2, and interleaved PP=2 x VPP=2
alone, with DP=2 and with TP=2, over several micro-batch groups; learned absolute
positions with MTP under PP refused on every rank. Launch 4: pristine upstream's default
mode on DP=4, to show what the exact normalization fixes.

Tolerance: relative 1e-5 of each parameter's largest gradient magnitude (float32
round-off; measured <= 1.4e-6 in one process, <= 9.5e-7 over the layouts); fp16
group-norm ratios within 1e-2 of 1.
"""

import pytest

from tests.harness import launch

pytestmark = pytest.mark.slow
TOL = 1e-5
# (name, TP, PP, VPP, sequence parallel, chunks per step, CP). Interleaved layouts take each
# rank's micro-batches (of 1) in one chunk: several micro-batch groups of PP=2 per call.
# The default tier: DP=4 (uneven tokens, a rank with none), TP with sequence parallelism over DP,
# interleaved PP with TP (several micro-batch groups, both word-embedding copies), context
# parallelism over DP (each sequence's mean over its pieces on two ranks; 0.19.2's series).
FOUR_RANK_LAYOUTS = [("dp4", 1, 1, None, False, 2, 1), ("tp2_dp2_sp", 2, 1, None, True, 2, 1),
                     ("tp2_pp2_vpp2", 2, 2, 2, False, 1, 1), ("cp2_dp2", 1, 1, None, False, 2, 2)]
TWO_RANK_LAYOUTS = []  # the two-rank launch checks the refusals only
# The matrix tier's: TP and PP over DP without SP, interleaved PP over DP and alone, TP=2 with SP,
# CP with TP and sequence parallelism, CP with PP.
MATRIX_FOUR_RANK_LAYOUTS = [("tp2_dp2", 2, 1, None, False, 2, 1), ("pp2_dp2", 1, 2, None, False, 2, 1),
                            ("dp2_pp2_vpp2", 1, 2, 2, False, 1, 1), ("tp2_cp2_sp", 2, 1, None, True, 2, 2),
                            ("pp2_cp2", 1, 2, None, False, 1, 2)]
MATRIX_TWO_RANK_LAYOUTS = [("pp2_vpp2", 1, 2, 2, False, 1, 1), ("tp2_sp", 2, 1, None, True, 2, 1)]


def on_build(build: str, layouts: list) -> list:
    """The layouts a build runs: MTP with context parallelism is 0.19.2's series only."""
    return [layout for layout in layouts if layout[6] == 1 or build == "0.19.2"]


CASES_PER_LAYOUT = 7  # isolation x main-loss level x counts, and uneven data (DP=4: 11)


@pytest.fixture(scope="module")
def ckpt_root(build, tmp_path_factory):
    return str(tmp_path_factory.mktemp(f"norm-{build}"))


@pytest.fixture(scope="module")
def single(build, ckpt_root):
    (result,) = launch("tests.bodies.normalization:single_process", 1, {"ckpt_root": ckpt_root}, timeout=900,
                       build=build)
    return result


@pytest.fixture(scope="module")
def layouts(build, single, ckpt_root):
    """Every rank's results of the four-rank layouts and of the two-rank ones, and the
    learned-absolute refusals of both worlds."""
    four = launch("tests.bodies.normalization:parallel_layouts_and_refusals", 4,
                  {"ckpt_root": ckpt_root, "layouts": on_build(build, FOUR_RANK_LAYOUTS),
                   "refusal_layouts": [("pp2_dp2", 1, 2), ("tp2_pp2", 2, 2), ("dp4", 1, 1)]},
                  timeout=900, build=build)
    two = launch("tests.bodies.normalization:parallel_layouts_and_refusals", 2,
                 {"ckpt_root": ckpt_root, "layouts": TWO_RANK_LAYOUTS, "refusal_layouts": [("pp2", 1, 2)]},
                 timeout=900, build=build)
    return four, two


def step_cases(single):
    return {k: v for k, v in single.items() if "/" in k}


def test_every_cut_of_the_step_matches_the_reference(single):
    cases = step_cases(single)
    assert len(cases) == 7 * 6  # 7 (level, isolation, counts) modes x 6 (micro-batch, chunks) cuts
    bad = {k: v["rel"] for k, v in cases.items() if not v["rel"] < TOL}
    assert not bad, bad


def test_a_draft_objective_is_exact_under_every_cut_of_a_split_step(single, build):
    if build == "0.16.1":  # its series refuses them (tests/test_draft_objectives.py)
        assert "draft_objective" not in single
        return
    cuts = single["draft_objective"]
    assert len(cuts) == 6  # counts up front / streaming x three cuts
    assert all(rel < TOL for rel in cuts.values()), cuts


def test_dict_microbatches_are_opaque_to_the_step(single):
    """Micro-batches as dicts (RL frameworks): the step takes the schedule's shapes from its
    constructor, never from inside a micro-batch."""
    for mode in ("detach0", "detach1"):
        assert single[f"dict_microbatches_{mode}"] < TOL


def test_metrics_do_not_depend_on_the_cut(single):
    cases = step_cases(single)
    by_mode = {}
    for key, value in cases.items():
        mode = "/".join(key.split("/")[:3])
        by_mode.setdefault(mode, []).append(value["metrics"])
    for mode, metrics in by_mode.items():
        first = metrics[0]
        for other in metrics[1:]:
            assert other["tokens"] == first["tokens"] and other["sequences"] == first["sequences"]
            assert other["mtp sums"][0][1:4] == first["mtp sums"][0][1:4]  # counts exact
            for key in ("lm loss", "grad norm", "mtp_1 loss", "mtp_2 acceptance", "mtp_2 chain acceptance",
                        "expected accepted length (incl. bonus token)", "mtp_2 sampled acceptance",
                        "expected accepted length (sampling)", "mtp_2 greedy-draft acceptance",
                        "expected accepted length (greedy drafts)"):
                assert abs(other[key] - first[key]) <= TOL * max(abs(first[key]), 1e-12), (mode, key)


def test_a_split_step_measures_the_acceptances_only_when_asked(single):
    """begin()'s default leaves out the sampled and greedy-draft acceptances (their work is skipped,
    measured at no position); begin(metrics=True) reports them; both steps' gradients are the
    reference's and their other metrics the same."""
    default, asked = single["default_metrics"]["default"], single["default_metrics"]["asked"]
    assert default["rel"] < TOL and asked["rel"] < TOL, (default["rel"], asked["rel"])
    acceptances = ("sampled acceptance", "greedy-draft acceptance", "(sampling)", "(greedy drafts)")
    assert not [key for key in default["metrics"] if key.endswith(acceptances)], default["metrics"]
    assert all(row[6] == 0 for row in default["metrics"]["mtp sums"]), default["metrics"]  # MEASURED
    assert 0.0 < asked["metrics"]["mtp_2 sampled acceptance"] < 1.0, asked["metrics"]
    for key, value in default["metrics"].items():
        if key not in ("mtp sums", "grad norms"):
            assert asked["metrics"][key] == value, key


def test_refused_combination_changes_nothing(single):
    refusal = single["refusal"]
    assert "--mtp-detach-heads" in refusal["message"] and "counts" in refusal["message"]
    assert not refusal["in_progress"] and not refusal["active"]
    assert refusal["hooks_unchanged"] and refusal["grads_unchanged"] and refusal["params_unchanged"]


def test_zero_token_step_gives_finite_zero_gradients(single):
    for mode, result in single["zero_tokens"].items():
        assert result["finite"] and result["max_abs"] == 0.0, mode
        assert result["tokens"] == 0 and result["lm loss"] == 0.0 and result["metrics_finite"], mode


def test_isolated_main_norm_ignores_lambda_and_mtp_norm_scales_with_it(single):
    low, high = single["lambda"]["0.1"], single["lambda"]["0.5"]
    assert low["main"] == high["main"]
    assert abs(high["mtp"] / low["mtp"] - 5.0) < 5.0 * TOL


def test_fp16_loss_scale_reaches_every_branch(single):
    fp16 = single["fp16"]
    for group, ratio in fp16["ratios"].items():
        assert abs(ratio - 1.0) < 1e-2, (group, ratio)  # not 1/S
    assert not fp16["skipped_normal"]
    assert fp16["overflow_skipped"] and fp16["overflow_params_unchanged"]


def test_abort_restores_everything(single):
    assert all(single["abort"].values()), single["abort"]


@pytest.fixture(scope="module")
def matrix_layouts(build, single, ckpt_root):
    four = launch("tests.bodies.normalization:parallel_layouts_and_refusals", 4,
                  {"ckpt_root": ckpt_root, "layouts": on_build(build, MATRIX_FOUR_RANK_LAYOUTS), "refusal_layouts": []},
                  timeout=900, build=build)
    two = launch("tests.bodies.normalization:parallel_layouts_and_refusals", 2,
                 {"ckpt_root": ckpt_root, "layouts": MATRIX_TWO_RANK_LAYOUTS, "refusal_layouts": []},
                 timeout=900, build=build)
    return four, two


def assert_layouts_match(four, two, expected_four: int, expected_two: int) -> None:
    assert len(four[0]["layouts"]) == expected_four and len(two[0]["layouts"]) == expected_two
    for rank in four + two:
        for key, value in rank["layouts"].items():
            assert value["finite"], key
            assert value["full_rel"] < TOL, (key, value["full_rel"])


def test_parallel_layouts_match_the_reference(build, layouts):
    """Full gradients of every parameter copy: DP=4 (uneven tokens, a rank with none), TP=2 x
    DP=2 with sequence parallelism, interleaved PP=2 x VPP=2 with TP=2 over several micro-batch
    groups, CP=2 x DP=2 (token- and sequence-level main loss)."""
    four, two = layouts
    assert_layouts_match(four, two, 11 + (len(on_build(build, FOUR_RANK_LAYOUTS)) - 1) * CASES_PER_LAYOUT,
                         len(TWO_RANK_LAYOUTS) * CASES_PER_LAYOUT)
    tokens = [rank["layouts"]["dp4/detach0/token/upfront/uneven"]["local_tokens"] for rank in four]
    assert max(tokens) >= 3 * min(tokens)  # really uneven
    assert [rank["layouts"]["dp4/detach0/token/upfront/rank0-empty"]["local_tokens"] for rank in four][0] == 0


@pytest.mark.matrix
def test_more_parallel_layouts_match_the_reference(build, matrix_layouts):
    """The matrix tier's layouts: TP=2 x DP=2 and PP=2 x DP=2 without sequence parallelism, TP=2 with it,
    interleaved PP=2 x VPP=2 with DP=2 and alone, CP=2 with TP=2 and sequence parallelism, CP=2 x PP=2."""
    four, two = matrix_layouts
    assert_layouts_match(four, two, len(on_build(build, MATRIX_FOUR_RANK_LAYOUTS)) * CASES_PER_LAYOUT,
                         len(MATRIX_TWO_RANK_LAYOUTS) * CASES_PER_LAYOUT)


def test_every_copy_of_a_replicated_parameter_is_compared(layouts):
    """Guards the comparison: TP ranks' norm replicas and both word-embedding copies under PP
    are each checked against the reference, not one of them."""
    four, two = layouts
    copies = four[0]["layouts"]["tp2_pp2_vpp2/detach0/token/upfront/uneven"]["copies"]
    assert copies["embedding.word_embeddings.weight"] == 2  # first stage and the MTP stage
    assert copies["decoder.final_layernorm.weight"] == 2  # one per TP rank
    assert copies["decoder.layers.0.self_attention.linear_qkv.weight"] == 1  # TP shards joined
    assert four[0]["layouts"]["tp2_dp2_sp/detach1/token/upfront/uneven"]["copies"]["mtp.layers.0.enorm.weight"] == 2


def test_learned_absolute_positions_with_mtp_under_pp_are_refused_on_every_rank(layouts):
    four, two = layouts
    for ranks, refused in ((four, ["pp2_dp2", "tp2_pp2"]), (two, ["pp2"])):
        for rank in ranks:
            refusals = rank["refusals"]
            # every refusal layout the fixture launched reported (a missing one checked nothing before)
            assert sorted(refusals) == sorted(refused + (["dp4"] if ranks is four else [])), refusals
            for name in refused:
                assert "learned absolute position embeddings under pipeline parallelism" in refusals[name]
                assert "rope" in refusals[name]
    assert all(rank["refusals"]["dp4"] is None for rank in four)  # one stage: built


def test_upstream_default_mode_is_not_invariant(layouts, ckpt_root, upstream_tree):
    """The same data, weights and DP=4 cut through pristine upstream's default mode: its MTP
    gradients are far from the reference that the fork matches above."""
    ranks = launch("tests.bodies.normalization:upstream_default_mode", 4, {"ckpt_root": ckpt_root},
                   timeout=600, upstream_tree=upstream_tree)
    assert ranks[0]["core"].startswith(str(upstream_tree))
    assert ranks[0]["finite"]
    assert ranks[0]["rel_mtp"] > 0.1, ranks[0]
