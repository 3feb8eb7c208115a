# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""MTP heads added to a pretrained backbone (issue 17): pretrain_gpt_mtp.py --finetune --load a
checkpoint with fewer MTP depths than the run.

Two backbones of 2 iterations (D = 1 and D = 0), each fine-tuned with --mtp-num-layers 2 for 2
iterations, saved after each. --lr-warmup-iters 1 makes the first step's learning rate 0
(Megatron's warmup starts at --lr-warmup-init, 0), so the checkpoint of iteration 1 holds the
model exactly as loaded and initialized; the second step trains. The new depths' tensors are not
in the checkpoint: the launcher loads with --dist-ckpt-strictness log_all when --finetune adds
depths (no flag needed; before, the load died in a KeyError per rank), which lists them and
keeps their initialization.

Already covered elsewhere: tests/test_examples.py runs that config on a D = 1 quickstart run's
checkpoint (mtp_2 loss logged, backbone frozen); tests/test_trainer_faults.py refuses
--load of a D = 2 checkpoint into --mtp-num-layers 3 without --finetune (before anything is
built) and tests/test_foundation_training.py refuses other depth counts through the library.
Here: the tensors, bit for bit, and the refusal of this very load without --finetune.
"""


import pytest
import torch

from tests.harness import argument_cases
from tests.harness.trainer import TINY, checkpoint_tensors, train

pytestmark = pytest.mark.slow

RUN = TINY + ("--lr", "1e-3")
FINETUNE = ("--mtp-num-layers", "2", "--finetune", "--lr-warmup-iters", "1",
            "--train-iters", "2", "--save-interval", "1")
SAVED_DEPTHS = (1, 0)
NOT_MODEL = ("optimizer.", "rng_state", "rerun_state_machine", "common_state")


def model_tensors(directory) -> dict:
    return {name: tensor for name, tensor in checkpoint_tensors(directory).items()
            if not name.startswith(NOT_MODEL) and "_extra_state" not in name}


def layers(tensors: dict) -> list:
    return sorted({".".join(name.split(".")[:3]) for name in tensors if name.startswith("mtp.")})


# the corpus of the dataset fixture (tests/conftest.py)
CORPUS = "paragraphs"


@pytest.fixture(scope="module")
def backbones(dataset, tmp_path_factory):
    """Checkpoints of 2 iterations with D = 1 and D = 0 (one rank)."""
    root = tmp_path_factory.mktemp("backbones")
    for depths in SAVED_DEPTHS:
        train(1, *RUN, "--data-path", str(dataset), "--mtp-num-layers", str(depths), "--train-iters", "2",
              "--save", str(root / f"d{depths}"), "--save-interval", "2")
    return root


@pytest.fixture(scope="module")
def finetuned(dataset, backbones, tmp_path_factory):
    """saved depths -> (the fine-tuning run, the saved checkpoint's model tensors, the run's model
    tensors after iterations 1 and 2)."""
    root = tmp_path_factory.mktemp("finetuned")
    runs = {}
    for depths in SAVED_DEPTHS:
        save = root / f"from-d{depths}"
        run = train(1, *RUN, "--data-path", str(dataset), *FINETUNE, "--load", str(backbones / f"d{depths}"),
                    "--save", str(save))
        runs[depths] = (run, model_tensors(backbones / f"d{depths}" / "iter_0000002"),
                        {i: model_tensors(save / f"iter_{i:07d}") for i in (1, 2)})
    return runs


@pytest.mark.parametrize("saved", SAVED_DEPTHS, ids=[f"checkpoint_D{d}" for d in SAVED_DEPTHS])
def test_finetune_loads_the_backbone_and_saved_depths_bitwise_and_trains_new_depths(finetuned, saved):
    run, checkpoint, after = finetuned[saved]
    assert sorted(run.iterations) == [1, 2], run.tail()
    assert all(f"mtp_{k} loss" in run.iterations[i] for i in (1, 2) for k in (1, 2)), run.iterations
    assert all(torch.isfinite(torch.tensor(run.iterations[i]["lm loss"])) for i in (1, 2)), run.iterations
    assert layers(checkpoint) == [f"mtp.layers.{k}" for k in range(saved)]
    loaded, trained = after[1], after[2]
    assert layers(loaded) == layers(trained) == ["mtp.layers.0", "mtp.layers.1"]
    new = {name for name in loaded if name.startswith(tuple(f"mtp.layers.{k}." for k in range(saved, 2)))}
    assert new and set(loaded) == set(checkpoint) | new, sorted(set(loaded) ^ (set(checkpoint) | new))[:5]
    # the backbone and the saved depths as loaded (the first step's learning rate is 0), bit for bit
    assert checkpoint and all(name in loaded for name in checkpoint)
    differing = sorted(name for name in checkpoint if not torch.equal(checkpoint[name], loaded[name]))
    assert differing == [], differing[:5]
    # the second step trains all of it: the loaded tensors and the new depths
    unchanged = sorted(name for name in loaded if torch.equal(loaded[name], trained[name]))
    assert unchanged == [], unchanged[:5]


def test_new_depths_start_from_megatron_cores_initialization(finetuned):
    """The depth new to both runs (mtp.layers.1) starts bit-identical in both, whatever the checkpoint
    held (one seed, one model): norms at one, biases zero, weights at --init-method-std 0.02; the
    D = 0 run's depth 1 is initialized too, not the D = 1 checkpoint's."""
    _, with_depth, after_d1 = finetuned[1]
    _, _, after_d0 = finetuned[0]
    from_d1, from_d0 = after_d1[1], after_d0[1]
    new = sorted(name for name in from_d1 if name.startswith("mtp.layers.1."))
    assert new and all(torch.equal(from_d1[name], from_d0[name]) for name in new)
    for tensors in (from_d1, from_d0):
        norms = [name for name in new if "norm" in name and name.endswith("weight")]
        biases = [name for name in new if name.endswith("bias")]
        assert norms and all(torch.equal(tensors[n], torch.ones_like(tensors[n])) for n in norms), norms
        assert biases and all(not tensors[n].any() for n in biases), biases
        assert abs(float(tensors["mtp.layers.1.eh_proj.weight"].std()) - 0.02) < 0.002
    first = sorted(name for name in with_depth if name.startswith("mtp.layers.0."))
    assert first and all(not torch.equal(from_d0[name], with_depth[name]) for name in first
                         if not name.endswith("bias") and "norm" not in name)
    assert abs(float(from_d0["mtp.layers.0.eh_proj.weight"].std()) - 0.02) < 0.002


@pytest.mark.matrix  # the default tier's shape refusals: test_trainer_faults, test_architectures
def test_without_finetune_the_same_load_is_refused_in_one_line(dataset, backbones):
    """The fine-tuning command lines without --finetune: refused before anything is built, one line
    naming the depth difference; with --finetune the same arguments pass every check."""
    cases = []
    for depths in SAVED_DEPTHS:
        argv = [*RUN, "--data-path", str(dataset), *FINETUNE, "--load", str(backbones / f"d{depths}"),
                "--train-iters", "4"]
        cases += [{"argv": [a for a in argv if a != "--finetune"], "env": {"WORLD_SIZE": "1", "RANK": "0"}},
                  {"argv": argv, "env": {"WORLD_SIZE": "1", "RANK": "0"}}]
    outcomes = argument_cases.check(cases, timeout=600)
    for depths, (without, with_finetune) in zip(SAVED_DEPTHS, zip(outcomes[::2], outcomes[1::2])):
        errors = without["errors"]
        assert not without["accepted"] and len(errors) == 1, without
        assert f"mtp_num_layers: checkpoint {depths}, model 2" in errors[0], errors[0]
        assert not any("Traceback" in line for line in without["stderr"]), without
        assert with_finetune["accepted"], with_finetune
