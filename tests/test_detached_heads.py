# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Detached MTP heads leave the backbone's training bit-identical to the same run without MTP
(issue 29, A), with Megatron's dropout on.

Three runs of pretrain_gpt_mtp.py from the same seed, dropout 0.1 (hidden and attention), untied
output weights (built after the MTP block, so an MTP initialization that drew from the backbone's
stream would move them), 4 micro-batches per step: no MTP, D = 2 detached, D = 2 attached. The
detached run logs the same lm loss and grad norm as the run without MTP at every iteration, bit
for bit, and its checkpoint holds the same backbone weights and optimizer moments, bit for bit.
The attached run differs (its heads' gradients reach the backbone), so the comparison can fail;
before the MTP streams (megatron.core.fork.mtp.rng), the detached run differed too, from the
first iteration (dropout masks drawn after an MTP forward, and the output layer's initial
weights).

Layouts: one rank (default tier); TP = 2, PP = 2 (the MTP depths and an embedding copy on the
last stage), DP = 2, MoE with EP = 2 and context parallelism CP = 2 (every sequence cut over
both ranks; the MTP targets rolled across them) (matrix tier).
"""

import pytest

from megatron_mtp.runs import read
from tests.harness.trainer import TINY, checkpoint_tensors, train

pytestmark = pytest.mark.slow

ITERATIONS = 3
COMMON = (*TINY, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--lr", "1e-3",
          "--train-iters", str(ITERATIONS), "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
          "--untie-embeddings-and-output-weights", "--save-interval", str(ITERATIONS))
RUNS = {"without MTP": (), "detached D=2": ("--mtp-num-layers", "2", "--mtp-detach-heads"),
        "attached D=2": ("--mtp-num-layers", "2")}
LAYOUTS = {
    "one_rank": (1, ()),
    "tp2": (2, ("--tensor-model-parallel-size", "2")),
    "pp2": (2, ("--pipeline-model-parallel-size", "2")),
    "dp2": (2, ()),
    # MoE layers (the MTP depth's too) with experts split over 2 ranks: the expert-parallel
    # RNG stream and the expert bias's token counts are the backbone's own as well.
    "ep2_moe": (2, ("--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
                    "--disable-bias-linear", "--moe-token-dispatcher-type", "alltoall", "--moe-aux-loss-coeff",
                    "1e-2", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                    "--expert-model-parallel-size", "2")),
    "cp2": (2, ("--context-parallel-size", "2")),
}


def backbone(tensors: dict) -> dict:
    """The checkpoint's tensors that are not the MTP block's (weights and optimizer moments)."""
    return {key: value for key, value in tensors.items() if ".mtp." not in f".{key}" and "rng" not in key}


@pytest.mark.parametrize("layout", [pytest.param(name, marks=() if name == "one_rank" else pytest.mark.matrix)
                                    for name in LAYOUTS])
def test_detached_heads_leave_the_backbone_bit_identical(layout, tmp_path):
    nproc, args = LAYOUTS[layout]
    check_bit_identical(tmp_path, nproc, args)


def check_bit_identical(tmp_path, nproc: int, args: tuple, env: dict | None = None) -> None:
    """The three runs of RUNS in this layout (`env`: tests/test_gpu.py's CUDA device), compared."""
    logged, saved = {}, {}
    for name, mtp in RUNS.items():
        root = tmp_path / name.replace(" ", "_").replace("=", "")
        train(nproc, *COMMON, *args, *mtp, "--save", str(root / "ckpt"), "--tensorboard-dir", str(root / "tb"),
              env=env)
        logged[name] = read(root / "tb").series
        saved[name] = backbone(checkpoint_tensors(root / "ckpt" / f"iter_{ITERATIONS:07d}"))
    without, detached, attached = (logged[name] for name in RUNS)
    for tag in ("lm loss", "grad norm"):
        assert sorted(without[tag]) == sorted(detached[tag]) == list(range(1, ITERATIONS + 1)), tag
        assert detached[tag] == without[tag], (tag, detached[tag], without[tag])
    assert "mtp grad norm" in detached and "mtp_2 loss" in detached  # the heads did train
    # tools/plot_runs.py's tokens axis from the trainer's own events: 8 sequences of 64 tokens a step.
    assert read(tmp_path / "detached_D2" / "tb").tokens == {step: step * 8 * 64 for step in range(1, ITERATIONS + 1)}

    reference = saved["without MTP"]
    weights = [key for key in reference if "optimizer" not in key]
    assert len(weights) >= 10 and any("optimizer" in key for key in reference), sorted(reference)[:20]
    assert sorted(saved["detached D=2"]) == sorted(reference)
    different = [key for key, value in reference.items() if not value.equal(saved["detached D=2"][key])]
    assert not different, different

    # Attached heads move the backbone: the same comparison fails for them.
    assert any(not value.equal(saved["attached D=2"][key]) for key, value in reference.items())
