"""Start launch ranks by forking a process that has already imported torch and megatron-core.

Each rank of a launch is a fresh interpreter that imports torch and megatron-core before
its body runs: about 5 s of CPU per process, most of a short body's cost, for dozens of
launches per suite on a 2-core machine. A zygote is one such interpreter per megatron-core
tree (the launch's first PYTHONPATH entry), started on first use: it imports what the
bodies import, then forks a child per rank on request. The child starts its own session
(the launcher kills its process group on timeout), takes the rank's environment and log
file, and runs tests.harness.worker as a fresh process would; it has no thread besides
its main one when it is forked (checked when the zygote starts). GPU launches and a tree
whose zygote cannot start keep the plain start (tests.harness.launcher).

    python -m tests.harness.zygote        # the server: JSON requests on stdin, pids on stdout
"""

import atexit
import json
import os
import signal
import subprocess
import sys
import threading
import time

# What the bodies import (an import that fails in some tree is skipped there).
PRELOAD = ("torch", "torch.distributed", "megatron.core", "megatron.core.parallel_state",
           "megatron.core.models.gpt.gpt_model", "megatron.core.optimizer", "megatron.core.distributed",
           "megatron.core.dist_checkpointing", "megatron.core.pipeline_parallel", "megatron.core.fork.specs",
           "megatron_mtp.library.model", "megatron_mtp.library.step", "megatron_mtp.library.checkpointing",
           "megatron_mtp.library.initialize", "tests.harness.worker")


class Forked:
    """A rank forked by a zygote, with the part of Popen's interface the launcher uses. The
    zygote reaps it, so its exit status is read from the worker's result file."""

    def __init__(self, pid: int, result_path: str):
        self.pid, self.result_path, self.returncode = pid, result_path, None

    def poll(self):
        if self.returncode is None:
            try:
                os.kill(self.pid, 0)
                return None
            except ProcessLookupError:
                try:
                    with open(self.result_path) as f:
                        self.returncode = 0 if json.load(f)["ok"] else 1
                except (OSError, ValueError, KeyError):
                    self.returncode = 1
        return self.returncode

    def wait(self):
        while self.poll() is None:
            time.sleep(0.05)
        return self.returncode


class Zygote:
    def __init__(self, environment: dict, cwd: str):
        self.process = subprocess.Popen([sys.executable, "-m", "tests.harness.zygote"], cwd=cwd, env=environment,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        start_new_session=True)
        self.lock = threading.Lock()
        ready = json.loads(self.process.stdout.readline() or "{}")
        if not ready.get("ready"):
            self.close()
            raise RuntimeError(f"zygote did not start: {ready}")

    def fork(self, argv: list[str], environment: dict, log: str) -> int:
        with self.lock:
            self.process.stdin.write(json.dumps({"argv": argv, "env": environment, "log": log}) + "\n")
            self.process.stdin.flush()
            reply = json.loads(self.process.stdout.readline() or "{}")
        if "pid" not in reply:
            raise RuntimeError(f"zygote fork failed: {reply}")
        return reply["pid"]

    def close(self):
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()


_zygotes: dict = {}


def zygote_for(pythonpath_first: str, environment: dict, cwd: str) -> Zygote | None:
    """The zygote of a megatron-core tree (started on first use), or None where it cannot start."""
    if pythonpath_first not in _zygotes:
        try:
            _zygotes[pythonpath_first] = Zygote(environment, cwd)
        except (RuntimeError, OSError, ValueError):
            _zygotes[pythonpath_first] = None
    return _zygotes[pythonpath_first]


@atexit.register
def _close_all():
    for zygote in _zygotes.values():
        if zygote is not None:
            zygote.close()


def _child(request: dict) -> None:
    """In the forked child: become the rank a fresh `python -m tests.harness.worker` would be."""
    try:
        os.setsid()
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        sys.stdin = open(0)
        sys.stdout = open(1, "w", buffering=1)
        sys.stderr = open(2, "w", buffering=1)
        os.environ.clear()
        os.environ.update(request["env"])
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        from tests.harness.worker import main

        code = main(*request["argv"])
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve() -> None:
    import importlib
    import warnings

    warnings.filterwarnings("ignore")
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module this tree lacks: its bodies import what they use
            pass
    if threading.active_count() != 1:  # a fork would copy no thread but their locks
        print(json.dumps({"ready": False, "threads": [t.name for t in threading.enumerate()]}), flush=True)
        return
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped as they exit
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(json.dumps({"pid": pid}), flush=True)


if __name__ == "__main__":
    serve()
