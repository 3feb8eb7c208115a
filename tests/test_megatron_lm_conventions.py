# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""pretrain_gpt_mtp.py behaves as Megatron-LM's pretrain_gpt.py where users rely on it (issue 16).

- The loss function's checks: this rank's raw loss sum goes through megatron-core's rerun
  state machine before any reduction, as pretrain_gpt.py's loss_func does: a NaN loss is
  caught at the loss (not later, by the gradient check), and --check-for-spiky-loss flags
  a loss 10 times the largest of the first 100.
- CPU defaults only where no GPU exists: a machine with NVIDIA devices whose CUDA is
  unusable (a driver problem, a CPU-only torch) is refused in one line, unless the run
  hides its GPUs on purpose (CUDA_VISIBLE_DEVICES=).
- On GPUs, Megatron-LM's defaults where Transformer Engine and apex are installed; without them,
  what runs without them (local layers, unfused RoPE and weight-gradient accumulation: upstream's
  defaults raise there at the first layer built or the first forward), and
  `--transformer-impl transformer_engine` without Transformer Engine refused in one line.
- Pipeline layouts upstream accepts: MTP on a stage of its own (`m` in
  --pipeline-model-parallel-layout) and uneven splits train; an even split that does not
  divide is refused in one line with upstream's own reason.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from tests.harness import argument_cases
from tests.harness.launcher import REPO_ROOT
from tests.harness.trainer import TINY, train

MOCK = ("--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "300")


def python(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter on the installed (current) build, from the repository root."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))


# ---------------------------------------------------------------- the loss function's checks

LOSS_CHECKS = """
    import argparse, logging, sys
    import torch
    sys.argv = ["pretrain_gpt_mtp.py"]
    import pretrain_gpt_mtp
    from megatron.core.rerun_state_machine import RerunMode, initialize_rerun_state_machine
    from megatron.training.global_vars import set_args

    warnings = []
    class Keep(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())
    logging.getLogger("megatron.core.rerun_state_machine").addHandler(Keep())
    initialize_rerun_state_machine(mode=RerunMode.DISABLED)
    mask = torch.ones(2, 8)
    def loss(value, spiky):
        set_args(argparse.Namespace(check_for_nan_in_loss_and_grad=True, check_for_spiky_loss=spiky))
        return pretrain_gpt_mtp.loss_func(mask, torch.full((2, 8), value))
    for spiky in (False, True):
        for step in range(100):
            loss(1.0 + step / 100, spiky)
        del warnings[:]
        loss(30.0, spiky)  # 30 x 16 tokens: over 10 x the largest sum seen (2 x 16)
        print("spiky", spiky, any("Spiky loss" in w for w in warnings))
    for bad in ("nan", "inf"):
        try:
            loss(float(bad), False)
            print("accepted", bad)
        except RuntimeError as error:
            print("refused", bad, error)
"""


def test_the_loss_function_checks_nan_inf_and_spiky_loss_through_the_rerun_state_machine():
    result = python(LOSS_CHECKS)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert "spiky False False" in lines and "spiky True True" in lines, lines
    refused = [line for line in lines if line.startswith("refused")]
    assert len(refused) == 2, lines
    assert "found NaN in local forward loss calculation" in refused[0], refused
    assert "found Inf in local forward loss calculation" in refused[1], refused


@pytest.mark.slow
@pytest.mark.matrix  # the check itself in the default tier: the rerun state machine's test above
def test_a_nan_loss_is_caught_at_the_loss(tmp_path):
    """An absurd learning rate makes step 2's weights non-finite: the loss check finds the NaN
    before any gradient exists; upstream's rerun state machine reruns the step, finds it
    reproducible, saves the last good iteration and exits with its status 16; without --save it
    exits so too."""
    run = train(1, *TINY, *MOCK, "--lr", "1e35", "--train-iters", "4", "--mtp-num-layers", "1",
                "--save", str(tmp_path / "run"), "--save-interval", "100", check=False)
    assert run.returncode != 0 and "exitcode  : 16" in run.output, run.tail()
    assert "(message='found NaN in local forward loss calculation')" in run.output, run.tail()
    assert (tmp_path / "run" / "latest_checkpointed_iteration.txt").read_text() == "1"

    # Without --save there is nothing to write: the run exits with the same status (upstream's
    # loop saved to no directory and died in a TypeError, status 1).
    unsaved = train(1, *TINY, *MOCK, "--lr", "1e35", "--train-iters", "4", "--mtp-num-layers", "1", check=False)
    assert unsaved.returncode != 0 and "exitcode  : 16" in unsaved.output, unsaved.tail()
    assert "TypeError" not in unsaved.output, unsaved.tail()


# ---------------------------------------------------------------- CPU defaults only without GPUs

UNUSABLE_CUDA = """
    import contextlib, io, os, sys
    from megatron_mtp import arguments
    from megatron_mtp.arguments import gpus
    devices = {"none": [], "gpus": ["/dev/nvidia0", "/dev/nvidia1"]}
    for name, visible in (("none", None), ("gpus", None), ("gpus", ""), ("gpus", "-1")):
        gpus.nvidia_devices = lambda: devices[name]  # the probe: what the kernel driver exposes
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        if visible is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
        sys.argv = ["pretrain_gpt_mtp.py", "--dry-run", *ARGS]
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            accepted = arguments.parse() is not None
        from megatron.training.global_vars import unset_global_variables
        unset_global_variables()
        errors = [line for line in stderr.getvalue().splitlines() if line.startswith("pretrain_gpt_mtp.py: error")]
        print(name, repr(visible), accepted, errors)
"""


@pytest.mark.matrix  # a GPU machine's fault; the default tier's faults: test_trainer_faults
def test_a_machine_with_nvidia_gpus_but_unusable_cuda_is_refused_in_one_line():
    args = [*TINY, *MOCK, "--lr", "1e-3", "--train-iters", "2"]
    result = python(f"ARGS = {args!r}\n" + textwrap.dedent(UNUSABLE_CUDA))
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith(("none", "gpus"))]
    assert lines[0] == "none None True []", lines  # no GPU: the CPU defaults
    refused = lines[1]
    assert refused.startswith("gpus None False ['pretrain_gpt_mtp.py: error: this machine has NVIDIA GPUs "
                              "(/dev/nvidia0, /dev/nvidia1) but CUDA is unusable: "), refused
    assert "CPU-only build" in refused and "set CUDA_VISIBLE_DEVICES= to train on the CPU on purpose" in refused
    assert lines[2:] == ["gpus '' True []", "gpus '-1' True []"], lines  # GPUs hidden on purpose


GPU_DEFAULTS = """
    import contextlib, io, sys
    from types import SimpleNamespace
    from megatron_mtp import arguments
    from megatron_mtp.arguments import checks, errors, gpus
    from megatron_mtp.arguments import defaults as run_defaults
    for installed in ((), ("transformer_engine",), ("transformer_engine", "fused_weight_gradient_mlp_cuda",
                                                    "fast_layer_norm")):
        gpus.missing = lambda module: module not in installed
        defaults = run_defaults.initial(on_cpu=False, embedded=False)
        print("gpu", len(installed), {key: defaults.get(key) for key in
              ("transformer_impl", "apply_rope_fusion", "gradient_accumulation_fusion", "distributed_backend")})
        print("norms", len(installed), [run_defaults.uses_torch_norms(SimpleNamespace(transformer_impl=impl,
                                                                                      normalization=norm))
                                        for impl in ("local", "transformer_engine")
                                        for norm in ("LayerNorm", "RMSNorm")])
    for on_gpu, pattern, variant, dry_run in ((True, "G*", None, False), (True, None, "gated_delta_net", False),
                                              (False, "G*", None, False), (True, "G*", None, True),
                                              (True, "**", None, False)):
        args = SimpleNamespace(hybrid_layer_pattern=pattern, experimental_attention_variant=variant, dry_run=dry_run)
        try:
            checks.check_gated_delta_net_kernels(args, on_gpu)
            print("gdn", on_gpu, pattern, variant, dry_run, "accepted")
        except errors.ArgumentError as error:
            print("gdn", on_gpu, pattern, variant, dry_run, "refused", "flash-linear-attention" in str(error))
    gpus.missing = lambda module: True  # as on this machine, where a run asks for TE
    sys.argv = ["pretrain_gpt_mtp.py", *ARGS, "--transformer-impl", "transformer_engine"]
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        accepted = arguments.parse() is not None
    print("te", accepted, [line for line in stderr.getvalue().splitlines() if line.startswith("pretrain_gpt_mtp")])
"""


def test_gpu_defaults_follow_what_is_installed_and_what_is_missing_is_refused():
    args = [*TINY, *MOCK, "--lr", "1e-3", "--train-iters", "2"]
    result = python(f"ARGS = {args!r}\n" + textwrap.dedent(GPU_DEFAULTS))
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith(("gpu", "norms", "te"))]
    # Gated DeltaNet on a GPU without flash-linear-attention (missing from this last probe): refused, pattern
    # or GPTModel variant; on CPU (the PyTorch kernels), in a dry run, or without GDN layers: accepted
    assert [line for line in result.stdout.splitlines() if line.startswith("gdn")] == [
        "gdn True G* None False refused True", "gdn True None gated_delta_net False refused True",
        "gdn False G* None False accepted", "gdn True G* None True accepted", "gdn True ** None False accepted"]
    assert lines[:6] == [
        "gpu 0 {'transformer_impl': 'local', 'apply_rope_fusion': False, 'gradient_accumulation_fusion': False, "
        "'distributed_backend': None}",
        "norms 0 [True, True, False, False]",
        # TE without apex: TE's layers, but the output layer's ColumnParallelLinear needs apex's fusion
        "gpu 1 {'transformer_impl': None, 'apply_rope_fusion': None, 'gradient_accumulation_fusion': False, "
        "'distributed_backend': None}",
        "norms 1 [True, True, False, False]",
        # Megatron-LM's own defaults where TE and apex are installed; apex persists LayerNorm, not RMSNorm
        "gpu 3 {'transformer_impl': None, 'apply_rope_fusion': None, 'gradient_accumulation_fusion': None, "
        "'distributed_backend': None}",
        "norms 3 [False, True, False, False]"], lines
    assert lines[6] == ("te False [\"pretrain_gpt_mtp.py: error: --transformer-impl transformer_engine needs "
                        "Transformer Engine, which is not installed (pip install -e '.[gpu]'), or --transformer-impl "
                        "local\"]"), lines


# ---------------------------------------------------------------- pipeline layouts

LAYOUT = (*MOCK, "--num-attention-heads", "4", "--hidden-size", "64", "--seq-length", "64",
          "--max-position-embeddings", "64", "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-3",
          "--train-iters", "2", "--mtp-num-layers", "1", "--log-interval", "1", "--eval-iters", "0",
          "--lr-warmup-iters", "0")
MTP_STAGE = ("--num-layers", "2", "--pipeline-model-parallel-size", "3", "--pipeline-model-parallel-layout",
             "Et*2|m|L")
UNEVEN = ("--num-layers", "5", "--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "2")


def test_pipeline_layouts_upstream_accepts_are_accepted_and_the_rest_refused_in_one_line():
    cases = [{"argv": [*LAYOUT, *MTP_STAGE], "env": {"WORLD_SIZE": "3", "RANK": "0"}},
             {"argv": [*LAYOUT, *UNEVEN], "env": {"WORLD_SIZE": "2", "RANK": "0"}},
             {"argv": [*LAYOUT, "--num-layers", "5", "--pipeline-model-parallel-size", "2"],
              "env": {"WORLD_SIZE": "2", "RANK": "0"}},
             # MTP on the first pipeline rank's last virtual stage: its embedding copies were not both reduced
             {"argv": [*LAYOUT, "--num-layers", "4", "--pipeline-model-parallel-size", "2",
                       "--pipeline-model-parallel-layout", "Et|t|t*2m|L"], "env": {"WORLD_SIZE": "2", "RANK": "0"}}]
    mtp_stage, uneven, refused, first_rank = argument_cases.check(cases, timeout=300)
    assert mtp_stage["accepted"] and uneven["accepted"], (mtp_stage, uneven)
    errors = refused["errors"]
    assert not refused["accepted"] and errors == [
        "pretrain_gpt_mtp.py: error: Number of layers should be divisible by the pipeline-model-parallel size"], refused
    errors = first_rank["errors"]
    assert not first_rank["accepted"] and len(errors) == 1, first_rank
    assert "first pipeline rank's last virtual stage" in errors[0], errors


@pytest.mark.slow
@pytest.mark.parametrize("nproc,layout", [
    # an MTP stage of its own in the default tier: test_mtp_layouts' pp4_vpp2_mtp_stage
    pytest.param(3, MTP_STAGE, id="mtp-stage", marks=pytest.mark.matrix),
    pytest.param(2, UNEVEN, id="uneven"),
])
def test_the_issue_s_layouts_train(nproc, layout):
    run = train(nproc, *LAYOUT, *layout)
    assert sorted(run.iterations) == [1, 2] and "mtp_1 loss" in run.iterations[2], run.tail()
