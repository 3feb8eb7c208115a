"""pretrain_gpt_mtp.py runs under torchrun on CPU, learns, saves and loads a checkpoint."""

import os
import re
import signal
import subprocess
import sys

import pytest

from tests.harness.launcher import REPO_ROOT, free_port

pytestmark = pytest.mark.slow


def torchrun(nproc: int, *args: str, timeout: float = 300) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               f"--master-port={free_port()}", "pretrain_gpt_mtp.py", *args]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"torchrun timed out after {timeout}s:\n{output[-3000:]}")
    assert proc.returncode == 0, output[-5000:]
    return output


def losses(output: str) -> list[float]:
    return [float(x) for x in re.findall(r"lm loss (\d+\.\d+)", output)]


def test_trains_saves_and_resumes_with_tensor_parallelism(tmp_path):
    ckpt = tmp_path / "ckpt"
    common = ["--tensor-model-parallel-size", "2", "--mtp-num-layers", "2", "--log-interval", "1"]
    first = torchrun(2, *common, "--train-iters", "12", "--save", str(ckpt))
    first_losses = losses(first)
    assert len(first_losses) == 12
    assert first_losses[-1] < first_losses[0] - 0.5, first_losses  # it learns
    assert (ckpt / "metadata.json").is_file()
    assert not (tmp_path / "ckpt.partial").exists()

    resumed = losses(torchrun(2, *common, "--train-iters", "1", "--load", str(ckpt)))
    # The loaded model is the trained one, not a fresh initialization.
    assert resumed[0] < first_losses[0] - 0.5, (resumed, first_losses)
