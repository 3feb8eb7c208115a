# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""pretrain_gpt_mtp.py with --hybrid-layer-pattern: HybridModel (upstream's successor of GPTModel),
its MTP depths the pattern's "/" parts, trained exactly as GPTModel (issue 18).

Cut invariance. From the same weights, 1 rank x 4 micro-batches, 2 DP ranks x 2, 2 DP
ranks x 1 and PP = 2 (a "|" in the pattern) log the same lm loss, per-depth MTP losses and
grad norm at every iteration (rel 2e-5). Data: short documents with --eod-mask-loss, so micro-batches and ranks hold
different numbers of valid targets (a local normalization, upstream's process_mtp_loss,
differs by cut). Resume: saved at iteration 2 of 4 with dropout, the resumed run repeats
iterations 3-4 bit for bit. Refused in one line before anything is built: a checkpoint of
another pattern (naming both), and layers the local (CPU) hybrid stack does not build.
Gated DeltaNet layers ("G", matrix tier): the same cuts for 1 x 4, 2 x 2 and 2 x 1.
"""

import subprocess

import pytest

from tests.harness import argument_cases
from tests.harness.launcher import REPO_ROOT
from tests.harness.trainer import TINY, close, scalars, train

pytestmark = pytest.mark.slow

PATTERN = "*-*-/*-/*-"  # two attention + MLP layers, two MTP depths of one each
COMMON = (*TINY, "--hybrid-layer-pattern", PATTERN, "--eod-mask-loss", "--global-batch-size", "8", "--lr", "1e-3",
          "--make-vocab-size-divisible-by", "256")
CUTS = {"1x4": (1, ("--micro-batch-size", "2")), "dp2x2": (2, ("--micro-batch-size", "2")),
        "dp2x1": (2, ("--micro-batch-size", "4")),
        # the same layers on two pipeline stages (a "|" in the pattern; the shape ignores it)
        "pp2": (2, ("--micro-batch-size", "2", "--pipeline-model-parallel-size", "2",
                    "--hybrid-layer-pattern", "*-|*-/*-/*-"))}


# the flags of the one iteration the initial_weights fixture saves (tests/conftest.py)
INITIAL = (*COMMON, "--micro-batch-size", "8", "--hidden-dropout", "0", "--attention-dropout", "0")


def test_losses_and_grad_norm_are_the_same_however_the_step_is_cut(dataset, initial_weights, tmp_path):
    measured = {}
    for cut, (nproc, args) in CUTS.items():
        train(nproc, *COMMON, *args, "--data-path", str(dataset), "--load", str(initial_weights), "--finetune",
              "--train-iters", "3", "--hidden-dropout", "0", "--attention-dropout", "0",
              "--tensorboard-dir", str(tmp_path / cut))
        measured[cut] = scalars(tmp_path / cut)
    reference = measured.pop("1x4")
    for cut, values in measured.items():
        for tag in ("lm loss", "mtp_1 loss", "mtp_2 loss", "grad-norm"):
            assert sorted(values[tag]) == sorted(reference[tag]) == [1, 2, 3], (cut, tag)
            for step in (1, 2, 3):
                assert close(values[tag][step], reference[tag][step]), (cut, tag, step, values[tag][step],
                                                                        reference[tag][step])


# Qwen3-Next's layers (issue 27): Gated DeltaNet mixers, full attention in the MTP depths.
DELTA_NET = ("--hybrid-layer-pattern", "G-*-/*-/*-", "--swiglu", "--normalization", "RMSNorm",
             "--linear-num-key-heads", "2", "--linear-num-value-heads", "4", "--linear-key-head-dim", "16",
             "--linear-value-head-dim", "16", "--linear-conv-kernel-dim", "4")


@pytest.mark.matrix  # the default tier: test_hybrid_model's Gated DeltaNet against the reference
def test_gated_deltanet_layers_train_the_same_however_the_step_is_cut(dataset, tmp_path):
    common = (*COMMON, *DELTA_NET, "--data-path", str(dataset), "--hidden-dropout", "0", "--attention-dropout", "0")
    train(1, *common, "--micro-batch-size", "8", "--train-iters", "1", "--save", str(tmp_path / "initial"),
          "--save-interval", "1")
    measured = {}
    for cut in ("1x4", "dp2x2", "dp2x1"):
        nproc, args = CUTS[cut]
        train(nproc, *common, *args, "--load", str(tmp_path / "initial"), "--finetune", "--train-iters", "3",
              "--tensorboard-dir", str(tmp_path / cut))
        measured[cut] = scalars(tmp_path / cut)
    reference = measured.pop("1x4")
    for cut, values in measured.items():
        for tag in ("lm loss", "mtp_1 loss", "mtp_2 loss", "grad-norm"):
            assert sorted(values[tag]) == sorted(reference[tag]) == [1, 2, 3], (cut, tag)
            for step in (1, 2, 3):
                assert close(values[tag][step], reference[tag][step]), (cut, tag, step, values[tag][step],
                                                                        reference[tag][step])


@pytest.mark.matrix  # the default tier resumes GPTModel (PP=2 x VPP=2) and MoE (EP=2 -> 1)
def test_resume_is_bit_exact_with_dropout(dataset, tmp_path):
    common = (*COMMON, "--micro-batch-size", "2", "--data-path", str(dataset), "--train-iters", "4",
              "--save-interval", "2", "--hidden-dropout", "0.1")
    whole = train(2, *common, "--save", str(tmp_path / "whole"))
    resumed = train(2, *common, "--load", str(tmp_path / "whole"), "--ckpt-step", "2")
    assert sorted(resumed.iterations) == [3, 4], resumed.tail()
    timing = ("elapsed time per iteration (ms)", "tokens/s", "ETA")
    for step in (3, 4):
        drop = lambda values: {k: v for k, v in values.items() if not k.startswith(timing)}  # noqa: E731
        assert drop(resumed.iterations[step]) == drop(whole.iterations[step]), step


def test_another_pattern_and_layers_without_a_local_build_are_refused_in_one_line(dataset, initial_weights):
    base = [*COMMON, "--micro-batch-size", "2", "--data-path", str(dataset), "--train-iters", "2"]
    expected = [
        (("--load", str(initial_weights), "--hybrid-layer-pattern", "*-*-*-/*-/*-"),
         f"hybrid_layer_pattern: checkpoint '{PATTERN}', model '*-*-*-/*-/*-'"),
        (("--hybrid-layer-pattern", "M-M-/*-"), "--hybrid-layer-pattern layers M need Transformer Engine"),
        (("--hybrid-layer-pattern", "*E*E/*E"), "--hybrid-layer-pattern has MoE layers 'E': give --num-experts"),
        (("--hybrid-layer-pattern", "G-*-/*-/*-"), "Gated DeltaNet layers (--hybrid-layer-pattern 'G'"),
    ]
    cases = [{"argv": [*base, *extra], "env": {"WORLD_SIZE": "1", "RANK": "0"}} for extra, _ in expected]
    cases.append({"argv": [*base, "--load", str(initial_weights)], "env": {"WORLD_SIZE": "1", "RANK": "0"}})
    # the example's arguments (examples/configs/hybrid_d2.sh) are accepted too
    script = "source examples/configs/hybrid_d2.sh && printf '%s\\n' \"${MTP_ARGS[@]}\""
    example = subprocess.run(["bash", "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                             check=True).stdout.split("\n")[:-1]
    cases.append({"argv": [*base, *example], "env": {"WORLD_SIZE": "1", "RANK": "0"}})
    *refused, accepted, example_accepted = argument_cases.check(cases, timeout=300)
    assert accepted["accepted"] and example_accepted["accepted"], (accepted, example_accepted)
    for (extra, message), outcome in zip(expected, refused, strict=True):
        errors = outcome["errors"]
        assert not outcome["accepted"] and len(errors) == 1 and message in errors[0], (extra, outcome)
