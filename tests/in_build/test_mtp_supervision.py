# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Depth targets and masks, position by position, on hand-built examples (spec section 3)."""

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron.core.fork.mtp.statistics import FIELDS, metrics_from_sums, widened
from megatron.core.fork.mtp.supervision import depth_targets, next_token_labels
from tests.harness.masks import effective_mask


def packed(lengths):
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))


def test_padded_rows_by_hand():
    # row 0: 6 tokens, holes at targets 1 and 3; row 1: 3 real tokens then padding (short:
    # fewer than k + 2 tokens for k = 2).
    labels = torch.tensor([[11, 12, 13, 14, 15, 0], [21, 22, 0, 0, 0, 0]])
    mask = torch.tensor([[1., 0., 1., 0., 1., 0.], [1., 1., 0., 0., 0., 0.]])
    got = {k: (l.tolist(), m.tolist()) for k, l, m in depth_targets(labels, mask, 2)}
    assert got[1] == ([[12, 13, 14, 15, 0, 0], [22, 0, 0, 0, 0, 0]],
                      [[0., 1., 0., 1., 0., 0.], [1., 0., 0., 0., 0., 0.]])
    assert got[2] == ([[13, 14, 15, 0, 0, 0], [0, 0, 0, 0, 0, 0]],
                      [[1., 0., 1., 0., 0., 0.], [0., 0., 0., 0., 0., 0.]])


def test_packed_row_whose_segments_end_mid_row_by_hand():
    # segments [0, 3), [3, 5), [5, 8); no target crosses a boundary at any depth.
    labels = torch.tensor([[1, 2, 0, 4, 0, 6, 7, 0]])
    mask = torch.tensor([[1., 1., 0., 1., 0., 1., 1., 0.]])
    got = {k: (l.tolist(), m.tolist()) for k, l, m in depth_targets(labels, mask, 2, packed([3, 2, 3]))}
    assert got[1] == ([[2, 0, 0, 0, 0, 7, 0, 0]], [[1., 0., 0., 0., 0., 1., 0., 0.]])
    assert got[2] == ([[0, 0, 0, 0, 0, 0, 0, 0]], [[0., 0., 0., 0., 0., 0., 0., 0.]])


def test_labels_from_input_ids_stop_at_segment_ends():
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    labels, has_next = next_token_labels(ids, packed([2, 3]))
    assert labels.tolist() == [[6, 0, 8, 9, 0]]
    assert has_next.tolist() == [[1., 0., 1., 1., 0.]]
    labels, has_next = next_token_labels(ids)
    assert labels.tolist() == [[6, 7, 8, 9, 0]] and has_next.tolist() == [[1., 1., 1., 1., 0.]]


def test_sample_mask_drops_whole_samples():
    token = torch.tensor([[1., 0., 1.], [1., 1., 1.]])
    assert effective_mask(token, torch.tensor([1, 0])).tolist() == [[1., 0., 1.], [0., 0., 0.]]
    with pytest.raises(ValueError, match="sample mask must be"):
        effective_mask(token, torch.tensor([1, 0, 1]))
    with pytest.raises(ValueError, match="token mask must be"):
        effective_mask(token[0])


def test_metrics_from_sums_are_ratios_of_sums_with_the_bonus_token():
    sums = torch.tensor([[6.0, 4.0, 3.0, 3.0, 2.0, 2.0, 4.0, 1.0, 1.0], [4.0, 2.0, 1.0, 1.0, 1.5, 0.5, 2.0, 0.5, 0.25]],
                        dtype=torch.float64)
    metrics = metrics_from_sums(sums)
    assert metrics["mtp_1 loss"] == 1.5 and metrics["mtp_2 loss"] == 2.0
    assert metrics["mtp_1 acceptance"] == 0.75 and metrics["mtp_2 chain acceptance"] == 0.5
    assert metrics["expected accepted length (incl. bonus token)"] == 1 + 0.75 + 0.5
    assert metrics["mtp_1 sampled acceptance"] == 0.5 and metrics["mtp_2 sampled acceptance"] == 0.75
    assert metrics["expected accepted length (sampling)"] == 1 + 0.5 + 0.25
    assert metrics["mtp_1 greedy-draft acceptance"] == 0.25 and metrics["mtp_2 greedy-draft acceptance"] == 0.25
    assert metrics["expected accepted length (greedy drafts)"] == 1 + 0.25 + 0.125


def test_sums_saved_before_the_sampled_fields_resume_with_them_unknown():
    old = torch.tensor([[6.0, 4.0, 3.0, 3.0]], dtype=torch.float64)
    metrics = metrics_from_sums(widened(old))
    assert metrics["mtp_1 acceptance"] == 0.75
    # unknown, so left out (not reported as 0)
    assert "mtp_1 sampled acceptance" not in metrics and "expected accepted length (sampling)" not in metrics


def test_sums_saved_without_the_measured_count_resume_measured_nowhere():
    # [D, 6]: the sampled sums of steps whose greedy-draft acceptance is unknown; both are counted over
    # the same measured positions, so those steps count at none
    for sampled in (2.0, float("nan")):
        old = torch.tensor([[6.0, 4.0, 3.0, 3.0, sampled, 1.0]], dtype=torch.float64)
        assert widened(old).tolist() == [[6.0, 4.0, 3.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0]]
    metrics = metrics_from_sums(widened(old))
    assert metrics["mtp_1 acceptance"] == 0.75 and "mtp_1 greedy-draft acceptance" not in metrics
    # a later step measured at 2 positions: the ratios are over those only
    later = widened(old) + torch.tensor([[1.0, 2.0, 1.0, 1.0, 1.5, 1.0, 2.0, 0.5, 0.25]], dtype=torch.float64)
    metrics = metrics_from_sums(later)
    assert metrics["mtp_1 sampled acceptance"] == 0.75 and metrics["mtp_1 greedy-draft acceptance"] == 0.25


def test_sampled_metrics_are_ratios_over_the_measured_positions():
    # depth 1 measured at 2 of its 4 valid positions; depth 2 has none valid (0, as its other metrics)
    sums = torch.tensor([[6.0, 4.0, 3.0, 3.0, 1.5, 1.5, 2.0, 1.0, 0.5], [0.0] * 9], dtype=torch.float64)
    metrics = metrics_from_sums(sums)
    assert metrics["mtp_1 sampled acceptance"] == 0.75 and metrics["mtp_2 sampled acceptance"] == 0.0
    assert metrics["expected accepted length (sampling)"] == 1.75
    assert metrics["mtp_1 greedy-draft acceptance"] == 0.5
    assert metrics["expected accepted length (greedy drafts)"] == 1.25
    # depth 2 valid but measured nowhere: unknown, and so is the chained length
    sums[1, 1] = 3.0
    metrics = metrics_from_sums(sums)
    assert "mtp_2 sampled acceptance" not in metrics and "expected accepted length (sampling)" not in metrics
    assert "mtp_2 greedy-draft acceptance" not in metrics
    assert "expected accepted length (greedy drafts)" not in metrics


def test_a_depth_without_valid_positions_reports_zero_not_nan():
    metrics = metrics_from_sums(torch.zeros(2, FIELDS, dtype=torch.float64))
    assert all(v == v for v in metrics.values())  # no NaN
    assert metrics["expected accepted length (incl. bonus token)"] == 1.0
