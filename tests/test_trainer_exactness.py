# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""pretrain_gpt_mtp.py on upstream's training loop: every step is the spec's objective in
any layout, and a resumed run repeats the uninterrupted one bit for bit.

Exact steps. Every run starts from the same weights (--finetune from one checkpoint) and
trains on short documents with --eod-mask-loss, so the loss masks have holes at
irregular places and micro-batches and ranks hold different numbers of valid tokens.
- Step 1 of every layout equals the spec's objective recomputed in float64 on the
  plain-PyTorch reference model (tests/reference/first_step.py): lm loss at the requested
  level, each depth's MTP loss, the main and MTP gradient norms; rel 2e-6 (measured
  <= 1.3e-7). Token and sequence level differ by ~1e-5 on the lm loss and ~2e-4 on the
  gradient norm here, so the level is checked, not only the consistency.
- Steps 2 and 3 (after optimizer updates) of every layout equal the single-micro-batch
  run's to rel 2e-5 (measured <= 1.1e-6).

Resume. A run saves at iteration 3 of 6; a second run loads that checkpoint and trains
to 6. Its console lines, TensorBoard scalars (cumulative acceptance included) and final
checkpoint (every model and optimizer tensor) must equal the first run's, with dropout
on, for distinct and repeated MTP layers, isolation on and off, the distributed
optimizer, TP and PP with virtual stages, context parallelism, and the architectures
of DeepSeek-V3 (MLA, MoE with EP = 2) and Qwen3-Next (Gated DeltaNet, gated attention,
TP = 2). A checkpoint saved with CP = 2 trains on at CP = 1.
"""

import pytest

from tests.harness.trainer import TINY, checkpoint_tensors, close, scalars, train
from tests.reference.first_step import first_step, gpt_train_samples, reference_weights

pytestmark = pytest.mark.slow

# Values that depend on time, not on the training.
TIMING = ("elapsed time per iteration (ms)", "tokens/s", "tokens per second", "iteration-time",
          "throughput", "ETA")


def untimed(values: dict) -> dict:
    return {name: value for name, value in values.items() if not name.startswith(TIMING)}


BYTES_EOD = 256  # the byte tokenizer's end of document


def trained(nproc, *args, tmp_path, name):
    logs = tmp_path / f"tb-{name}"
    run = train(nproc, *args, "--tensorboard-dir", str(logs))
    return run, scalars(logs)


# ---------------------------------------------------------------- exact in any layout

EXACT = TINY + ("--num-layers", "4", "--hidden-dropout", "0", "--attention-dropout", "0", "--eod-mask-loss",
                "--mtp-num-layers", "2", "--train-iters", "3", "--global-batch-size", "8", "--lr", "1e-3")
# The padded vocabulary is a multiple of --make-vocab-size-divisible-by x TP: 512 in every layout.
REFERENCE = (1, ("--micro-batch-size", "8", "--make-vocab-size-divisible-by", "256"))  # one micro-batch, one rank
# the one iteration every layout starts from (the initial_weights fixture, tests/conftest.py)
INITIAL = (*EXACT, *REFERENCE[1], "--mtp-detach-heads")
LAYOUTS = {
    "dp2-distributed-optimizer": (2, ("--micro-batch-size", "2", "--use-distributed-optimizer",
                                      "--make-vocab-size-divisible-by", "256")),
    "tp2-sequence-parallel": (2, ("--tensor-model-parallel-size", "2", "--sequence-parallel",
                                  "--micro-batch-size", "2", "--make-vocab-size-divisible-by", "128")),
    "pp2-vpp2": (2, ("--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
                     "--micro-batch-size", "1", "--make-vocab-size-divisible-by", "256")),
    # The main head's loss at valid positions only, too (MTP's is by default).
    "tp2-sequence-parallel-sparse-lm-loss": (2, ("--tensor-model-parallel-size", "2", "--sequence-parallel",
                                                 "--sparse-lm-loss", "--micro-batch-size", "2",
                                                 "--make-vocab-size-divisible-by", "128")),
    # Context parallelism: every sequence cut over 2 ranks (upstream's load-balanced chunks), the
    # MTP targets rolled across them (issue 28).
    "cp2": (2, ("--context-parallel-size", "2", "--micro-batch-size", "2", "--make-vocab-size-divisible-by", "256")),
    "cp2-dp2": (4, ("--context-parallel-size", "2", "--micro-batch-size", "2",
                    "--make-vocab-size-divisible-by", "256")),
    "two-micro-batches": (1, ("--micro-batch-size", "4", "--make-vocab-size-divisible-by", "256")),
}
COMPARED = ("lm loss", "mtp_1 loss", "mtp_2 loss", "grad-norm", "mtp grad norm")


@pytest.mark.parametrize("level,isolation,layouts", [
    pytest.param("token", ("--mtp-detach-heads",), ("tp2-sequence-parallel", "pp2-vpp2", "cp2"), id="token-isolated"),
    pytest.param("sequence", (), ("pp2-vpp2", "cp2-dp2"), id="sequence-attached"),
    # Context parallelism with isolation off at token level and on at sequence level.
    pytest.param("token", (), ("two-micro-batches", "cp2", "cp2-dp2"), id="token-attached-cp",
                 marks=pytest.mark.matrix),
    pytest.param("sequence", ("--mtp-detach-heads",), ("cp2-dp2",), id="sequence-isolated-cp",
                 marks=pytest.mark.matrix),
    # DP with the distributed optimizer (its model-level case in the default tier: test_mtp_layouts'
    # dp4_distributed_optimizer); the sparse main loss on TP x SP (its rows against the dense loss
    # also in test_mtp_sparse_loss).
    pytest.param("token", ("--mtp-detach-heads",),
                 ("dp2-distributed-optimizer", "tp2-sequence-parallel-sparse-lm-loss"),
                 id="token-isolated-dp-and-sparse-lm-loss", marks=pytest.mark.matrix),
    # The draft objectives of spec section 12 (e2e_tv couples the depths at each position; the
    # main head's distribution at t + k crosses TP shards and CP ranks).
    pytest.param("token", ("--mtp-detach-heads", "--mtp-loss-type", "e2e_tv", "--mtp-draft-temperature", "0.8"),
                 ("tp2-sequence-parallel", "cp2"), id="token-e2e-tv"),
    pytest.param("sequence", ("--mtp-detach-heads", "--mtp-loss-type", "tv"), ("two-micro-batches", "cp2-dp2"),
                 id="sequence-tv", marks=pytest.mark.matrix),
    pytest.param("token", ("--mtp-detach-heads", "--mtp-loss-type", "kl", "--mtp-draft-temperature", "1.3"),
                 ("dp2-distributed-optimizer", "pp2-vpp2"), id="token-kl", marks=pytest.mark.matrix),
])
def test_every_layout_trains_the_spec_objective(level, isolation, layouts, dataset, initial_weights, tmp_path):
    common = (*EXACT, "--data-path", str(dataset), "--load", str(initial_weights), "--finetune",
              "--main-loss-level", level, *isolation)
    runs = {"single micro-batch": trained(REFERENCE[0], *common, *REFERENCE[1], tmp_path=tmp_path,
                                          name="single")[1]}
    for layout in layouts:
        nproc, args = LAYOUTS[layout]
        runs[layout] = trained(nproc, *common, *args, tmp_path=tmp_path, name=layout)[1]

    options = dict(zip(isolation[1::2], isolation[2::2]))  # the draft objective's flags, if any
    expected = first_step(reference_weights(checkpoint_tensors(initial_weights / "iter_0000001")),
                          gpt_train_samples(dataset, num_samples=3 * 8, count=8), BYTES_EOD, depths=2,
                          level=level, detach=bool(isolation), objective=options.get("--mtp-loss-type", "ce"),
                          temperature=float(options.get("--mtp-draft-temperature", 1.0)))
    assert sorted(expected) == sorted(t for t in COMPARED if t in runs["single micro-batch"])
    for name, measured in runs.items():
        for tag, value in expected.items():
            assert close(measured[tag][1], value, rel=2e-6), (
                f"{name}, {tag}, step 1: {measured[tag][1]!r}, the spec's objective gives {value!r}")
    single = runs.pop("single micro-batch")
    for name, measured in runs.items():
        for tag in expected:
            for step in (2, 3):
                assert close(measured[tag][step], single[tag][step]), (
                    f"{name}, {tag}, step {step}: {measured[tag][step]!r} vs single micro-batch "
                    f"{single[tag][step]!r}")


# ---------------------------------------------------------------- bit-exact resume

RESUME = TINY + ("--train-iters", "6", "--save-interval", "3", "--lr", "1e-3", "--hidden-dropout", "0.1",
                 "--attention-dropout", "0.1", "--eod-mask-loss")
RESUME_CASES = {
    "dp2-distributed-optimizer-distinct-attached": (2, ("--use-distributed-optimizer", "--mtp-num-layers", "2")),
    "tp2-repeated-isolated": (2, ("--tensor-model-parallel-size", "2", "--mtp-num-layers", "3",
                                  "--mtp-use-repeated-layer", "--mtp-detach-heads")),
    "pp2-vpp2-distinct-isolated": (2, ("--pipeline-model-parallel-size", "2", "--num-layers", "4",
                                       "--num-virtual-stages-per-pipeline-rank", "2", "--mtp-num-layers", "1",
                                       "--mtp-detach-heads", "--micro-batch-size", "1")),
    "cp2-distinct-attached": (2, ("--context-parallel-size", "2", "--mtp-num-layers", "2")),
    # The architectures MTP models use (issue 27): DeepSeek-V3's (MLA with q-/kv-LoRA and YaRN, q/k
    # RMSNorm, MoE behind a dense first layer, experts over 2 ranks) and Qwen3-Next's (Gated DeltaNet
    # and gated attention with TP = 2, which splits both).
    "deepseek-v3-mla-moe-ep2-isolated": (2, (
        "--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16",
        "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--qk-layernorm", "--normalization", "RMSNorm",
        "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-layer-freq", "[0,1]",
        "--disable-bias-linear", "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-2",
        "--expert-model-parallel-size", "2", "--mtp-num-layers", "2", "--mtp-detach-heads")),
    "qwen3-next-gated-deltanet-tp2-attached": (2, (
        "--hybrid-layer-pattern", "G-*-/*-", "--swiglu", "--normalization", "RMSNorm", "--attention-output-gate",
        "--linear-num-key-heads", "2", "--linear-num-value-heads", "4", "--linear-key-head-dim", "16",
        "--linear-value-head-dim", "16", "--linear-conv-kernel-dim", "4", "--tensor-model-parallel-size", "2")),
    # the same layers as a GPTModel (its norms saved under Transformer Engine's fused names), PP = 2
    "qwen3-next-gpt-gated-deltanet-pp2-isolated": (2, (
        "--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "2", "--swiglu",
        "--normalization", "RMSNorm", "--attention-output-gate", "--qk-layernorm", "--apply-layernorm-1p",
        "--linear-num-key-heads", "2", "--linear-num-value-heads", "4", "--linear-key-head-dim", "16",
        "--linear-value-head-dim", "16", "--linear-conv-kernel-dim", "4", "--pipeline-model-parallel-size", "2",
        "--mtp-num-layers", "2", "--mtp-detach-heads")),
}


@pytest.mark.parametrize("case", [pytest.param(case, marks=() if case == "pp2-vpp2-distinct-isolated"
                                                     else pytest.mark.matrix)
                                  for case in RESUME_CASES])  # the default tier: interleaved PP
def test_a_resumed_run_repeats_the_uninterrupted_run_bit_for_bit(case, dataset, tmp_path):
    nproc, args = RESUME_CASES[case]
    common = (*RESUME, "--data-path", str(dataset), *args)
    whole, whole_scalars = trained(nproc, *common, "--save", str(tmp_path / "whole"), tmp_path=tmp_path,
                                   name="whole")
    resumed, resumed_scalars = trained(nproc, *common, "--load", str(tmp_path / "whole"), "--ckpt-step", "3",
                                       "--save", str(tmp_path / "resumed"), tmp_path=tmp_path, name="resumed")

    assert sorted(resumed.iterations) == [4, 5, 6], resumed.tail()
    for step in (4, 5, 6):
        assert untimed(resumed.iterations[step]) == untimed(whole.iterations[step]), step
    tags = [t for t in whole_scalars if not t.startswith(TIMING)]
    assert any("(cumulative)" in t for t in tags), tags  # counters that span steps
    for tag in tags:  # "x vs samples" tags count consumed samples, the others iterations
        steps = resumed_scalars[tag].keys()
        assert steps and min(steps) > (3 * 8 if tag.endswith("vs samples") else 3), (tag, steps)
        assert resumed_scalars[tag] == {step: whole_scalars[tag][step] for step in steps}, tag

    final, again = checkpoint_tensors(tmp_path / "whole" / "iter_0000006"), \
        checkpoint_tensors(tmp_path / "resumed" / "iter_0000006")
    assert final.keys() == again.keys()
    different = [key for key in final if not final[key].equal(again[key])]
    assert not different, different[:5]
    assert any(key.startswith("optimizer") for key in final), list(final)[:5]


def test_a_checkpoint_saved_with_context_parallelism_trains_on_without_it(dataset, tmp_path):
    """Saved at CP = 2 (iteration 3 of 6), loaded on one rank without CP: iterations 4-6 give the
    losses and gradient norms of the CP = 2 run that went on (rel 2e-5: the sums run in another
    order; dropout off, as the random streams of two ranks cannot be one rank's)."""
    common = (*RESUME, "--data-path", str(dataset), "--mtp-num-layers", "2", "--hidden-dropout", "0",
              "--attention-dropout", "0")
    whole, whole_scalars = trained(2, *common, "--context-parallel-size", "2", "--save", str(tmp_path / "cp2"),
                                   tmp_path=tmp_path, name="cp2")
    resumed, resumed_scalars = trained(1, *common, "--load", str(tmp_path / "cp2"), "--ckpt-step", "3",
                                       "--save", str(tmp_path / "cp1"), tmp_path=tmp_path, name="cp1")
    assert sorted(resumed.iterations) == [4, 5, 6], resumed.tail()
    for tag in ("lm loss", "mtp_1 loss", "mtp_2 loss", "grad-norm"):
        for step in (4, 5, 6):
            assert close(resumed_scalars[tag][step], whole_scalars[tag][step]), (tag, step)
