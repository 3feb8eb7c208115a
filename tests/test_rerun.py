# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Nothing lost when the main command runs again (issue 16).

The README's main command, `torchrun --nproc-per-node 2 pretrain_gpt_mtp.py`, run as a
user runs it: from a directory of their own, no --save (checkpoints go to runs/default),
shortened. Run again, it resumes there: a finished run says so in one line, exits 0 and
writes nothing; the line's way to train on works. A quick experiment with other model
flags and no --save is refused before anything is built, naming --load and another
--save, and leaves runs/default as it was. (A --save directory holding checkpoints a run
does not load, with data of one's own, is refused in tests/test_trainer_faults.py.)
The first run (fresh interpreters, as a user's) prints each upstream warning once and writes
its TensorBoard events and its console log into runs/default, which tools/plot_runs.py draws.
"""

import re
import subprocess
import sys
from collections import Counter

import pytest

from tests.harness.launcher import REPO_ROOT
from tests.harness.trainer import train

pytestmark = pytest.mark.slow

SCRIPT = str(REPO_ROOT / "pretrain_gpt_mtp.py")
SHORT = ("--save-interval", "2", "--eval-interval", "2", "--eval-iters", "1", "--log-interval", "1")


def files(directory) -> dict:
    return {str(p.relative_to(directory)): (p.stat().st_mtime_ns, p.stat().st_size)
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_the_main_command_run_again_resumes_and_overwrites_nothing(tmp_path):
    runs = tmp_path / "runs" / "default"
    first = train(2, "--train-iters", "4", *SHORT, cwd=tmp_path, script=SCRIPT, fresh=True)
    assert sorted(first.iterations) == [1, 2, 3, 4], first.tail()
    assert (runs / "latest_checkpointed_iteration.txt").read_text() == "4"
    warned = Counter(re.sub(r"^\[default\d+\]:", "", line) for line in first.output.splitlines() if "Warning: " in line)
    assert warned and max(warned.values()) == 1, warned.most_common(3)
    assert list((runs / "tensorboard").glob("events.out.tfevents.*")), sorted(runs.rglob("*"))
    assert "iteration        4/       4" in (runs / "train.log").read_text()
    drawn = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "plot_runs.py"), "runs/default", "-o",
                            str(tmp_path / "curves.svg"), "--table"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=120)
    assert drawn.returncode == 0 and "| default | 4 |" in drawn.stdout, drawn.stderr
    saved = files(runs)

    again = train(2, "--train-iters", "4", *SHORT, cwd=tmp_path, script=SCRIPT)
    finished = [line for line in again.output.splitlines() if "holds a finished run" in line]
    assert len(finished) == 1 and not again.iterations, again.tail()
    assert "runs/default holds a finished run (iteration 4 of --train-iters 4)" in finished[0]
    assert "--train-iters N above 4 with --use-checkpoint-opt_param-scheduler" in finished[0]
    assert files(runs) == saved

    on = train(2, "--train-iters", "6", "--use-checkpoint-opt_param-scheduler", *SHORT, cwd=tmp_path,
               script=SCRIPT)
    assert sorted(on.iterations) == [5, 6], on.tail()
    assert (runs / "latest_checkpointed_iteration.txt").read_text() == "6"
    saved = files(runs)

    other = train(2, "--num-layers", "2", "--hidden-size", "64", "--bf16", "--train-iters", "4", *SHORT,
                  cwd=tmp_path, script=SCRIPT, check=False)
    assert other.returncode != 0
    (error,) = other.errors()
    assert "--save runs/default holds checkpoints of another model" in error, error
    assert "hidden_size: checkpoint 128, this run 64" in error and "num_layers: checkpoint 4, this run 2" in error
    assert "give another --save" in error and "--load runs/default" in error, error
    assert "[rank" not in other.output and "number of parameters" not in other.output
    assert files(runs) == saved
