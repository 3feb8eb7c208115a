# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The README's main command and the example scripts, run as a user runs them.

CPU scripts train (shortened by their pass-through arguments); the GPU scripts run to
the end of argument checking (--dry-run) on this CPU machine: their Transformer Engine
and bf16 configuration, parallel layout and data are validated by Megatron-LM and by
pretrain_gpt_mtp.py, nothing is built.
"""

import os
import subprocess
import sys

import pytest

from tests.harness.corpora import paragraphs, preprocess, write_jsonl
from tests.harness.launcher import REPO_ROOT, free_port
from tests.harness.trainer import parse, train

pytestmark = pytest.mark.slow
CONFIGS = ("deepseek_v3_d1", "repeated_d3", "draft_heads_frozen_backbone")


def bash(script: str, *args: str, env: dict, timeout: float = 300, check: bool = True) -> str:
    environment = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", **env)
    result = subprocess.run(["bash", script, *args], cwd=REPO_ROOT, env=environment, capture_output=True,
                            text=True, timeout=timeout, start_new_session=True)
    output = result.stdout + result.stderr
    assert (result.returncode == 0) == check, output[-4000:]
    return output


@pytest.mark.matrix  # the default tier runs the main command as a user (test_rerun), resumed and rerun
def test_the_readme_main_command_trains_on_the_embedded_default(tmp_path):
    """`torchrun --nproc-per-node 2 pretrain_gpt_mtp.py`, shortened: the embedded corpus is
    written from scratch (by both ranks at once), trained on with D = 2, evaluated, saved.
    Its workers are fresh interpreters, as under a user's torchrun."""
    run = train(2, "--train-iters", "20", "--eval-interval", "10", "--save-interval", "10", "--log-interval", "5",
                "--save", str(tmp_path / "run"), env={"MEGATRON_MTP_CACHE": str(tmp_path / "cache")}, fresh=True)
    assert "python-reference-topics" in run.output
    assert sorted(run.iterations) == [1, 5, 10, 15, 20]
    assert {"mtp_1 acceptance", "mtp_2 chain acceptance", "expected accepted length (incl. bonus token)"} \
        <= set(run.iterations[20])
    assert "mtp_2 loss" in run.validations[20]
    assert (tmp_path / "run" / "latest_checkpointed_iteration.txt").read_text() == "20"


# The script's own model, made smaller and shorter by its pass-through arguments (time); its
# warmup is its own (a tenth of whatever --train-iters).
SHORTER = ("--num-layers", "2", "--hidden-size", "64", "--seq-length", "64", "--max-position-embeddings", "64",
           "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4",
           "--eval-interval", "2", "--eval-iters", "1", "--save-interval", "2", "--log-interval", "1")


def quickstart(config: str, work, *args: str, **env) -> dict:
    output = bash("examples/cpu_quickstart.sh", *SHORTER, *args,
                  env={"WORK": str(work), "CONFIG": f"examples/configs/{config}.sh", **env})
    iterations, validations = parse(output)
    assert sorted(iterations) == [1, 2, 3, 4] and sorted(validations) == [2, 4], output[-3000:]
    return iterations


def test_cpu_quickstart(tmp_path):
    d1 = quickstart("deepseek_v3_d1", tmp_path / "d1")
    assert "mtp_1 loss" in d1[4] and "mtp_2 loss" not in d1[4]

    # another config in the same WORK: refused before anything is built, naming the way out
    output = bash("examples/cpu_quickstart.sh", *SHORTER, check=False,
                  env={"WORK": str(tmp_path / "d1"), "CONFIG": "examples/configs/repeated_d3.sh"})
    (error,) = [line for line in output.splitlines() if "pretrain_gpt_mtp.py: error: " in line]
    assert "mtp_num_layers: checkpoint 1, model 3" in error, error
    assert error.endswith(f"Or give this run another --save: its --load is its --save, "
                          f"{tmp_path / 'd1' / 'checkpoints'}")


@pytest.mark.matrix  # the default tier trains draft heads on a frozen backbone in test_serving's pipeline
def test_cpu_quickstart_then_draft_heads_on_its_backbone(tmp_path):
    d1 = quickstart("deepseek_v3_d1", tmp_path / "d1")
    assert "mtp_1 loss" in d1[4] and "mtp_2 loss" not in d1[4]

    # Draft heads on the D = 1 run's backbone: the backbone is frozen (no main gradient), the
    # heads train (they were one depth, now two: the second starts from its initialization).
    frozen = quickstart("draft_heads_frozen_backbone", tmp_path / "frozen",
                        BACKBONE=str(tmp_path / "d1" / "checkpoints"))
    assert all(frozen[i]["grad norm"] == 0 and frozen[i]["mtp grad norm"] > 0 for i in frozen), frozen
    assert "mtp_2 loss" in frozen[4]


# the default tier: Qwen3-Next's (DeepSeek-V3's MLA + MoE: test_architectures' reference and build checks)
@pytest.mark.parametrize("config", [pytest.param("deepseek_v3_tiny", marks=pytest.mark.matrix), "qwen3_next_tiny"])
def test_cpu_quickstart_with_the_architectures_of_mtp_models(config, tmp_path):
    """DeepSeek-V3 (MLA + MoE behind a dense layer + MTP) and Qwen3-Next (Gated DeltaNet, gated
    attention, MoE + MTP, as a HybridModel) train on CPU from their example configs."""
    iterations = quickstart(config, tmp_path / config, "--num-layers", "4")  # DeepSeek's dense first of four
    assert "mtp_1 loss" in iterations[4], iterations[4]
    assert any(name.endswith("load_balancing_loss") and value > 0 for name, value in iterations[4].items())


@pytest.mark.matrix
def test_cpu_quickstart_with_a_repeated_layer(tmp_path):
    repeated = quickstart("repeated_d3", tmp_path / "repeated")
    assert "mtp_3 chain acceptance" in repeated[4]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    return preprocess(write_jsonl(root / "paragraphs.jsonl", paragraphs(200)), root / "paragraphs")


@pytest.mark.parametrize("script,config,extra", [
    # the default tier: the MoE config (EP, grouped GEMM checked on the GPUs)
    ("examples/gpu_single_node.sh", "deepseek_v3_moe_gpu", {"EP": "2"}),
    pytest.param("examples/gpu_multi_node.sh", "draft_heads_frozen_backbone",
                 {"NNODES": "1", "MASTER_ADDR": "127.0.0.1"}, marks=pytest.mark.matrix),
    pytest.param("examples/gpu_single_node.sh", "deepseek_v3_d1", {}, marks=pytest.mark.matrix),
    pytest.param("examples/gpu_single_node.sh", "repeated_d3", {"TP": "2"}, marks=pytest.mark.matrix),
    # the architectures' configs (issue 27): MLA without the script's GQA; the hybrid pattern's own layers
    pytest.param("examples/gpu_single_node.sh", "deepseek_v3_tiny", {}, marks=pytest.mark.matrix),
    pytest.param("examples/gpu_single_node.sh", "qwen3_next_tiny", {}, marks=pytest.mark.matrix),
])
def test_gpu_scripts_pass_every_argument_check(script, config, extra, dataset, tmp_path):
    output = bash(script, "--dry-run", env={"DATA": str(dataset), "SAVE": str(tmp_path / "run"), "GPUS_PER_NODE": "2",
                                            "CONFIG": f"examples/configs/{config}.sh",
                                            "MASTER_PORT": str(free_port()), **extra})
    (summary,) = [line.split("]:", 1)[-1] for line in output.splitlines() if "arguments OK" in line]
    layers = "HybridModel 'GEGEGE*E/*E', 8 layers" if config == "qwen3_next_tiny" else "24 layers"
    assert "transformer_engine layers, bf16" in summary and f"{layers}, hidden 2048" in summary, summary
    assert f"TP {extra.get('TP', '1')}" in summary
    # the script's grouped-query attention unless the config's is multi-latent (gpu_args.sh)
    assert ("(multi-latent attention)" if config == "deepseek_v3_tiny" else "(grouped-query attention, 4 groups)") \
        in summary, summary
    if "EP" in extra:
        assert f"64 experts (top-8, grouped GEMM), EP {extra['EP']}" in summary, summary
    assert not (tmp_path / "run").exists()  # a dry run writes nothing: no TensorBoard events under --save


@pytest.mark.parametrize("nvidia_smi", [None, "echo 'NVIDIA-SMI has failed because it could not communicate with "
                                                "the NVIDIA driver.'; exit 9"], ids=["absent", "no driver"])
@pytest.mark.parametrize("script", ["examples/gpu_single_node.sh", "examples/gpu_multi_node.sh"])
def test_gpu_scripts_without_a_gpu_name_gpus_per_node_in_one_line(script, nvidia_smi, tmp_path):
    """A login node (no nvidia-smi, or one that sees no GPU) and no GPUS_PER_NODE: one line, before torchrun."""
    if nvidia_smi is not None:
        (tmp_path / "nvidia-smi").write_text(f"#!/bin/bash\n{nvidia_smi}\n")
        (tmp_path / "nvidia-smi").chmod(0o755)
    environment = {key: value for key, value in os.environ.items() if key != "GPUS_PER_NODE"}
    environment.update(PATH=f"{tmp_path}:/usr/bin:/bin", PYTHON=sys.executable, DATA="data/corpus_text_document",
                       NNODES="2", MASTER_ADDR="127.0.0.1")
    result = subprocess.run(["bash", script, "--dry-run"], cwd=REPO_ROOT, env=environment, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and result.stdout == "", (result.returncode, result.stdout, result.stderr[-2000:])
    assert result.stderr == ("no GPU found here (nvidia-smi lists none): set GPUS_PER_NODE to the GPUs of each node "
                             "the run is for (a --dry-run on a login node checks the arguments for that many)\n")


def test_only_a_dry_run_checks_cuda_only_moe_flags_for_the_gpus_it_targets():
    """The MoE GPU config's dry run passes here as for its GPUs; a CPU run of it is still refused."""
    from types import SimpleNamespace

    import torch

    from megatron_mtp import moe_arguments

    if torch.cuda.is_available():
        pytest.skip("checks the refusal on a machine without CUDA")
    assert moe_arguments.targets_cuda(SimpleNamespace(dry_run=True, transformer_impl="transformer_engine"))
    assert not moe_arguments.targets_cuda(SimpleNamespace(dry_run=False, transformer_impl="transformer_engine"))
    assert not moe_arguments.targets_cuda(SimpleNamespace(dry_run=True, transformer_impl="local"))
