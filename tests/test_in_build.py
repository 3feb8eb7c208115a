# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Run tests/in_build (unit tests that import megatron-core directly) on every carried build,
each in its own pytest process with that build's tree first on the path."""

import os
import subprocess
import sys

import pytest

from megatron_mtp.patched_core import REPO_ROOT, build_tree
from tests.conftest import BUILDS


@pytest.mark.parametrize("build", BUILDS, ids=[f"core{v}" for v in BUILDS])
def test_unit_tests_on_build(build):
    env = dict(os.environ, MEGATRON_MTP_BUILD=build, CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(build_tree(build)), str(REPO_ROOT)]))
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/in_build"],
                            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]
