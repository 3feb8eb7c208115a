# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The sparse, chunked losses: MTP (mtp_sparse_loss, the default) exact on extreme masks and
chunkings, and under tensor parallelism with argmax ties across vocabulary shards; the main
head's (sparse_lm_loss, opt-in) against the reference and, under TP = 2, the dense loss.

(The whole reference matrix of test_mtp_model runs both loss paths; the layout and
normalization suites run the default, sparse, path under TP, SP, PP, VPP and DP.)
Tolerance: relative 1e-5 of the largest magnitude (float32 round-off, measured <= 1e-6);
counts exact.
"""

import pytest

from tests.harness import launch

pytestmark = pytest.mark.slow
TOL = 1e-5


# The one-process bodies run in one launch (one megatron-core import), in this order.
ONE_PROCESS = {name: [f"tests.bodies.sparse_loss:{body}", {}] for name, body in (
    ("extremes", "mask_extremes"), ("rows", "last_depth_rows_by_mode"), ("lm_loss", "lm_loss_cases"),
    ("chain", "confident_chain"))}


@pytest.fixture(scope="module")
def one_process(build):
    (results,) = launch("tests.harness.group:run_bodies", 1, {"bodies": ONE_PROCESS}, timeout=900, build=build)
    return results


@pytest.fixture(scope="module")
def extremes(one_process):
    return one_process["extremes"]


@pytest.fixture(scope="module")
def ties(build):
    return launch("tests.bodies.sparse_loss:vocab_parallel_ties", 2, timeout=600, build=build)


def test_masks_cover_the_extremes(extremes):
    valid = {name: case["valid_per_depth"] for name, case in extremes.items()}
    assert all(v > 0 for v in valid["full"])
    assert valid["depth3_empty"][2] == 0 and valid["depth3_empty"][0] > 0
    assert valid["empty"] == [0, 0, 0]
    # Chunks of 7 leave a partial last chunk wherever there are rows.
    assert all(case["rows"] % 7 for case in extremes.values() if case["rows"])


@pytest.mark.parametrize("path", ["chunk1", "chunk7", "chunk1000", "dense"])
def test_every_mask_matches_the_reference(extremes, path):
    for name, case in extremes.items():
        got = case[path]
        assert got["same_grad_names"] and got["grads_finite"], name
        assert got["grads"] <= TOL, (name, got)
        assert got["sums"] <= TOL, (name, got)
        assert got["counts_exact"], (name, got)


def test_the_last_depths_mlp_runs_only_where_its_loss_reads(extremes):
    for name, case in extremes.items():
        every_row, valid_last = case["every_row"], int(case["valid_per_depth"][-1])
        for path in ("chunk1", "chunk7", "chunk1000"):
            assert case[path]["mlp_rows"] == [every_row, every_row, valid_last], (name, path)
        assert case["dense"]["mlp_rows"] == [every_row] * 3, name


def test_last_depth_rows_in_repeated_mode_and_where_the_layer_stays_dense(one_process):
    rows = one_process["rows"]
    every_row, valid_last = rows["every_row"], rows["valid_at_last_depth"]
    assert 0 < valid_last < every_row
    assert rows["repeated"] == [every_row, every_row, valid_last]
    # Full recompute reruns each layer in the backward: every call at every row.
    assert rows["recompute"] == [every_row] * 6
    assert rows["dense_loss"] == [every_row] * 3


def test_sparse_lm_loss_matches_the_reference(one_process):
    result = one_process["lm_loss"]
    assert len(result) == 8
    for name, case in result.items():
        assert case["same_grad_names"] and case["zero_where_masked"], name
        assert case["main_ce"] <= TOL and case["grads"] <= TOL, (name, case)


def test_chain_counts_where_a_shallower_target_is_masked(one_process):
    result = one_process["chain"]
    assert sorted(result) == ["holes", "mixed"]
    for name, case in result.items():
        assert len(case["sums"]) == len(case["reference"]) == 3, name  # DEPTHS of the body
        for got, want in zip(case["sums"], case["reference"]):
            assert want[3] == want[1] > 0, (name, want)  # the reference: every valid position chain-correct
            assert got[1:4] == want[1:4], (name, got, want)  # the counts


def test_vocab_parallel_ties_resolve_to_the_lowest_index(ties):
    for rank in ties:
        assert rank["tied_partner_targets_1"] > 0 and rank["expected_correct_1"] > 0
        for path in ("sparse", "dense"):
            depth1 = rank[path]["sums"][0]
            assert depth1[2] == rank["expected_correct_1"], (path, depth1)
            assert depth1[3] == rank["expected_correct_1"], (path, depth1)  # chain = top-1 at depth 1
        assert len(rank["sparse"]["sums"]) == len(rank["dense"]["sums"]) == 2  # depths of the body
        for sparse_row, dense_row in zip(rank["sparse"]["sums"], rank["dense"]["sums"]):
            assert sparse_row[0] == pytest.approx(dense_row[0], rel=TOL)  # CE sum
            assert sparse_row[1:4] == dense_row[1:4]  # valid, correct, chain-correct counts
            assert sparse_row[4:] == pytest.approx(dense_row[4:], rel=TOL)  # sampled acceptance, its chain
        assert rank["grads_sparse_vs_dense"] <= TOL
    assert sorted(rank["tp_rank"] for rank in ties) == [0, 1]
