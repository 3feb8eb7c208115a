# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""A real Slurm controller and node on this machine, for the SLURM example scripts' test.

`LocalSlurm` installs Debian's slurmctld, slurmd and munge when they are missing (as root,
with apt-get), writes a private configuration (SLURM_CONF; nothing under /etc/slurm is
touched), starts munged, slurmctld and slurmd on free localhost ports and stops whatever
it started. The configuration is the smallest that runs jobs without cgroups or
accounting, with the timers that make a requeue quick: credentials expire after 5 s (a
requeued job waits for that) and the scheduler runs every 2 s.
"""

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from tests.harness.launcher import free_port

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")


class SlurmUnavailable(RuntimeError):
    pass


def install() -> None:
    if all(shutil.which(tool) for tool in ("slurmctld", "slurmd", "sbatch", "munged")):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise SlurmUnavailable("Slurm is not installed and this is not a root shell with apt-get: install "
                               f"{' '.join(PACKAGES)} (Debian) to run this test")
    environment = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for command in (["apt-get", "update", "-q"],
                    ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]):
        result = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=600)
        if result.returncode:
            raise SlurmUnavailable(f"{' '.join(command)} failed: {result.stderr[-2000:]}")


def _memory_megabytes() -> int:
    with open("/proc/meminfo") as meminfo:
        kilobytes = int(next(line for line in meminfo if line.startswith("MemTotal")).split()[1])
    return kilobytes // 1024 - 512


class LocalSlurm:
    def __init__(self, root: Path):
        self.root = root
        self.started: list[subprocess.Popen] = []
        self.node = socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        self.environment = dict(os.environ, SLURM_CONF=str(self.conf))

    def start(self) -> "LocalSlurm":
        install()
        self._munge()
        for directory in ("state", "spool", "log"):
            (self.root / directory).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(self._configuration())
        for daemon in (["slurmctld", "-D", "-c", "-i"], ["slurmd", "-D", "-c"]):
            log = open(self.root / "log" / f"{daemon[0]}.out", "w")
            self.started.append(subprocess.Popen(daemon, env=self.environment, stdout=log, stderr=subprocess.STDOUT,
                                                 start_new_session=True))
        self._wait_for_idle_node()
        return self

    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "--user", "root"], env=self.environment, capture_output=True)
        for proc in reversed(self.started):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()

    def run(self, *command: str, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(command, env=kwargs.pop("env", self.environment), capture_output=True, text=True,
                              timeout=kwargs.pop("timeout", 60), **kwargs)

    def job(self, job_id: str) -> dict:
        """scontrol's fields of a job (JobState, RunTime, Restarts, ExitCode, ...)."""
        result = self.run("scontrol", "show", "job", "--oneliner", job_id)
        return dict(field.split("=", 1) for field in result.stdout.split() if "=" in field)

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted((self.root / "log").iterdir()))

    def _munge(self) -> None:
        if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode == 0:
            return
        run_dir = Path("/run/munge")
        run_dir.mkdir(parents=True, exist_ok=True)
        shutil.chown(run_dir, "munge", "munge")
        key = Path("/etc/munge/munge.key")
        if not key.exists():
            subprocess.run(["mungekey", "--create"], check=True, capture_output=True)
            shutil.chown(key, "munge", "munge")
        # munged daemonizes; it outlives the test like the system service it stands in for.
        subprocess.run(["runuser", "-u", "munge", "--", "munged"], check=True, capture_output=True, timeout=30)

    def _configuration(self) -> str:
        cpus = os.cpu_count()
        return f"""ClusterName=megatron-mtp-test
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=5
StateSaveLocation={self.root}/state
SlurmdSpoolDir={self.root}/spool
SlurmctldPidFile={self.root}/slurmctld.pid
SlurmdPidFile={self.root}/slurmd.pid
SlurmctldLogFile={self.root}/log/slurmctld.log
SlurmdLogFile={self.root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobRequeue=1
KillWait=30
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={_memory_megabytes()} State=UNKNOWN
PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""

    def _wait_for_idle_node(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.run("sinfo", "--noheader", "--format=%t").stdout.strip()
            if state == "idle":
                return
            for proc in self.started:
                if proc.poll() is not None:
                    raise SlurmUnavailable(f"a Slurm daemon exited with {proc.returncode}:\n{self.logs()}")
            time.sleep(0.5)
        raise SlurmUnavailable(f"the node is not idle after {timeout}s:\n{self.logs()}")
