# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The runtime refuses a megatron-core that is not this checkout's patched build."""

import subprocess
import sys

import pytest

from megatron_mtp import patched_core
from megatron_mtp.patched_core import REPO_ROOT, PatchedCoreError


def test_installed_build_matches_this_checkout():
    patched_core.require_patched_core()  # the suite's own environment: `current`, installed


def test_mismatched_build_names_the_fix(monkeypatch):
    monkeypatch.setattr(patched_core, "imported_core_version", lambda: "0.19.2")
    with pytest.raises(PatchedCoreError) as error:
        patched_core.require_patched_core()
    message = str(error.value)
    assert "megatron-core 0.19.2 is imported" in message
    assert patched_core.expected_build_version() in message
    assert "tools/fork install" in message


def test_another_carried_version_names_its_build_command(monkeypatch):
    other = next(v for v in patched_core.carried_versions() if v != patched_core.current_upstream_version())
    monkeypatch.setattr(patched_core, "imported_core_version", lambda: other)
    with pytest.raises(PatchedCoreError, match=f"tools/fork build --version {other}"):
        patched_core.require_patched_core(other)


def test_missing_core_names_the_fix(monkeypatch):
    monkeypatch.setattr(patched_core, "imported_core_version", lambda: None)
    with pytest.raises(PatchedCoreError, match="no megatron-core is installed.*tools/fork install"):
        patched_core.require_patched_core()


def test_series_digest_follows_the_patch_contents(tmp_path, monkeypatch):
    version = patched_core.current_upstream_version()
    original = patched_core.series_digest(version)
    copy = tmp_path / "patches"
    import shutil

    shutil.copytree(patched_core.PATCHES_DIR, copy)
    monkeypatch.setattr(patched_core, "PATCHES_DIR", copy)
    assert patched_core.series_digest(version) == original
    first = patched_core.series_patches(version)[0]
    first.write_bytes(first.read_bytes() + b"\n")
    assert patched_core.series_digest(version) != original


def test_trainer_stops_before_training_on_a_wrong_build(tmp_path):
    """The entry point itself refuses, with the fix, and exits non-zero without a traceback."""
    probe = (
        "import sys, megatron_mtp.patched_core as p\n"
        "p.imported_core_version = lambda: '0.19.2'\n"
        "sys.argv = ['pretrain_gpt_mtp.py']\n"
        "import runpy\n"
        "runpy.run_path('pretrain_gpt_mtp.py', run_name='__main__')\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 2
    assert "tools/fork install" in result.stderr
    assert "Traceback" not in result.stderr
