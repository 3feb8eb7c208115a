"""Move the series onto another upstream version with 3-way merges (`git am -3`)."""

import shutil
from pathlib import Path

from fork_tool import upstream
from fork_tool.errors import ForkError
from fork_tool.git import git, init_pristine
from fork_tool.series import PRISTINE_TAG, apply_series, default_workdir, format_series, link_fork_owned
from megatron.training.patched_core import series_dir, series_patches


def rebase(from_version: str, onto: str, sha256: str | None = None, sdist: Path | None = None,
           workdir: Path | None = None, out_dir: Path | None = None,
           force: bool = False) -> tuple[bool, list[str]]:
    patches = series_patches(from_version)
    tarball = upstream.verified_sdist(onto, sha256=sha256, sdist=sdist)
    # The 3-way merge needs the blobs the patches were made against: pristine `from_version`.
    base = upstream.verified_sdist(from_version)
    tree = Path(workdir or default_workdir(onto))
    if tree.exists():
        if not force:
            raise ForkError(f"{tree} already exists; pass --force to replace it")
        shutil.rmtree(tree)
    old = tree.parent / f".rebase-base-{from_version}"
    shutil.rmtree(old, ignore_errors=True)
    upstream.unpack(base, old)
    init_pristine(old, f"upstream-{from_version}")
    upstream.unpack(tarball, tree)
    init_pristine(tree, PRISTINE_TAG)
    git(tree, "fetch", "-q", str(old), f"refs/tags/upstream-{from_version}:refs/tags/upstream-{from_version}")
    shutil.rmtree(old)
    link_fork_owned(tree)

    report = apply_series(tree, patches, three_way=True)
    lines = [f"rebase of {len(patches)} patch(es) from {from_version} onto {onto} in {tree}"]
    lines += [f"  {name}: {status}" for name, status in report]
    if report and report[-1][1] != "ok":
        lines += [
            f"Stopped at {report[-1][0]}. Resolve the conflict in {tree}, then run",
            f"  git -C {tree} add <files> && git -C {tree} am --continue",
            f"for the rest, and `tools/fork export --version {onto} --workdir {tree}` when `git am` is done.",
        ]
        return False, lines
    out_dir = Path(out_dir or series_dir(onto))
    names = format_series(tree, out_dir)
    lines.append(f"wrote {len(names)} patch(es) to {out_dir}; set `current` in patches/upstream.toml "
                 f"(with the sdist_sha256 of {onto}) to build it")
    return True, lines
