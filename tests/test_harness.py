"""The launcher the distributed tests stand on: ranks forked from a zygote (an interpreter
that has imported megatron-core) or started fresh behave alike; a failing rank is reported
with its traceback; a launch past its deadline is killed; no process is left behind."""

import os

import pytest

from tests.harness import DistributedTestFailure, launch


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.mark.parametrize("zygote", ["1", "0"], ids=["forked", "fresh"])
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
