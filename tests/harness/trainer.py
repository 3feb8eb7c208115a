# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Run pretrain_gpt_mtp.py as a user does (torchrun, CPU, gloo) and read what it leaves.

`train` starts torchrun in its own process group with a free port and a deadline, kills
every process of the launch on timeout (nothing is left behind) and returns the run: its
exit status, its output, the console's iteration and validation lines parsed into numbers.
For this checkout's scripts, torchrun itself and its workers are forked from a zygote that
has already imported torch and megatron (tests.harness.zygote: what the test and torchrun
start is a small client that behaves as the process it stands for); `fresh=True` or
MEGATRON_MTP_TEST_ZYGOTE=0 starts them as fresh interpreters, as a user's torchrun does.
`parse` and `scalars` (megatron_mtp.runs) read the console and a TensorBoard log directory;
`checkpoint_tensors` reads every tensor of a torch_dist checkpoint (model and optimizer) in this
process, for bit-exact comparisons.
"""

import itertools
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from megatron_mtp import runs
from megatron_mtp.patched_core import build_tree, current_upstream_version
from megatron_mtp.runs import parse_console as parse
from tests.harness import zygote as zygotes
from tests.harness.launcher import REPO_ROOT, free_port

# A small model that trains in well under a second per step on one CPU core per rank.
TINY = ("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--log-interval", "1", "--eval-iters", "0", "--lr-warmup-iters", "0")
LAUNCH_TAG = zygotes.LAUNCH_TAG
_LAUNCHES = itertools.count()
ERROR = re.compile(r"^(?:\[default\d+\]:)?(pretrain_gpt_mtp\.py: error: .*)$", re.MULTILINE)


def scalars(logdir: Path) -> dict:
    """{tag: {step: value}} of every scalar of the one run in a TensorBoard log directory (its event
    files there, or in one subdirectory), under TensorBoard's own tags; a directory of several runs is
    refused (megatron_mtp.runs's reader, which renames the tags it reads as the console's)."""
    return runs._scalars(*runs._events(logdir))


@dataclass
class Run:
    returncode: int
    output: str
    iterations: dict = field(default_factory=dict)  # iteration -> {"lm loss": ..., ...}
    validations: dict = field(default_factory=dict)

    def errors(self) -> list[str]:
        """The script's own one-line errors (without torchrun's "[defaultN]:" prefix)."""
        return [match.group(1) for match in ERROR.finditer(self.output)]

    def tail(self, lines: int = 60) -> str:
        """The script's errors, then the output's last lines (torchrun's own report cut off)."""
        kept = [line for line in self.output.splitlines() if "warn" not in line.lower()]
        if any("ChildFailedError" in line for line in kept):
            kept = kept[:next(i for i, line in enumerate(kept) if line.startswith("Traceback")
                              or "ChildFailedError" in line)]
        return "\n".join(self.errors() + ["..."] + kept[-lines:])


def torchrun_command(nproc: int, *args: str, script: str = "pretrain_gpt_mtp.py",
                     rank_logs: Path | None = None, zygote: zygotes.Zygote | None = None,
                     launcher: str = "torch.distributed.run") -> list[str]:
    """torchrun on this machine (`launcher`: its module, or megatron_mtp.launch, the README's);
    with `rank_logs`, each rank's output also goes to a file there
    (the metrics lines come from the last rank, and ranks' prints interleave in the console);
    with `zygote`, torchrun's agent and each worker are that zygote's clients (torchrun's
    import of torch, about 2.5 s a launch, is done once), running torchrun and the script."""
    logs = [f"--log-dir={rank_logs}", "--tee=3"] if rank_logs else []
    python, worker = [sys.executable], [script]
    if zygote is not None:
        client = [sys.executable, "-S", zygotes.__file__, "client", zygote.socket_path]
        python, worker = client, ["--no-python", *client, script]
    return [*python, "-m", launcher, f"--nproc-per-node={nproc}",
            f"--master-port={free_port()}", *logs, *worker, *args]


def _zygote(script: str, cwd: Path, env: dict | None) -> zygotes.Zygote | None:
    """The zygote for a script of this checkout run with its installed build, else None."""
    if not zygotes.enabled() or "PYTHONPATH" in (env or {}) or "PYTHONPATH" in os.environ:
        return None
    if (env or {}).get("CUDA_VISIBLE_DEVICES"):  # a GPU run: the zygote has imported torch without CUDA
        return None
    if not (Path(cwd) / script).resolve().is_relative_to(REPO_ROOT):
        return None
    return zygotes.zygote_for(str(build_tree(current_upstream_version())), str(REPO_ROOT))


def start(nproc: int, *args: str, env: dict | None = None, cwd: Path = REPO_ROOT, log: Path | None = None,
          script: str = "pretrain_gpt_mtp.py", fresh: bool = False,
          launcher: str = "torch.distributed.run") -> tuple[subprocess.Popen, Path]:
    """torchrun in its own process group, output to `log`; for tests that signal the run."""
    log = log or Path(tempfile.mkstemp(prefix="trainer-", suffix=".log")[1])
    tag = f"{os.getpid()}-{next(_LAUNCHES)}"
    environment = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                       **{LAUNCH_TAG: tag})
    environment.update(env or {})  # a test's own CUDA_VISIBLE_DEVICES (tests/test_gpu.py) too
    zygote = None if fresh else _zygote(script, cwd, env)
    command = torchrun_command(nproc, *args, script=script, rank_logs=rank_logs(log), zygote=zygote,
                               launcher=launcher)
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=cwd, env=environment, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    proc.launch_tag = tag
    return proc, log


def rank_logs(log: Path) -> Path:
    return log.with_name(log.name + ".ranks")


def last_rank_output(log: Path) -> str:
    """The stdout of the highest local rank (the last pipeline stage's last tensor rank)."""
    files = sorted(rank_logs(log).glob("*/attempt_*/*/stdout.log"), key=lambda p: int(p.parent.name))
    return files[-1].read_text(errors="replace") if files else ""


def finish(proc: subprocess.Popen, log: Path, timeout: float) -> Run:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        raise AssertionError(f"torchrun timed out after {timeout}s:\n{Run(-9, log.read_text()).tail()}") from None
    kill_group(proc)  # a worker that outlived torchrun
    iterations, validations = parse(last_rank_output(log))
    return Run(proc.returncode, log.read_text(errors="replace"), iterations, validations)


def launch_processes(proc: subprocess.Popen) -> list:
    """Every live process of a launch: those started with the launch's tag in their environment
    (torchrun or its client, the workers or their clients), the children a zygote forked for the
    launch (torchrun, the workers: the zygote knows their tags), and their descendants."""
    import psutil

    found = {}
    for process in psutil.process_iter():
        try:
            if process.environ().get(LAUNCH_TAG) == proc.launch_tag:
                found[process.pid] = process
        except (psutil.Error, OSError):
            pass
    for pid in zygotes.launch_children(proc.launch_tag):
        try:
            process = psutil.Process(pid)
            found[pid] = process
            found.update((child.pid, child) for child in process.children(recursive=True))
        except psutil.Error:
            pass
    return list(found.values())


def torchrun_workers(proc: subprocess.Popen, script: str = "pretrain_gpt_mtp.py") -> list:
    """The processes torchrun started as its workers (what a scheduler signals): `python SCRIPT`,
    or the zygote's clients running SCRIPT."""
    import psutil

    workers = []
    for process in launch_processes(proc):
        try:
            argv = process.cmdline()
        except psutil.Error:  # it has gone
            continue
        if script in argv and "torch.distributed.run" not in argv and "serve" not in argv:
            workers.append(process)
    return workers


def kill_group(proc: subprocess.Popen, timeout: float = 30) -> None:
    """Kill every process group of a launch (launch_processes): torchrun's and each worker's
    (torchrun starts each worker in a session of its own, and a zygote forks its children in
    sessions of their own, which a signal to torchrun's group does not reach); return when no
    process of the launch is left."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        zygotes.kill_groups({proc.pid} | zygotes.process_groups(p.pid for p in launch_processes(proc)))
        proc.wait()
        if not launch_processes(proc) or time.monotonic() > deadline:
            return
        time.sleep(0.05)


def train(nproc: int, *args: str, timeout: float = 300, check: bool = True, env: dict | None = None,
          cwd: Path = REPO_ROOT, script: str = "pretrain_gpt_mtp.py", fresh: bool = False) -> Run:
    """Run to the end; with `check`, a non-zero exit fails the test with the output's tail."""
    with tempfile.TemporaryDirectory() as scratch:
        proc, log = start(nproc, *args, env=env, cwd=cwd, log=Path(scratch) / "run.log", script=script,
                          fresh=fresh)
        run = finish(proc, log, timeout)
    if check and run.returncode != 0:
        raise AssertionError(f"pretrain_gpt_mtp.py exited with {run.returncode}:\n{run.tail()}")
    return run


def example_flags(name: str) -> list[str]:
    """An example config's MTP_ARGS, as the example scripts source them."""
    script = f'source examples/configs/{name}.sh && printf "%s\\n" "${{MTP_ARGS[@]}}"'
    return subprocess.run(["bash", "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                          check=True).stdout.splitlines()


def checkpoint_tensors(directory: Path) -> dict:
    """Every tensor of a torch_dist checkpoint directory (iter_NNNNNNN), by key."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as scratch:
        converted = Path(scratch) / "state.pt"
        dcp_to_torch_save(str(directory), str(converted))
        state = torch.load(converted, weights_only=False)

    def flatten(tree, prefix=""):
        for key, value in tree.items():
            if isinstance(value, dict):
                yield from flatten(value, f"{prefix}{key}.")
            elif torch.is_tensor(value):
                yield f"{prefix}{key}", value

    return dict(flatten(state))


def close(a: float, b: float, rel: float = 2e-5) -> bool:
    """Equal to relative `rel` (a scalar that float32 round-off moves, compared across layouts)."""
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)
