# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Start test processes by forking an interpreter that has already imported torch and megatron-core.

A fresh interpreter spends about 5 s of CPU importing torch, megatron-core and megatron.training
before it does anything: most of a short launch's or a short training run's cost, dozens of
times per suite on a 2-core machine. A zygote is one such interpreter per megatron-core tree,
started on first use; it imports what the tests' processes import, then forks a child per
request. Two kinds of request, one mechanism:

- a launch rank (tests.harness.launcher): the test process asks for tests.harness.worker with
  the rank's argv, environment and log file;
- torchrun and its workers (tests.harness.trainer): the test runs `python -S zygote.py client
  SOCKET -m torch.distributed.run ...` and torchrun runs `python -S zygote.py client SOCKET
  SCRIPT ARGS...` as each worker, a client that starts in milliseconds. It hands the zygote its
  argv, environment, working directory and standard streams, forwards the signals it receives
  to the child and exits as the child did (status or signal), so torchrun, its --tee logs and
  a test that signals the workers see what a fresh `python SCRIPT ARGS...` would give them.

A child starts its own session (its own process group). The zygote kills that group, and those
of the child's descendants, when the requester's connection closes (the client was killed, or the
test process died), so killing a
torchrun process group still leaves nothing behind. The zygote has no thread besides its main
one when it forks (checked at start). GPU runs, MEGATRON_MTP_TEST_ZYGOTE=0, and a tree whose
zygote cannot start keep the plain start.

    python tests/harness/zygote.py serve SOCKET    # the zygote (in the checkout); prints {"ready": ...}
"""

import json
import os
import select
import selectors
import signal
import socket
import struct
import sys

# What the tests' processes import (an import that fails in some tree is skipped there).
PRELOAD = ("torch", "torch.distributed", "megatron.core", "megatron.core.parallel_state",
           "megatron.core.models.gpt.gpt_model", "megatron.core.optimizer", "megatron.core.distributed",
           "megatron.core.dist_checkpointing", "megatron.core.pipeline_parallel", "megatron.core.fork.runtime.specs",
           "megatron.training", "megatron.training.training", "megatron.training.arguments",
           "megatron.core.fork.training_loop.exact_step", "megatron_mtp.arguments",
           "megatron_mtp.library.model", "megatron_mtp.library.step", "megatron_mtp.library.checkpointing",
           "megatron_mtp.library.initialize", "tests.harness.worker")

# In every process of one trainer launch (tests.harness.trainer): what kill_group kills.
LAUNCH_TAG = "MEGATRON_MTP_TEST_LAUNCH"

# What a scheduler or torchrun sends a worker; the client passes each on to its child.
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                     signal.SIGUSR2, signal.SIGCONT)


def enabled() -> bool:
    return os.environ.get("MEGATRON_MTP_TEST_ZYGOTE", "1") != "0"


# ---------------------------------------------------------------- wire format
# A request: 8-byte length, then JSON {"kind", "argv", "env", "cwd"}, the requester's stdin,
# stdout and stderr passed with the length (SCM_RIGHTS). Replies: JSON lines {"pid": ...},
# then {"status": <wait status>} when the child has exited.

def request(sock: socket.socket, kind: str, argv: list, env: dict, cwd: str, fds: tuple) -> dict:
    """Send a request; the zygote's first reply ({"pid": ...} for a fork)."""
    payload = json.dumps({"kind": kind, "argv": argv, "env": env, "cwd": cwd}).encode()
    socket.send_fds(sock, [struct.pack("!Q", len(payload))], list(fds))
    sock.sendall(payload)
    return _read_reply(sock)


def _read_reply(sock: socket.socket) -> dict:
    line = b""
    while not line.endswith(b"\n"):
        chunk = sock.recv(1)
        if not chunk:
            raise ConnectionError("the zygote closed the connection")
        line += chunk
    return json.loads(line)


def _receive(conn: socket.socket) -> tuple[dict, list]:
    header, fds, _, _ = socket.recv_fds(conn, 8, 3)
    (length,) = struct.unpack("!Q", header)
    payload = b""
    while len(payload) < length:
        chunk = conn.recv(length - len(payload))
        if not chunk:
            raise ConnectionError("request cut short")
        payload += chunk
    return json.loads(payload), fds


def _exit_code(status: int) -> int:
    """Popen's returncode: the exit status, or -N for a child killed by signal N."""
    return os.waitstatus_to_exitcode(status)


def process_groups(pids) -> set:
    """The process group of each pid that still exists."""
    groups = set()
    for pid in pids:
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            pass
    return groups


def kill_groups(groups) -> None:
    """SIGKILL every process of each group (a group that has gone is skipped)."""
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


# ---------------------------------------------------------------- test-process side

class Forked:
    """A child of a zygote, with the part of Popen's interface the launcher uses."""

    def __init__(self, sock: socket.socket, pid: int):
        self.sock, self.pid, self.returncode = sock, pid, None

    def poll(self):
        if self.returncode is None and select.select([self.sock], [], [], 0)[0]:
            return self.wait()
        return self.returncode

    def wait(self):
        if self.returncode is None:
            try:
                self.returncode = _exit_code(_read_reply(self.sock)["status"])
            except (ConnectionError, ValueError, KeyError):
                self.returncode = -signal.SIGKILL  # the zygote is gone, and its children with it
            self.sock.close()
        return self.returncode


class Zygote:
    def __init__(self, environment: dict, cwd: str, socket_path: str):
        import subprocess

        self.socket_path = socket_path
        # stdin stays open: the zygote kills its children and exits when this process goes.
        self.process = subprocess.Popen([sys.executable, __file__, "serve", socket_path],
                                        cwd=cwd, env=environment, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, start_new_session=True)
        ready = json.loads(self.process.stdout.readline() or "{}")
        if not ready.get("ready"):
            self.close()
            raise RuntimeError(f"zygote did not start: {ready}")

    def fork_worker(self, argv: list, environment: dict, cwd: str, log: str) -> Forked:
        """tests.harness.worker's main(*argv) in `cwd`, in a child whose stdout and stderr go to `log`."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(self.socket_path)
        with open(log, "w") as out, open(os.devnull) as devnull:
            streams = (devnull.fileno(), out.fileno(), out.fileno())
            pid = request(sock, "worker", argv, environment, cwd, streams)["pid"]
        return Forked(sock, pid)

    def close(self):
        """Stop the zygote: closing its stdin makes it kill its children's groups and leave;
        SIGKILL only if it has not gone within seconds."""
        import subprocess

        try:
            self.process.stdin.close()
            self.process.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()


def launch_children(tag: str) -> list[int]:
    """The live children every started zygote forked for a launch (LAUNCH_TAG in their request's
    environment): a forked process's /proc environment is the zygote's, so it shows no tag."""
    pids = []
    for zygote in _zygotes.values():
        if zygote is None:
            continue
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(zygote.socket_path)
            pids += request(sock, "launch", [tag], {}, "/", ())["pids"]
        except (OSError, ConnectionError, ValueError, KeyError):
            pass  # a zygote that has gone has killed its children
        finally:
            sock.close()
    return pids


_zygotes: dict = {}


def environment(tree: str, repo_root: str, cpu: bool = True) -> dict:
    """A process's environment importing megatron-core from `tree` (and this checkout)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join((tree, repo_root)))
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def zygote_for(tree: str, repo_root: str) -> Zygote | None:
    """The zygote of a megatron-core tree (started on first use), or None where it cannot start."""
    if tree not in _zygotes:
        import atexit
        import tempfile

        if not _zygotes:
            atexit.register(_close_all)
        directory = tempfile.mkdtemp(prefix="megatron-mtp-zygote-")
        try:
            _zygotes[tree] = Zygote(environment(tree, repo_root), repo_root, os.path.join(directory, "socket"))
        except (RuntimeError, OSError, ValueError):
            _zygotes[tree] = None
    return _zygotes[tree]


def _close_all():
    import shutil

    for zygote in _zygotes.values():
        if zygote is not None:
            zygote.close()
            shutil.rmtree(os.path.dirname(zygote.socket_path), ignore_errors=True)


# ---------------------------------------------------------------- the client torchrun starts

def client(socket_path: str, script: str, *args: str) -> None:
    """Be the worker `python SCRIPT ARGS...` torchrun started, by way of a zygote's child."""
    pending, child = [], []

    def forward(signum, _frame):
        if child:
            os.kill(child[0], signum)
        else:
            pending.append(signum)

    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, forward)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(socket_path)
    child.append(request(sock, "script", [script, *args], dict(os.environ), os.getcwd(), (0, 1, 2))["pid"])
    for signum in pending:
        os.kill(child[0], signum)
    code = _exit_code(_read_reply(sock)["status"])
    if code < 0:  # die of the child's signal, as the worker itself would have
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


# ---------------------------------------------------------------- the zygote

def _run_worker(argv: list) -> int:
    from tests.harness.worker import main

    return main(*argv)


def _run_script(argv: list) -> int:
    """What `python SCRIPT ARGS...` does: run the file as __main__, its directory first on sys.path."""
    import atexit
    import runpy
    import threading
    import traceback

    try:
        if argv[0] == "-m":  # `python -m MODULE ARGS...` (torchrun): the working directory first on sys.path
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as leaving:
        if leaving.code is None or isinstance(leaving.code, int):
            code = leaving.code or 0
        else:
            print(leaving.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - printed as the interpreter would print it
        traceback.print_exc()
        code = 1
    threading._shutdown()  # noqa: SLF001 - the interpreter joins non-daemon threads on exit
    atexit._run_exitfuncs()  # noqa: SLF001
    return code


def _child(request: dict, fds: list) -> None:
    """In the forked child: become the process the request describes; never returns."""
    code = 1
    try:
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        code = (_run_script if request["kind"] == "script" else _run_worker)(request["argv"])
    except BaseException:  # noqa: BLE001
        import traceback

        traceback.print_exc()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def serve(socket_path: str) -> None:
    import importlib
    import threading
    import warnings

    sys.path[0] = os.getcwd()  # the checkout, as for `python -m`, not this file's directory
    filters = list(warnings.filters)
    warnings.filterwarnings("ignore")  # megatron-core warns at import about missing GPU extensions
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module this tree lacks: its processes import what they use
            pass
    warnings.filters[:] = filters
    warnings._filters_mutated()  # noqa: SLF001
    if threading.active_count() != 1:  # a fork would copy no thread but their locks
        print(json.dumps({"ready": False, "threads": [t.name for t in threading.enumerate()]}), flush=True)
        return

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # the wake-up pipe reports it
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_read, selectors.EVENT_READ, "child exited")
    selector.register(sys.stdin, selectors.EVENT_READ, "test process")
    children = {}  # pid -> the connection that asked for it
    tags = {}  # pid -> the launch tag in its environment (none for a launcher rank)
    print(json.dumps({"ready": True}), flush=True)

    def kill(pid):
        """The child's group and those of its descendants (torchrun's workers have sessions of their own)."""
        import psutil

        try:
            descendants = [p.pid for p in psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            descendants = []
        kill_groups({pid} | process_groups(descendants))

    while True:
        for key, _ in selector.select():
            if key.data == "accept":
                conn, _ = listener.accept()
                try:
                    request, fds = _receive(conn)
                except (ConnectionError, ValueError, OSError):
                    conn.close()
                    continue
                if request["kind"] == "launch":  # which children a launch (its tag) has now
                    pids = [pid for pid, tag in tags.items() if tag == request["argv"][0]]
                    conn.sendall(json.dumps({"pids": pids}).encode() + b"\n")
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    for fd in (wake_read, wake_write):
                        os.close(fd)
                    listener.close()
                    selector.close()
                    for other in children.values():
                        other.close()
                    conn.close()
                    _child(request, fds)
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
                tags[pid] = request["env"].get(LAUNCH_TAG)
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                selector.register(conn, selectors.EVENT_READ, pid)
            elif key.data == "child exited":
                os.read(wake_read, 4096)
                while True:
                    try:
                        pid, status = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    conn = children.pop(pid, None)
                    tags.pop(pid, None)
                    if conn is not None:
                        if conn.fileno() in selector.get_map():
                            selector.unregister(conn)
                        try:
                            conn.sendall(json.dumps({"status": status}).encode() + b"\n")
                        except OSError:
                            pass
                        conn.close()
            elif key.data == "test process":
                if not sys.stdin.readline():  # the test process is gone: so are its children
                    for pid in children:
                        kill(pid)
                    return
            else:  # a requester's connection: readable only when it closed
                kill(key.data)  # reaped when it exits, and reported to no one
                selector.unregister(key.fileobj)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    elif sys.argv[1] == "client":
        client(*sys.argv[2:])
    else:
        sys.exit(f"usage: {sys.argv[0]} serve SOCKET | client SOCKET (SCRIPT | -m MODULE) [ARGS...]")
