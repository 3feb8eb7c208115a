# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Isolation off, the fork's MTP forward equals pristine upstream megatron-core, for every
carried version.

Upstream side: the pinned sdist plus only the patches without which it cannot run here
(CPU/gloo, Python 3.11; they do not touch MTP). Per-position cross-entropy of every depth
and of the main head, and all logits, must match to 1e-6 (our dense MTP loss); our default,
sparse, MTP loss sums to upstream's masked per-position sums to relative 1e-6.
"""

import pytest
import torch

from megatron_mtp.patched_core import build_tree
from tests.harness import launch

pytestmark = pytest.mark.slow
CASES = [(1, False), (2, True), (3, False)]


@pytest.fixture(scope="module")
def captured(build, upstream_tree, tmp_path_factory):
    out = tmp_path_factory.mktemp("captured")
    (mine,) = launch("tests.bodies.upstream_equality:capture_cases", 1,
                     dict(out_dir=str(out), side="ours", cases=CASES), build=build)
    (upstream,) = launch("tests.bodies.upstream_equality:capture_cases", 1,
                         dict(out_dir=str(out), side="upstream", cases=CASES), upstream_tree=upstream_tree)
    return out, mine, upstream


def test_each_side_ran_its_own_megatron_core(captured, build, upstream_tree):
    _, mine, upstream = captured
    assert mine["core"].startswith(str(build_tree(build)))
    assert upstream["core"].startswith(str(upstream_tree))


@pytest.mark.parametrize("depths,tied", CASES)
def test_isolation_off_forward_equals_upstream(captured, depths, tied):
    out, _, _ = captured
    name = f"D{depths}-{'tied' if tied else 'untied'}"
    a, b = torch.load(out / f"ours-{name}.pt"), torch.load(out / f"upstream-{name}.pt")
    assert len(a["mtp_losses"]) == len(b["mtp_losses"]) == depths
    for key in ("mtp_losses", "logits", "main"):
        assert torch.tensor(a[key]).shape == torch.tensor(b[key]).shape, key  # (allclose broadcasts)
        assert torch.allclose(torch.tensor(a[key]), torch.tensor(b[key]), rtol=0, atol=1e-6), key
    mask = torch.tensor(b["mask"])
    assert len(a["sparse_ce_sums"]) == depths
    for k, (sparse_sum, upstream_ce) in enumerate(zip(a["sparse_ce_sums"], b["mtp_losses"]), start=1):
        mask_k = torch.zeros_like(mask)
        mask_k[:, :-k] = mask[:, k:]  # depth k at t is supervised by the label at t + k
        want = float((torch.tensor(upstream_ce) * mask_k).sum())
        assert abs(sparse_sum - want) <= 1e-6 * abs(want), (k, sparse_sum, want)
