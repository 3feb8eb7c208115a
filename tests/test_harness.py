# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The launcher the distributed tests stand on: ranks forked from a zygote (an interpreter
that has imported megatron-core) or started fresh behave alike; a failing rank is reported
with its traceback; a launch past its deadline is killed; no process is left behind. A
torchrun worker forked from the zygote is what the script run fresh would be: its argv,
directory, environment and streams; its exit status and the signals sent to it; and it goes
when torchrun's process group is killed."""

import os
import signal
import time

import psutil
import pytest

from tests.harness import DistributedTestFailure, launch
from tests.harness.launcher import REPO_ROOT
from tests.harness.trainer import finish, kill_group, launch_processes, start, torchrun_workers, train


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.mark.parametrize("zygote", ["1", pytest.param("0", marks=pytest.mark.matrix)], ids=["forked", "fresh"])
def test_ranks_are_separate_sessions_with_their_own_environment(zygote, monkeypatch):
    monkeypatch.setenv("MEGATRON_MTP_TEST_ZYGOTE", zygote)
    ranks = launch("tests.bodies.harness:identity", 3)
    assert [r["rank"] for r in ranks] == [0, 1, 2] and {r["world"] for r in ranks} == {3}
    assert [r["rank_env"] for r in ranks] == ["0", "1", "2"]
    assert len({r["pid"] for r in ranks}) == 3 and all(r["session_leader"] for r in ranks)
    assert not any(alive(r["pid"]) for r in ranks)


def test_a_failing_rank_is_reported_with_its_traceback():
    with pytest.raises(DistributedTestFailure) as failure:
        launch("tests.bodies.harness:fail_on", 2, {"rank": 1}, timeout=120)
    assert "--- rank 1 ---" in str(failure.value) and "rank 1 fails on purpose" in str(failure.value)


def test_a_launch_past_its_deadline_is_killed(tmp_path):
    with pytest.raises(DistributedTestFailure, match="timed out after 6s"):
        launch("tests.bodies.harness:hang", 2, {"pid_dir": str(tmp_path)}, timeout=6)
    pids = [int(path.read_text()) for path in sorted(tmp_path.iterdir())]
    assert len(pids) == 2 and not any(alive(pid) for pid in pids)


# ---------------------------------------------------------------- torchrun workers from the zygote
WORKER = "tests/bodies/torchrun_worker.py"


def _pids(directory) -> list[int]:
    return [int(path.read_text()) for path in sorted(directory.iterdir())]


def test_a_torchrun_worker_from_the_zygote_is_the_script_run_fresh(tmp_path):
    """argv, working directory, sys.path[0], the rank's environment and both streams are the
    script's own; the worker is a child of the zygote, not a fresh interpreter."""
    pids = tmp_path / "pids"
    pids.mkdir()
    run = train(2, "report", str(pids), script=str(REPO_ROOT / WORKER), cwd=tmp_path.parent, timeout=120,
                check=False)
    assert run.returncode == 0, run.tail()
    for rank in (0, 1):
        assert f"argv=['report', '{pids}'] cwd={tmp_path.parent} path0={REPO_ROOT / 'tests' / 'bodies'} " \
               f"rank={rank} parent=zygote" in run.output, run.output[-3000:]
    assert run.output.count("to stderr") == 2
    workers = _pids(pids)
    assert len(workers) == 2 and not any(alive(pid) for pid in workers)


def test_a_worker_s_exit_status_and_signals_reach_torchrun(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    run = train(1, "exit3", str(pids), script=WORKER, timeout=120, check=False)
    assert run.returncode != 0 and "exitcode  : 3" in run.output, run.output[-3000:]

    (pids / "0").unlink()
    proc, log = start(1, "sigterm", str(pids), script=WORKER, log=tmp_path / "sigterm.log")
    try:
        deadline = time.monotonic() + 60
        while "waiting" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        for worker in torchrun_workers(proc, WORKER):  # the clients torchrun started
            worker.send_signal(signal.SIGTERM)
    finally:
        run = finish(proc, log, timeout=60)
    assert run.returncode == 0 and "got SIGTERM" in run.output, run.output[-3000:]


def test_killing_torchrun_s_process_group_leaves_no_worker(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    proc, log = start(2, "hang", str(pids), script=WORKER, log=tmp_path / "hang.log")
    try:
        deadline = time.monotonic() + 60
        while len(list(pids.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        workers = _pids(pids)
        assert len(workers) == 2 and all(alive(pid) for pid in workers)
        # forked by the zygote: not torchrun's descendants
        assert not set(workers) & {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
        assert set(workers) <= {process.pid for process in launch_processes(proc)}  # found by the launch's tag
    finally:
        kill_group(proc)  # what the harness does on a timeout: it returns when the zygote's children are gone
    assert not any(alive(pid) for pid in workers)


def test_a_launch_whose_port_was_taken_runs_again_on_another_port(monkeypatch):
    """Rank 0's store can lose its chosen port to another socket before it binds (EADDRINUSE,
    before any body runs): the launch is tried again; any other failure is raised at once."""
    from tests.harness import launcher

    calls = []

    def once(*args):
        calls.append(args)
        if len(calls) == 1:
            raise launcher.DistributedTestFailure("rank 0: DistNetworkError ... EADDRINUSE, address already in use")
        return ["ok"]

    monkeypatch.setattr(launcher, "_launch_once", once)
    assert launcher.launch("tests.bodies.none:none", 1) == ["ok"] and len(calls) == 2

    def broken(*args):
        calls.append(args)
        raise launcher.DistributedTestFailure("rank 0: AssertionError in the body")

    calls.clear()
    monkeypatch.setattr(launcher, "_launch_once", broken)
    with pytest.raises(launcher.DistributedTestFailure, match="in the body"):
        launcher.launch("tests.bodies.none:none", 1)
    assert len(calls) == 1
