# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""pretrain_gpt_mtp.py with mixture-of-experts layers (spec section 11), as a user runs it.

Cut invariance. One checkpoint (MoE backbone, MTP D = 1 with an MoE layer, sigmoid router
with expert bias, seq_aux_loss and z-loss) is trained on from the same weights as 1 rank x
4 micro-batches, 2 DP ranks x 2, 2 DP ranks x 1 and EP = 2 (2 ranks x 2 micro-batches,
each rank holding half the experts; the checkpoint was written with EP = 1, so this also
loads it resharded). The data are short documents with --eod-mask-loss, so micro-batches
and ranks hold different numbers of valid targets while every position is routed. The lm
loss, the MTP loss, each router loss, the grad norm and the MTP grad norm (isolation on)
must agree at every iteration, and an evaluation's losses (router losses included) after
the last, to rel 2e-5 (float32 sums in another order; measured in the
closing note). Upstream's per-token mode (and this fork before the router scale) weights
the router losses by local token counts over the valid-target count, which differs by
cut here; both fail this test.

Resume. A run with EP = 2 (distributed optimizer, fully reshardable) saves at iteration 3 of
6; resumed, it repeats iterations 4-6 bit for bit (expert bias included); resumed with EP = 1
(the optimizer state too), it trains on as the saving layout did.

The example config examples/configs/deepseek_v3_moe_tiny.sh trains through the CPU quick
start; bad MoE input is refused in one line before anything is built.
"""


import pytest

from tests.harness import argument_cases
from tests.harness.trainer import TINY, checkpoint_tensors, close, parse, scalars, train
from tests.test_examples import bash

pytestmark = pytest.mark.slow

MOE = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
       "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
       "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-2",
       "--moe-z-loss-coeff", "1e-3", "--disable-bias-linear", "--moe-token-dispatcher-type", "alltoall")
COMMON = TINY + MOE + ("--num-layers", "2", "--mtp-num-layers", "1", "--hidden-dropout", "0",
                       "--attention-dropout", "0", "--eod-mask-loss", "--global-batch-size", "8", "--lr", "1e-3",
                       "--make-vocab-size-divisible-by", "256")
CUTS = {
    "1x4": (1, ("--micro-batch-size", "2")),
    "dp2x2": (2, ("--micro-batch-size", "2")),
    "dp2x1": (2, ("--micro-batch-size", "4")),
    "ep2": (2, ("--micro-batch-size", "2", "--expert-model-parallel-size", "2")),
    # every sequence cut over 2 ranks, each routing its pieces (T counted from whole rows on CP rank 0)
    "cp2": (2, ("--micro-batch-size", "2", "--context-parallel-size", "2")),
}
# One evaluation of one global batch after iteration 3 (the end-of-training one writes the
# same tags at the same iteration: the last value is compared).
EVALUATION = ("--eval-interval", "3", "--eval-iters", "1")
# The backbone's as upstream reports them, and the MTP depth's own (spec section 11).
ROUTER_LOSSES = ("seq_load_balancing_loss", "z_loss", "mtp_1 seq load balancing loss", "mtp_1 z loss")


# the flags of the one iteration the initial_weights fixture saves (tests/conftest.py)
INITIAL = (*COMMON, "--micro-batch-size", "8")


@pytest.mark.parametrize("isolation,cuts", [
    pytest.param((), ("1x4", "dp2x2", "ep2", "cp2"), id="attached"),
    pytest.param((), ("1x4", "dp2x1"), id="attached-dp2x1", marks=pytest.mark.matrix),
    pytest.param(("--mtp-detach-heads",), ("1x4", "ep2", "cp2"), id="isolated", marks=pytest.mark.matrix)])
def test_router_losses_and_gradients_are_the_same_however_the_step_is_cut(isolation, cuts, dataset,
                                                                           initial_weights, tmp_path):
    measured = {}
    for cut in cuts:
        nproc, args = CUTS[cut]
        logs = tmp_path / f"tb-{cut}"
        train(nproc, *COMMON, *args, *isolation, "--data-path", str(dataset), "--load", str(initial_weights),
              "--finetune", "--train-iters", "3", "--tensorboard-dir", str(logs), *EVALUATION)
        measured[cut] = scalars(logs)
    compared = ("lm loss", "mtp_1 loss", *ROUTER_LOSSES, "grad-norm") + (("mtp grad norm",) if isolation else ())
    validation = tuple(f"{tag} validation" for tag in ("lm loss", "mtp_1 loss", *ROUTER_LOSSES))
    reference = measured.pop(cuts[0])
    assert set(compared) <= set(reference), sorted(reference)
    for cut, values in measured.items():
        for tag in compared:
            assert sorted(values[tag]) == sorted(reference[tag]) == [1, 2, 3], (cut, tag)
            for step in (1, 2, 3):
                assert close(values[tag][step], reference[tag][step]), (
                    f"{cut}, {tag}, step {step}: {values[tag][step]!r} vs {cuts[0]} {reference[tag][step]!r}")
        for tag in validation:  # an evaluation at iteration 3, the router losses included
            assert sorted(values[tag]) == sorted(reference[tag]) == [3], (cut, tag)
            assert close(values[tag][3], reference[tag][3]), (cut, tag, values[tag][3], reference[tag][3])


def test_resume_is_bit_exact_and_an_ep2_checkpoint_trains_on_with_ep1(dataset, tmp_path):
    common = (*COMMON, "--micro-batch-size", "2", "--data-path", str(dataset), "--train-iters", "6",
              "--save-interval", "3", "--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable")
    ep2 = ("--expert-model-parallel-size", "2")
    whole = train(2, *common, *ep2, "--save", str(tmp_path / "whole"), "--tensorboard-dir", str(tmp_path / "tb-whole"))
    resumed = train(2, *common, *ep2, "--load", str(tmp_path / "whole"), "--ckpt-step", "3",
                    "--save", str(tmp_path / "resumed"))
    assert sorted(resumed.iterations) == [4, 5, 6], resumed.tail()
    timing = ("elapsed time per iteration (ms)", "tokens/s", "ETA")
    for step in (4, 5, 6):
        drop = lambda values: {k: v for k, v in values.items() if not k.startswith(timing)}  # noqa: E731
        assert drop(resumed.iterations[step]) == drop(whole.iterations[step]), step
    final = checkpoint_tensors(tmp_path / "whole" / "iter_0000006")
    again = checkpoint_tensors(tmp_path / "resumed" / "iter_0000006")
    assert final.keys() == again.keys()
    biases = [key for key in final if key.endswith("router.expert_bias")]
    # the backbone's MoE layers (stacked in one key) and the MTP depth's
    assert sorted(biases) == ["decoder.layers.mlp.router.expert_bias",
                              "mtp.layers.0.transformer_layer.mlp.router.expert_bias"], biases
    assert [key for key in final if not final[key].equal(again[key])] == []

    # The EP = 2 checkpoint resharded onto EP = 1 (each rank now holds all four experts; one
    # distributed optimizer instead of megatron-core's chain of dense and expert optimizers): it
    # trains on as the EP = 2 run did, the optimizer state included (float32 sums in another
    # order). EP 1 -> 2 and the FP32 optimizer's nesting: tests/in_build/test_chained_optimizer_state.py.
    train(2, *common, "--load", str(tmp_path / "whole"), "--ckpt-step", "3",
          "--tensorboard-dir", str(tmp_path / "tb-ep1"))
    assert_trains_on(tmp_path / "tb-whole", tmp_path / "tb-ep1")


@pytest.mark.matrix
def test_a_per_bucket_optimizer_state_of_another_expert_layout_is_refused_in_one_line(dataset, tmp_path):
    """Saved with EP = 2 (megatron-core's chain of a dense and an expert optimizer) in the
    distributed optimizer's per-bucket layout, which cannot follow the parameters to one
    optimizer: resumed with EP = 1, load_checkpoint's hook (patch "Optimizer: load a state
    saved by a chain of another length") refuses it in one line naming the ways out, on every
    rank, before any tensor is read; with --no-load-optim the same load trains on."""
    common = (*COMMON, "--micro-batch-size", "2", "--data-path", str(dataset), "--use-distributed-optimizer")
    train(2, *common, "--expert-model-parallel-size", "2", "--train-iters", "2", "--save-interval", "2",
          "--save", str(tmp_path / "ep2"))
    resume = (*common, "--train-iters", "3", "--load", str(tmp_path / "ep2"), "--save", str(tmp_path / "ep1"),
              "--save-interval", "3")
    refused = train(2, *resume, check=False)
    assert refused.returncode != 0 and not refused.iterations, refused.tail()
    errors = set(refused.errors())
    assert len(errors) == 1, refused.tail()
    message = errors.pop()
    assert "per-bucket layout 'dp_reshardable' of 2 optimizer(s)" in message and "this run's 1" in message, message
    assert "--dist-ckpt-optim-fully-reshardable" in message and "--no-load-optim" in message, message
    assert not (tmp_path / "ep1").exists() or not any((tmp_path / "ep1").iterdir())
    trained = train(2, *resume, "--no-load-optim")
    assert sorted(trained.iterations) == [3], trained.tail()


def assert_trains_on(whole_logs, resharded_logs) -> None:
    """The run logged to `resharded_logs`, resumed at iteration 3 in another expert layout,
    logs at iterations 4-6 what the saving run logged to `whole_logs`."""
    whole, resharded = scalars(whole_logs), scalars(resharded_logs)
    for tag in ("lm loss", "mtp_1 loss", *ROUTER_LOSSES, "grad-norm"):
        assert sorted(resharded[tag]) == [4, 5, 6], (tag, sorted(resharded[tag]))
        for step in (4, 5, 6):
            assert close(resharded[tag][step], whole[tag][step]), (tag, step, resharded[tag][step], whole[tag][step])


@pytest.mark.matrix
def test_the_deepseek_v3_moe_example_trains_on_cpu(tmp_path):
    output = bash("examples/cpu_quickstart.sh", "--train-iters", "3", "--lr-warmup-iters", "1", "--eval-iters", "0",
                  "--save-interval", "3", "--log-interval", "1",
                  env={"WORK": str(tmp_path), "CONFIG": "examples/configs/deepseek_v3_moe_tiny.sh"})
    iterations, _ = parse(output)
    assert sorted(iterations) == [1, 2, 3], output[-3000:]
    assert iterations[3]["seq_load_balancing_loss"] > 0 and "mtp_1 loss" in iterations[3]


@pytest.mark.matrix  # the default tier: MoE's router losses over DP and EP cuts
def test_a_dense_first_pipeline_stage_reports_the_router_losses(dataset, tmp_path):
    """Upstream's #3401: with MTP, a pipeline stage without MoE layers gave the MoE metrics
    tracker fewer slots than the stages that route, and the all-reduce over the pipeline hung
    (0.19.2 sizes every stage's slots alike). Stage 1 here is dense (--moe-layer-freq [0,1]);
    stage 2 holds the MoE layer and the MTP depth's. Upstream's per-layer logging keeps one
    slot per layer, the MTP layer's after the backbone's."""
    run = train(2, *COMMON, "--micro-batch-size", "2", "--data-path", str(dataset), "--train-iters", "2",
                "--pipeline-model-parallel-size", "2", "--moe-layer-freq", "[0,1]", "--moe-per-layer-logging",
                "--tensorboard-dir", str(tmp_path / "tb"))
    assert sorted(run.iterations) == [1, 2], run.tail()
    assert all(run.iterations[2][name] > 0 for name in ROUTER_LOSSES), run.iterations[2]
    per_layer = scalars(tmp_path / "tb")
    dense, moe, mtp = (per_layer[f"moe/seq_load_balancing_loss_layer_{i}"][2] for i in range(3))
    assert dense == 0 and moe > 0 and mtp > 0, (dense, moe, mtp)
    assert mtp == pytest.approx(run.iterations[2]["mtp_1 seq load balancing loss"], rel=1e-5)


@pytest.mark.matrix  # the default tier refuses other shapes in test_trainer_faults and test_architectures
def test_a_checkpoint_of_another_expert_shape_is_refused_before_anything_is_built(dataset, initial_weights):
    """The expert count, the experts' size and the MoE layers' placement are part of the
    checkpoint's shape: experts are keyed by global index, so another count would load some
    and leave the others as initialized."""
    base = [*COMMON, "--micro-batch-size", "2", "--data-path", str(dataset), "--train-iters", "2",
            "--load", str(initial_weights)]
    expected = [(("--num-experts", "8", "--moe-router-topk", "2"), "num_moe_experts: checkpoint 4, model 8"),
                (("--moe-layer-freq", "[0,1]"), "moe_layers: checkpoint [1, 1], model [0, 1]"),
                (("--moe-ffn-hidden-size", "16"), "moe_ffn_hidden_size: checkpoint 32, model 16")]
    cases = [{"argv": [*base, *extra], "env": {"WORLD_SIZE": "1", "RANK": "0"}} for extra, _ in expected]
    cases.append({"argv": base, "env": {"WORLD_SIZE": "1", "RANK": "0"}})
    *refused, accepted = argument_cases.check(cases, timeout=300)
    assert accepted["accepted"], accepted
    for (extra, message), outcome in zip(expected, refused, strict=True):
        errors = outcome["errors"]
        assert not outcome["accepted"] and len(errors) == 1 and message in errors[0], (extra, outcome)


REFUSALS = [
    (("--moe-router-topk", "8"), "--moe-router-topk 8 exceeds --num-experts 4"),
    (("--expert-model-parallel-size", "3"), "--num-experts 4 is not divisible by --expert-model-parallel-size 3"),
    (("--expert-model-parallel-size", "4"), "world size 2 is not a multiple of expert-tensor x expert x pipeline"),
    (("--moe-permute-fusion",), "--moe-permute-fusion needs a CUDA kernel"),
    (("--moe-router-load-balancing-type", "global_aux_loss"), "cannot be normalized exactly"),
]


def test_bad_moe_input_is_refused_in_one_line():
    """Every case through the script's argument handling in one process (tests.harness.
    argument_cases: no distributed start-up is needed to refuse), as rank 0 of 2 ranks."""
    base = [*COMMON, "--micro-batch-size", "2", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "256", "--train-iters", "1"]
    cases = [{"argv": [*base, *extra], "env": {"WORLD_SIZE": "2", "RANK": "0"}} for extra, _ in REFUSALS]
    cases.append({"argv": base, "env": {"WORLD_SIZE": "2", "RANK": "0"}})  # the same without the fault
    *refused, accepted = argument_cases.check(cases, timeout=300)
    assert len(refused) == len(REFUSALS) and accepted["accepted"], accepted
    for (extra, message), outcome in zip(REFUSALS, refused, strict=True):
        errors = outcome["errors"]
        assert not outcome["accepted"] and len(errors) == 1 and message in errors[0], (extra, outcome)
        assert not any("Traceback" in line for line in outcome["stderr"]), (extra, outcome)
