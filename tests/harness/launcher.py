# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Launch a test body on `world_size` real processes talking gloo over loopback.

Each process imports megatron-core (several seconds), so a body usually runs many
checks per launch; CPU ranks are forked from a process that has already imported it
(tests.harness.zygote; MEGATRON_MTP_TEST_ZYGOTE=0 starts fresh interpreters instead).
The launcher picks a free port, gives the whole launch one
deadline, kills every process group it started on timeout or failure (no process
is left behind), and raises with every failing rank's traceback and output tail.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megatron_mtp.patched_core import REPO_ROOT, build_tree, current_upstream_version
from tests.harness import zygote as zygotes

# After the first rank fails, the others usually block in a collective: give them a
# moment to report their own errors, then kill them.
GRACE_AFTER_FAILURE_S = 5.0


class DistributedTestFailure(AssertionError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(procs) -> None:
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for proc in procs:
        proc.wait()


def _tail(path: Path, lines: int = 40) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    kept = [line for line in text.splitlines() if "UserWarning" not in line and "warnings.warn" not in line]
    return "\n".join(kept[-lines:])


# A port free when chosen can be taken before rank 0's store binds it (another launch's
# sockets, two pytest workers at once): seen once in 430 fresh-clone tests. The store fails
# before any body runs, so the launch is tried again on another port.
PORT_TAKEN = "EADDRINUSE"
PORT_ATTEMPTS = 3


def launch(body: str, world_size: int, args: dict | None = None, timeout: float = 300.0,
           tmp_dir: Path | None = None, use_gpus: bool = False, build: str | None = None,
           upstream_tree: Path | None = None, python: str | None = None,
           first_on_path: Path | None = None) -> list:
    """Run `body` ("package.module:function") on every rank; return each rank's return value.

    The body is called as function(**args) after torch.distributed (gloo) is up; it sets
    up whatever model-parallel layouts it needs (see tests.harness.layout). Ranks run on
    the CPU with gloo unless `use_gpus` (one GPU per rank, NCCL). They import this
    checkout's patched megatron-core of upstream version `build` (default: `current`),
    which they check before running the body, or, with `upstream_tree`, that other
    megatron-core tree (pristine upstream for comparisons; not checked). `python`: another
    environment's interpreter runs the ranks (a framework's, e.g. .venv-verl), each a fresh process;
    `first_on_path`: a directory its imports find first (a framework's package patched otherwise).
    """
    for attempt in range(1, PORT_ATTEMPTS + 1):
        try:
            return _launch_once(body, world_size, args, timeout, tmp_dir, use_gpus, build, upstream_tree, python,
                                first_on_path)
        except DistributedTestFailure as failure:
            if PORT_TAKEN not in str(failure) or attempt == PORT_ATTEMPTS:
                raise


def _launch_once(body, world_size, args, timeout, tmp_dir, use_gpus, build, upstream_tree, python=None,
                 first_on_path=None) -> list:
    if upstream_tree is not None:
        pythonpath_first, check_version = str(upstream_tree), None
    else:
        check_version = build or current_upstream_version()
        pythonpath_first = str(build_tree(check_version))
    with tempfile.TemporaryDirectory(dir=tmp_dir) as scratch:
        scratch = Path(scratch)
        spec = scratch / "spec.json"
        spec.write_text(json.dumps({"body": body, "args": args or {}, "build": check_version}))
        port = free_port()
        base_env = zygotes.environment(pythonpath_first, str(REPO_ROOT), cpu=not use_gpus)
        if first_on_path is not None:
            base_env["PYTHONPATH"] = os.pathsep.join((str(first_on_path), base_env["PYTHONPATH"]))
        zygote = None
        if not use_gpus and zygotes.enabled() and python is None and first_on_path is None:
            zygote = zygotes.zygote_for(pythonpath_first, str(REPO_ROOT))
        procs, logs = [], []
        for rank in range(world_size):
            env = dict(base_env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                       LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            log = scratch / f"rank{rank}.log"
            logs.append(log)
            argv = [str(spec), str(scratch / f"rank{rank}.json")]
            if zygote is not None:  # a fork of an interpreter that has imported megatron-core
                procs.append(zygote.fork_worker(argv, env, str(REPO_ROOT), str(log)))
                continue
            with open(log, "w") as out:
                procs.append(subprocess.Popen(
                    [python or sys.executable, "-m", "tests.harness.worker", *argv],
                    cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                ))
        deadline = time.monotonic() + timeout
        failed_at = None
        try:
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                    failed_at = now
                if now > deadline or (failed_at is not None and now - failed_at > GRACE_AFTER_FAILURE_S):
                    break
                time.sleep(0.05)
        finally:
            timed_out = any(p.poll() is None for p in procs) and failed_at is None
            _kill(procs)

        results, problems = [], []
        for rank, (proc, log) in enumerate(zip(procs, logs)):
            result_file = scratch / f"rank{rank}.json"
            outcome = json.loads(result_file.read_text()) if result_file.exists() else None
            if outcome and outcome["ok"]:
                results.append(outcome["result"])
                continue
            results.append(None)
            detail = outcome["traceback"] if outcome else f"(no result; exit code {proc.returncode})"
            problems.append(f"--- rank {rank} ---\n{detail}\n--- rank {rank} output tail ---\n{_tail(log)}")
        if timed_out:
            problems.insert(0, f"timed out after {timeout:.0f}s")
        if problems:
            raise DistributedTestFailure(f"{body} on {world_size} rank(s) failed:\n" + "\n".join(problems))
        return results
