# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""tools/bootstrap's choice of torch build, with the GPU probe and the environment's Python stubbed.

`nvidia-smi` is a stub on PATH that lists a GPU, fails as on a host whose driver sees none, or
is absent (a login node); the virtual environment's `python` is a stub that records each
command and reports no torch installed, so the bootstrap runs through in a moment and the
test reads which `pip install`s of torch it made. The CPU build is tried from what pip's own
configuration reaches (a local wheel) first, then with PyTorch's CPU index; the stub fails
the first attempt where the host has no local wheel.
"""

import os
import subprocess
from pathlib import Path

import pytest

from tests.harness.launcher import REPO_ROOT

CPU = [["torch==2.13.0+cpu"]]
CPU_INDEX = ["torch==2.13.0+cpu", "--extra-index-url", "https://download.pytorch.org/whl/cpu"]
CUDA = [["torch===2.13.0"]]
PROBES = {
    "gpu": "echo 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'",
    "no gpu": "echo 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.'; exit 9",
    "no nvidia-smi": None,
}


def bootstrap(tmp_path: Path, probe: str, torch_build: str | None, local_wheel: bool = True,
              arguments: tuple = ()) -> tuple[subprocess.CompletedProcess, list]:
    stubs = tmp_path / "stubs"
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    stubs.mkdir()
    calls = tmp_path / "calls"
    python = tmp_path / "venv" / "bin" / "python"
    # `-c` is the bootstrap's is-torch-installed probe: answer no; without a local wheel the CPU
    # build's first attempt (no index added) fails; any other command succeeds
    no_local = ("" if local_wheel else
                '[ "$*" = "-m pip --disable-pip-version-check install --quiet torch==2.13.0+cpu" ] && exit 1\n')
    # one call, one write: the record is made in a file of its own and appended at once, since the
    # background `tools/fork build --all` records its calls at the same time as pip's
    python.write_text(f'#!/bin/bash\nrecord=$(mktemp); printf "%s\\0" "$@" > "$record"; echo >> "$record"\n'
                      f'cat "$record" >> {calls}; rm -f "$record"\n{no_local}[ "$1" != -c ]\n')
    python.chmod(0o755)
    if PROBES[probe] is not None:
        (stubs / "nvidia-smi").write_text(f"#!/bin/bash\n{PROBES[probe]}\n")
        (stubs / "nvidia-smi").chmod(0o755)
    environment = {key: value for key, value in os.environ.items() if key != "TORCH_BUILD"}
    environment.update(VENV=str(tmp_path / "venv"), PATH=f"{stubs}:/usr/bin:/bin")
    if torch_build is not None:
        environment["TORCH_BUILD"] = torch_build
    result = subprocess.run(["bash", "tools/bootstrap", *arguments], cwd=REPO_ROOT, env=environment,
                            capture_output=True, text=True, timeout=60)
    recorded = calls.read_text().splitlines() if calls.exists() else []
    return result, [line.split("\0")[:-1] for line in recorded if line]


def torch_installs(calls: list) -> list:
    installs = [call for call in calls if any(arg.startswith("torch=") for arg in call)]
    assert all(call[:5] == ["-m", "pip", "--disable-pip-version-check", "install", "--quiet"] for call in installs)
    return [call[5:] for call in installs]


@pytest.mark.parametrize("probe, torch_build, expected", [
    ("gpu", None, CUDA),
    ("no gpu", None, CPU),
    ("no nvidia-smi", None, CPU),
    ("gpu", "cpu", CPU),
    ("no nvidia-smi", "cuda", CUDA),
    ("gpu", "https://download.pytorch.org/whl/cu128",
     [["torch==2.13.0", "--index-url", "https://download.pytorch.org/whl/cu128"]]),
])
def test_the_build_follows_the_probe_unless_overridden(probe, torch_build, expected, tmp_path):
    result, calls = bootstrap(tmp_path, probe, torch_build)
    assert result.returncode == 0, result.stderr
    assert torch_installs(calls) == expected


def test_without_a_local_wheel_the_cpu_build_comes_from_pytorch_s_cpu_index(tmp_path):
    result, calls = bootstrap(tmp_path, "no gpu", None, local_wheel=False)
    assert result.returncode == 0, result.stderr
    assert torch_installs(calls) == [*CPU, CPU_INDEX]


def test_an_unknown_build_is_refused_in_one_line_before_anything_runs(tmp_path):
    result, calls = bootstrap(tmp_path, "gpu", "rocm")
    assert result.returncode == 2 and calls == [], (result.stderr, calls)
    assert result.stderr.strip() == "TORCH_BUILD=rocm: give auto, cpu, cuda or the URL of a package index"


@pytest.mark.parametrize("arguments, message", [
    (("--framework", "nemo-rl"), "--framework nemo-rl: the framework this checkout installs is verl"),
    (("--framework",), "--framework (none): the framework this checkout installs is verl"),
    (("--engine", "sglang"), "--engine sglang: the engine this checkout installs is vllm"),
    (("--frameworks", "verl"), "unknown argument --frameworks (give nothing, --engine vllm or --framework verl)"),
])
def test_another_framework_or_engine_is_refused_in_one_line_before_anything_runs(tmp_path, arguments, message):
    """Seen failing before `--framework verl` existed: the framework's argument was unknown."""
    result, calls = bootstrap(tmp_path, "no gpu", None, arguments=arguments)
    assert result.returncode == 2 and calls == [], (result.stderr, calls)
    assert result.stderr.strip() == f"tools/bootstrap: {message}"
