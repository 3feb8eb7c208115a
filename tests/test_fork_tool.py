"""tools/fork: the series applies to pristine upstream, export reproduces it byte for byte,
and every failure the issue names gives a clear error instead of a traceback."""

import hashlib
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from megatron.training.patched_core import REPO_ROOT, current_upstream_version, series_dir, series_patches

VERSION = current_upstream_version()
SDIST = REPO_ROOT / ".build" / "downloads" / f"megatron_core-{VERSION}.tar.gz"


def fork(*args, env=None, check_rc=None):
    result = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "fork"), *map(str, args)],
                            capture_output=True, text=True, env=env, cwd=REPO_ROOT)
    if check_rc is not None:
        assert result.returncode == check_rc, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    return result


@pytest.fixture(scope="module")
def sdist():
    if not SDIST.is_file():  # bootstrap downloads it; fetch it if this checkout never installed
        fork("check", check_rc=0)
    return SDIST


def test_check_applies_every_patch_to_pristine_upstream(sdist):
    result = fork("check", "--sdist", sdist, check_rc=0)
    for patch in series_patches(VERSION):
        assert f"{patch.name}: ok" in result.stdout


def test_prepare_then_export_reproduces_the_committed_series_byte_for_byte(sdist, tmp_path):
    tree, out = tmp_path / "tree", tmp_path / "out"
    fork("prepare", "--workdir", tree, "--sdist", sdist, check_rc=0)
    commits = subprocess.run(["git", "-C", tree, "rev-list", "--count", "upstream..HEAD"],
                             capture_output=True, text=True).stdout.strip()
    assert int(commits) == len(series_patches(VERSION))  # one commit per patch
    fork("export", "--workdir", tree, "--out", out, check_rc=0)
    committed = series_dir(VERSION)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in committed.iterdir())
    for path in out.iterdir():
        assert path.read_bytes() == (committed / path.name).read_bytes(), f"{path.name} drifted"


def test_prepare_refuses_a_dirty_working_tree(sdist, tmp_path):
    tree = tmp_path / "tree"
    fork("prepare", "--workdir", tree, "--sdist", sdist, check_rc=0)
    (tree / "megatron" / "core" / "parallel_state.py").write_text("# edited\n")
    result = fork("prepare", "--workdir", tree, "--sdist", sdist, check_rc=2)
    assert "uncommitted changes" in result.stderr
    assert (tree / "megatron" / "core" / "parallel_state.py").read_text() == "# edited\n"  # nothing lost


def test_unknown_version_is_a_clear_error():
    result = fork("check", "--version", "9.9.9", check_rc=2)
    assert "no patch series for megatron-core 9.9.9" in result.stderr or "unknown megatron-core version" in result.stderr


def test_hash_mismatch_is_a_clear_error(tmp_path):
    fake = tmp_path / f"megatron_core-{VERSION}.tar.gz"
    fake.write_bytes(b"not the release")
    result = fork("check", "--sdist", fake, check_rc=2)
    assert "sha256 mismatch" in result.stderr


def test_no_network_is_a_clear_error(tmp_path):
    env = dict(os.environ, MEGATRON_MTP_DOWNLOADS=str(tmp_path), PIP_NO_INDEX="1", PIP_FIND_LINKS="")
    result = fork("check", env=env, check_rc=2)
    assert "could not download" in result.stderr and "no network" in result.stderr


def _megatron_lm_like_checkout(sdist: Path, root: Path) -> Path:
    """A directory laid out like a Megatron-LM checkout (megatron/core/... at the same paths)."""
    with tarfile.open(sdist) as archive:
        archive.extractall(root, filter="data")
    (checkout,) = root.iterdir()
    return checkout


def test_check_reports_the_patch_and_file_that_do_not_apply_to_a_checkout(sdist, tmp_path):
    checkout = _megatron_lm_like_checkout(sdist, tmp_path / "lm")
    fork("check", "--sdist", sdist, "--checkout", checkout, check_rc=0)
    target = checkout / "megatron" / "core" / "optimizer" / "grad_scaler.py"
    target.write_text(target.read_text().replace("device='cuda'", "device='cuda:0'"))
    result = fork("check", "--sdist", sdist, "--checkout", checkout, check_rc=1)
    first = series_patches(VERSION)[0].name
    assert f"{first}: FAILED" in result.stdout
    assert "megatron/core/optimizer/grad_scaler.py" in result.stdout


def _variant_sdist(sdist: Path, tmp_path: Path, version: str, edit) -> tuple[Path, str]:
    """Repack the pristine sdist as `version` after `edit(tree_root)` changed some files."""
    root = tmp_path / f"src-{version}"
    with tarfile.open(sdist) as archive:
        archive.extractall(root, filter="data")
    (tree,) = root.iterdir()
    edit(tree)
    out = tmp_path / f"megatron_core-{version}.tar.gz"
    with tarfile.open(out, "w:gz") as archive:
        archive.add(tree, arcname=f"megatron_core-{version}")
    return out, hashlib.sha256(out.read_bytes()).hexdigest()


def _prepend_line(path: Path, line: str) -> None:
    path.write_text(line + "\n" + path.read_text())


def test_rebase_merges_onto_a_shifted_upstream(sdist, tmp_path):
    def shift_everything(tree):
        for rel in ["megatron/core/parallel_state.py", "megatron/core/optimizer/optimizer.py"]:
            _prepend_line(tree / rel, "# a line added upstream")

    new_sdist, digest = _variant_sdist(sdist, tmp_path, "0.16.99", shift_everything)
    out = tmp_path / "series-0.16.99"
    result = fork("rebase", "--onto", "0.16.99", "--sdist", new_sdist, "--sha256", digest,
                  "--workdir", tmp_path / "tree", "--out", out, check_rc=0)
    assert "wrote" in result.stdout
    names = (out / "series").read_text().split()
    assert names == [p.name for p in series_patches(VERSION)]


def test_rebase_stops_at_a_conflict_naming_patch_file_and_hunk(sdist, tmp_path):
    def conflict(tree):
        path = tree / "megatron/core/optimizer/grad_scaler.py"
        path.write_text(path.read_text().replace(
            "self._scale = torch.tensor([initial_scale], dtype=torch.float, device='cuda')",
            "self._scale = torch.full([1], initial_scale, dtype=torch.float, device='cuda')"))

    new_sdist, digest = _variant_sdist(sdist, tmp_path, "0.16.98", conflict)
    result = fork("rebase", "--onto", "0.16.98", "--sdist", new_sdist, "--sha256", digest,
                  "--workdir", tmp_path / "tree", "--out", tmp_path / "out", check_rc=1)
    first = series_patches(VERSION)[0].name
    assert f"{first}: FAILED" in result.stdout
    assert "conflict in megatron/core/optimizer/grad_scaler.py at line" in result.stdout
    assert "am --continue" in result.stdout
    assert not (tmp_path / "out").exists()


def test_every_subcommand_has_help():
    for command in ["prepare", "install", "export", "check", "rebase"]:
        result = fork(command, "--help", check_rc=0)
        assert "usage: tools/fork " + command in result.stdout


def test_install_is_a_no_op_when_the_build_matches():
    result = fork("install", check_rc=0)
    assert "nothing to do" in result.stdout
