# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""A refusal found inside a step reaches every rank (issue 50).

An MTP forward without a loss mask, and the router losses' checks of a packed or padded forward,
are found on the ranks whose forward sees them: the last pipeline stage, or one data-parallel
rank's micro-batch. Raised there at once, the other ranks would wait in a pipeline receive or in
the gradient reduce until the process group's timeout (120 s in these launches). The step holds
the refusal until its gradient reduce, where every rank raises the same one line
(megatron.core.fork.mtp.step.running): each launch must end well before that timeout with every
rank refused in that line, at PP = 2 x TP = 2, CP = 2 x DP = 2 and EP = 2 (MoE over DP = 4),
through pretrain_gpt_mtp.py (one error line, no traceback) and through exact_mtp_step
(tests/bodies/step_refusals.py). Default tier: exact_mtp_step at PP = 2 x TP = 2; the rest is
matrix tier.
"""

import time

import pytest

from tests.harness import launch
from tests.harness.trainer import TINY, train

pytestmark = pytest.mark.slow

BOUND = 90  # seconds: a launch that waits for the process group's timeout (120 s) takes longer
RUN = TINY + ("--lr", "1e-3", "--mtp-num-layers", "2", "--train-iters", "2")
# (name, flags, the data-parallel rank whose forward gives no loss mask)
TRAINER_LAYOUTS = [
    ("pp2_tp2", ("--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2"), 0),
    ("cp2_dp2", ("--context-parallel-size", "2"), 1),
    ("ep2_dp4", ("--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-aux-loss-coeff", "0.01"), 3),
]
# (name, TP, PP, CP, EP, case): tests/bodies/step_refusals.py
STEP_LAYOUTS = [
    pytest.param("pp2_tp2", 2, 2, 1, 1, "no_loss_mask"),
    pytest.param("cp2_dp2", 1, 1, 2, 1, "no_loss_mask", marks=pytest.mark.matrix),
    pytest.param("ep2_dp4", 1, 1, 1, 2, "no_loss_mask", marks=pytest.mark.matrix),
    pytest.param("ep2_dp4", 1, 1, 1, 2, "padding_mask", marks=pytest.mark.matrix),
]


@pytest.mark.matrix
@pytest.mark.parametrize("name,flags,missing_on", TRAINER_LAYOUTS, ids=[layout[0] for layout in TRAINER_LAYOUTS])
def test_pretrain_refuses_a_forward_without_a_loss_mask_on_every_rank(name, flags, missing_on, dataset):
    started = time.monotonic()
    run = train(4, *RUN, "--data-path", str(dataset), *flags, script="tests/harness/forward_without_loss_mask.py",
                env={"MISSING_ON_DP_RANK": str(missing_on)}, check=False, timeout=300)
    elapsed = time.monotonic() - started
    assert run.returncode != 0 and elapsed < BOUND, (elapsed, run.tail())
    (error,) = run.errors()
    assert "an MTP forward inside an exact step needs a loss_mask" in error, run.tail()
    workers = [line for line in run.output.splitlines() if line.startswith("[default")]  # torchrun's own report aside
    assert not any("Traceback" in line for line in workers) and "[rank" not in run.output, run.tail()
    assert not run.iterations  # refused before its gradient reduce: no iteration completes


@pytest.mark.parametrize("name,tp,pp,cp,ep,case", STEP_LAYOUTS)
def test_exact_mtp_step_refuses_on_every_rank(name, tp, pp, cp, ep, case, tmp_path):
    started = time.monotonic()
    ranks = launch("tests.bodies.step_refusals:refuse_in_step", 4,
                   {"ckpt_root": str(tmp_path), "layout": [tp, pp, cp, ep], "case": case}, timeout=300)
    elapsed = time.monotonic() - started
    words = {"no_loss_mask": "needs a loss_mask", "padding_mask": "a padding_mask with MoE router losses"}[case]
    assert len(ranks) == 4 and elapsed < BOUND, elapsed
    for rank in ranks:
        assert rank["refused"] == "StepRefused" and words in rank["message"], rank
        assert "\n" not in rank["message"] and rank["seconds"] < BOUND, rank
        assert rank["params"] and rank["grads_zero"] and rank["inactive"], rank
