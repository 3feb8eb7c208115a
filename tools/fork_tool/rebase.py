# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Move the series onto another upstream version with 3-way merges (`git am -3`)."""

import shutil
import subprocess
from pathlib import Path

from megatron_mtp.patched_core import series_dir, series_patches

from . import upstream
from .errors import ForkError
from .git import git, init_pristine
from .series import (
    PRISTINE_TAG,
    apply_series,
    check_part_names,
    default_workdir,
    describe_failure,
    format_series,
    link_fork_owned,
    parts,
)

OLD_SERIES_REF = "refs/heads/series-{version}"


def old_series_objects(tree: Path, from_version: str, patches: list[Path]) -> None:
    """Fetch pristine `from_version` with the old series applied into `tree`.

    `git am -3` rebuilds each patch's preimage from the blobs named on its index lines.
    A patch that touches a file an earlier patch changed names a blob that exists only
    after the earlier patches, so the whole old series is applied and fetched, not only
    the pristine tree.
    """
    old = tree.parent / f".rebase-base-{from_version}"
    shutil.rmtree(old, ignore_errors=True)
    try:
        upstream.unpack(upstream.verified_sdist(from_version), old)
        init_pristine(old, f"upstream-{from_version}")
        link_fork_owned(old)
        report = apply_series(old, patches)
        if report and report[-1][1] != "ok":
            raise ForkError(f"the {from_version} series does not apply to its own upstream:\n{report[-1][1]}")
        git(tree, "fetch", "-q", str(old), f"HEAD:{OLD_SERIES_REF.format(version=from_version)}")
    finally:
        shutil.rmtree(old, ignore_errors=True)


def rebase(from_version: str, onto: str, sha256: str | None = None, sdist: Path | None = None,
           workdir: Path | None = None, out_dir: Path | None = None,
           force: bool = False) -> tuple[bool, list[str]]:
    patches = series_patches(from_version)
    tarball = upstream.verified_sdist(onto, sha256=sha256, sdist=sdist)
    tree = Path(workdir or default_workdir(onto))
    if tree.exists():
        if not force:
            raise ForkError(f"{tree} already exists; pass --force to replace it")
        shutil.rmtree(tree)
    upstream.unpack(tarball, tree)
    init_pristine(tree, PRISTINE_TAG)
    old_series_objects(tree, from_version, patches)
    link_fork_owned(tree)

    report = apply_series(tree, patches, three_way=True)
    lines = [f"rebase of {len(patches)} patch(es) from {from_version} onto {onto} in {tree}"]
    lines += [f"  {name}: {status}" for name, status in report]
    export = f"tools/fork export --version {onto} --workdir {tree}" + (f" --out {out_dir}" if out_dir else "")
    if report and report[-1][1] != "ok":
        lines += [
            f"Stopped at {report[-1][0]}. Resolve the conflict in {tree}, then run",
            f"  git -C {tree} add <files> && git -C {tree} am --continue",
            f"for the rest, and `{export}` when `git am` is done.",
        ]
        return False, lines
    out_dir = Path(out_dir or series_dir(onto))
    names = format_series(tree, out_dir)
    lines.append(f"wrote {len(names)} patch(es) to {out_dir}; set `current` in patches/upstream.toml "
                 f"(with the sdist_sha256 of {onto}) to build it")
    return True, lines


def carry(from_version: str, checkout: Path, rev: str = "HEAD", workdir: Path | None = None,
          force: bool = False, keep_going: bool = False, without: tuple = ()) -> tuple[bool, list[str]]:
    """The series onto a Megatron-LM checkout at any commit (`rev` of the git repository at
    `checkout`, bare or not): its `megatron/` tree becomes the base, and each patch is merged
    three ways from the pinned upstream's blobs, as `rebase` does with a released sdist.
    Stops at the first conflict unless `keep_going`, which tries every patch (skipping
    those that conflict) and reports each: `applied`, `merged (3-way)` or the conflict's
    files and hunks: a measure of how far the series is from that commit. `without`: parts
    left out (e.g. runtime, which a GPU user does not need)."""
    check_part_names(without)
    patches = [patch for patch, part in parts(from_version) if part not in without]
    commit = git(checkout, "rev-parse", "--verify", f"{rev}^{{commit}}").stdout.strip()
    tree = Path(workdir or default_workdir(f"main-{commit[:12]}"))
    if tree.exists():
        if not force:
            raise ForkError(f"{tree} already exists; pass --force to replace it")
        shutil.rmtree(tree)
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(checkout), "archive", commit, "megatron"], capture_output=True)
    if archive.returncode != 0:
        raise ForkError(f"{checkout} at {commit[:12]} has no megatron/ tree: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    init_pristine(tree, PRISTINE_TAG)
    old_series_objects(tree, from_version, series_patches(from_version))
    link_fork_owned(tree)

    left_out = f" (without the {', '.join(without)} part)" if without else ""
    lines = [f"carry of {len(patches)} patch(es) from {from_version}{left_out} onto {checkout} at {commit[:12]} "
             f"in {tree}"]
    if not keep_going:
        report = apply_series(tree, patches, three_way=True)
        lines += [f"  {name}: {status}" for name, status in report]
        if report and report[-1][1] != "ok":
            lines += [f"Stopped at {report[-1][0]}. Resolve the conflict in {tree}, then run",
                      f"  git -C {tree} add <files> && git -C {tree} am --continue"]
            return False, lines
        return True, lines
    clean = True
    for patch in patches:
        exact = git(tree, "apply", "--check", str(patch), check=False).returncode == 0
        result = git(tree, "am", "--quiet", "--keep-cr", "-3", str(patch), check=False)
        if result.returncode == 0:
            lines.append(f"  {patch.name}: {'applied' if exact else 'merged (3-way)'}")
            continue
        clean = False
        lines.append(f"  {patch.name}: CONFLICT, skipped\n{describe_failure(tree, result)}")
        git(tree, "am", "--abort", check=False)
    return clean, lines
