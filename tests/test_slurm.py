# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The SLURM example scripts against a real Slurm controller and node on this machine.

The multi-node script (srun, one torchrun per node, c10d rendezvous; one node here) runs a
CPU training with a 2-minute time limit and its pre-timeout signal 90 s before the limit.
The job must be signalled, checkpoint, requeue itself, resume from that checkpoint and
finish (after one or more such rounds); its final checkpoint (every model and optimizer tensor) and its TensorBoard
scalars must equal those of the same training run uninterrupted. The single-node script
runs a short training to completion without a requeue.

Both are submitted as shipped (their own --output) from a fresh clone's files: the tracked
files only, so nothing the repository ignores (runs/, say) is there to help.
"""

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness.launcher import REPO_ROOT, free_port
from tests.harness.slurm import LocalSlurm
from tests.harness.trainer import TINY, checkpoint_tensors, scalars, train

pytestmark = pytest.mark.slow

# Slurm checks time limits on a 30-s timer and may signal up to 60 s early, so with
# --time=2 --signal=B:USR1@90 every allocation is signalled at its first check, 0-30 s in
# (after ~8 s of start-up). The run must not finish before that: 400 iterations (55 ms each
# measured on a quiet host, 22 s) once did, and the job then ended without the signal
# reaching the training loop. 700 (38 s) would need iterations under 31 ms.
ITERATIONS = 700


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm")).start()
    yield cluster
    cluster.stop()


def training_arguments(dataset, save: Path, iterations: int) -> tuple[str, ...]:
    return (*TINY, "--lr", "1e-3", "--train-iters", str(iterations), "--mtp-num-layers", "2", "--data-path",
            str(dataset), "--save", str(save), "--load", str(save), "--save-interval", "100000", "--log-interval",
            "50", "--tensorboard-dir", str(save / "tensorboard"))


def fresh_clone(tmp_path: Path) -> Path:
    """A directory holding what a clone holds: each tracked top-level entry, linked."""
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    clone = tmp_path / "clone"
    clone.mkdir()
    for name in sorted({line.split("/")[0] for line in tracked.splitlines()}):
        (clone / name).symlink_to(REPO_ROOT / name)
    return clone


def submit(slurm, script: str, arguments: tuple[str, ...], tmp_path: Path, *options: str) -> tuple[str, Path]:
    """Submit `script` from a fresh clone; (the job id, the log the script's #SBATCH --output names)."""
    args_file = tmp_path / "train_args.sh"
    args_file.write_text("TRAIN_ARGS=(" + " ".join(f"'{a}'" for a in arguments) + ")\n")
    environment = dict(slurm.environment, ARGS_FILE=str(args_file), GPUS_PER_NODE="2", PYTHON=sys.executable,
                       RDZV_PORT=str(free_port()), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    clone = fresh_clone(tmp_path)
    result = slurm.run("sbatch", "--parsable", "--gpus-per-node=0", *options, script, cwd=clone, env=environment)
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.strip().split(";")[0]
    output = re.search(r"^#SBATCH --output=(\S+)$", (REPO_ROOT / script).read_text(), re.MULTILINE)
    return job_id, clone / (output.group(1) if output else "slurm-%j.out").replace("%j", job_id)


def wait_until_done(slurm, job_id: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = slurm.job(job_id)
        if job.get("JobState") in ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "NODE_FAIL", "OUT_OF_MEMORY"):
            return job
        time.sleep(2)
    slurm.run("scancel", job_id)
    raise AssertionError(f"job {job_id} not done after {timeout}s: {slurm.job(job_id)}\n{slurm.logs()}")


@pytest.mark.matrix  # Slurm's 30-s timer makes it 1.5-15 minutes; the default tier runs the single-node script
def test_the_time_limit_checkpoints_requeues_and_resumes_exactly(slurm, dataset, tmp_path):
    save = tmp_path / "job"
    job_id, log = submit(slurm, "examples/slurm/pretrain_gpt_mtp_multinode.sbatch",
                    training_arguments(dataset, save, ITERATIONS), tmp_path,
                    "--nodes=1", "--time=2", "--signal=B:USR1@90")
    # Each restart trains for what is left of its 30 s once torchrun has started (fresh
    # interpreters): 12 restarts and 8 minutes on a quiet host; a busy one needs more.
    job = wait_until_done(slurm, job_id, timeout=900)
    output = log.read_text(errors="replace") if log.is_file() else f"no log at {log}"
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", (job, output[-3000:])
    assert int(job["Restarts"]) >= 1, output[-3000:]
    assert "pre-timeout signal: saving and stopping" in output and "requeueing job" in output
    assert "exiting program after receiving SIGTERM" in output  # upstream's words for the exit signal
    assert f"job {job_id} (restart 1)" in output
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERATIONS)

    whole = tmp_path / "whole"
    train(2, *training_arguments(dataset, whole, ITERATIONS))
    final, again = (checkpoint_tensors(d / f"iter_{ITERATIONS:07d}") for d in (whole, save))
    different = [key for key in final if not final[key].equal(again[key])]
    assert final.keys() == again.keys() and not different, different[:5]
    expected, measured = scalars(whole / "tensorboard"), scalars(save / "tensorboard")
    for tag in ("lm loss", "mtp_1 loss", "mtp_2 acceptance", "grad-norm"):
        assert measured[tag] == expected[tag], tag


def test_the_single_node_script_runs_to_the_end(slurm, dataset, tmp_path):
    save = tmp_path / "job"
    job_id, log = submit(slurm, "examples/slurm/pretrain_gpt_mtp.sbatch", training_arguments(dataset, save, 20),
                    tmp_path, "--time=15")  # the pre-timeout signal (300 s before the limit) never comes
    job = wait_until_done(slurm, job_id, timeout=300)
    output = log.read_text(errors="replace") if log.is_file() else f"no log at {log}"
    assert job["JobState"] == "COMPLETED" and int(job["Restarts"]) == 0, (job, output[-3000:])
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "20"
