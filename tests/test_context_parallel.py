# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Context parallelism (CP) with exact MTP on CPU (issue 28), model side.

- The MTP roll of a CP rank's pieces (megatron.core.fork.runtime.context_parallel, which the 0.19.2
  series' roll_tensor hands CP pieces and packed rows to) equals the global roll of whole
  rows and of packed rows of odd-length sequences (padded to multiples of 2 x CP, one of a
  single token), at CP = 2 on a strict subgroup of the world (TP = 2) and at CP = 4, and
  exchanges on the CP group only; upstream's packed-row data split (get_batch_on_this_cp_rank,
  without Transformer Engine the runtime part's) gives the same pieces. These compare pieces
  cut by one map of the layout (local_positions), which tests/in_build/
  test_context_parallel_layout.py checks against hand-written indices.
- Pristine upstream's roll (with only the series' runtime part) on the same pieces: its
  exchange runs on the WORLD group (#6746, fixed on Megatron-LM main, not in 0.19) and its
  packed roll does not give the global roll (#4494/#4495: it maps the padded layout with the
  unpadded cu_seqlens).
- The GPTModel with MTP on CP = 2 (two ranks) and CP = 4 (four): every parameter's gradient,
  summed over the CP group, equals the plain-PyTorch reference's on the whole rows (tests/
  reference/gpt_mtp.py), as do the main loss sum and the per-depth MTP sums (counts
  exactly): D in {1, 2}, isolation on and off, the repeated layer, padded rows with mask
  holes, packed rows of odd lengths, the sparse MTP loss (default: its valid rows only, the
  last depth's MLP at the rows its loss reads) and upstream's dense one, and a HybridModel
  with Gated DeltaNet layers (Qwen3-Next's pattern; upstream's all-to-all from sequence to
  head parallelism) against the reference's recurrent DeltaNet. Gated DeltaNet heads that do
  not split over the CP ranks are refused in one line. Pristine upstream's model on CP = 2 fails it: its
  per-token mode divides each depth by the local count of its micro-batch (#7452), which
  under CP is each rank's piece (#3943's "1/CP" is a symptom of the same local scaling).
- MTP with CP on megatron-core 0.16.1 (whose series does not carry the roll) is refused in
  one line when the config is built.

Layouts with DDP and split steps (CP x DP, CP x TP, CP x PP, CP = 4) are in
tests/test_mtp_layouts.py and tests/test_normalization.py; the trainer's in
tests/test_trainer_exactness.py.

Tolerance: relative 1e-5 of each compared tensor's largest magnitude (float32 round-off;
measured <= 1e-6).
"""

import pytest

from tests.harness import launch

pytestmark = pytest.mark.slow
TOL = 1e-5
# (depths, isolation, repeated layer, rows). The default tier runs these at CP = 2 and a subset
# at CP = 4; the matrix tier every case at both.
CASES = [(1, False, False, "padded"), (2, False, False, "packed"), (2, True, False, "padded"),
         (2, True, True, "packed"), (2, False, True, "padded"), (1, True, False, "packed"),
         (2, False, False, "padded_dense"), (1, False, False, "delta_net"), (2, True, False, "delta_net")]
# Gated DeltaNet's 2 key heads do not split over 4 context-parallel ranks (refused).
CP4_CASES = [case for case in CASES if case[3] != "delta_net"]
CP4_DEFAULT = [(2, False, False, "padded"), (2, True, True, "packed")]
UPSTREAM_DEFECT_LENGTHS = (5, 3, 9)  # upstream's packed roll gives wrong values here (it fails outright on others)


def case_name(depths, detach, repeated, layout) -> str:
    return f"D{depths}-{'iso' if detach else 'att'}-{'rep' if repeated else 'dist'}-{layout}"


@pytest.fixture(scope="module")
def current(build):
    if build != "0.19.2":
        pytest.skip("MTP with context parallelism is 0.19.2's series (0.16.1 refuses it: "
                    "test_mtp_with_context_parallelism_is_built_on_0_19_and_refused_on_0_16)")
    return build


# (CP, sequence lengths of the packed row; None: the body's, 5, 3, 9 and 1)
ROLL_CASES = [(cp, lengths) for cp in (2, 4) for lengths in (None, UPSTREAM_DEFECT_LENGTHS)]


@pytest.fixture(scope="module")
def rolls(current):
    return launch("tests.bodies.context_parallel:roll_checks", 4, {"cases": ROLL_CASES}, timeout=300, build=current)


def test_the_roll_is_the_global_roll_on_the_cp_group(rolls):
    for rank in rolls:
        assert len(rank) == len(ROLL_CASES)
        for case, checks in rank.items():
            assert checks == {"row": True, "on_the_cp_group": True, "unshard": True, "thd_split": True,
                              "packed": True}, case


def test_upstream_roll_exchanges_on_the_world_group_and_breaks_packed_rows(current, upstream_tree):
    """The checks above, on pristine upstream's roll (its runtime part only), fail: #6746, #4494."""
    ranks = launch("tests.bodies.context_parallel:roll_checks", 4, {"cases": [(2, UPSTREAM_DEFECT_LENGTHS)]},
                   timeout=300, upstream_tree=upstream_tree)
    for rank in ranks:
        (checks,) = rank.values()
        assert checks["row"] is True  # whole rows come out right...
        assert checks["on_the_cp_group"] is False  # ...through the WORLD group (#6746)
    assert any(next(iter(rank.values()))["packed"] is not True for rank in ranks)  # packed rows do not (#4494)


def tier_cases(cp: int, matrix: bool) -> list:
    """The cases this tier runs at CP = `cp`."""
    return CASES if cp == 2 else CP4_CASES if matrix else CP4_DEFAULT


@pytest.fixture(scope="module")
def model(current, matrix):
    return {cp: launch("tests.bodies.context_parallel:against_reference", cp,
                       {"cp": cp, "cases": tier_cases(cp, matrix)}, timeout=600, build=current) for cp in (2, 4)}


def assert_matches(errors: dict, name: str) -> None:
    assert errors["grad_names"], name
    for key in ("grads", "main", "sums"):
        assert errors[key] < TOL, (name, key, errors[key])
    assert errors["counts_exact"], name


@pytest.mark.parametrize("cp", [2, 4])
def test_the_model_on_cp_ranks_matches_the_reference(model, matrix, cp):
    ranks = model[cp]
    assert len(ranks) == cp, len(ranks)
    for rank in ranks:  # this tier's cases, by name (not a count that either tier's would pass)
        assert sorted(rank) == sorted(case_name(*case) for case in tier_cases(cp, matrix))
        for name, errors in rank.items():
            assert_matches(errors, f"cp{cp}/{name}")


def test_upstream_model_on_cp_ranks_does_not_match_the_reference(current, upstream_tree):
    """Pristine upstream on CP = 2 (runtime part only; the same CP attention, which upstream
    lacks on CPU): its per-token MTP scaling by local counts (#7452) moves the gradient."""
    ranks = launch("tests.bodies.context_parallel:against_reference", 2,
                   {"cp": 2, "cases": [(2, False, False, "padded")]}, timeout=600, upstream_tree=upstream_tree)
    for rank in ranks:
        errors = rank[case_name(2, False, False, "padded")]
        assert errors["main"] < TOL  # the main head is right...
        assert errors["grads"] > 1e-2, errors  # ...the MTP gradient is not


def test_mtp_with_context_parallelism_is_built_on_0_19_and_refused_on_0_16(build):
    (message,) = launch("tests.bodies.context_parallel:refusal_on_this_build", 1, {}, timeout=120, build=build)
    if build == "0.19.2":
        assert message is None
    else:
        assert message is not None and "\n" not in message
        assert "context_parallel_size=2" in message and "megatron-core 0.19.2" in message


def test_gated_delta_net_heads_that_do_not_split_over_cp_ranks_are_refused(current):
    ranks = launch("tests.bodies.context_parallel:gated_delta_net_head_split_refusal", 4, {}, timeout=120,
                   build=current)
    for message in ranks:
        assert message is not None and "\n" not in message
        assert "--linear-num-key-heads 2" in message and "multiple of TP x CP = 4" in message
