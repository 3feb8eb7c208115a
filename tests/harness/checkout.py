# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""A user's Megatron-LM checkout: a pristine megatron-core sdist as a git tree, with an exported
series applied by `git am`, as a user applies it (the sdist has the checkout's megatron/ paths)."""

import subprocess
import tarfile
from pathlib import Path

GIT = ["git", "-c", "user.name=u", "-c", "user.email=u@localhost"]


def pristine_checkout(sdist: Path, root: Path) -> Path:
    """The sdist unpacked into `root`/tree as one commit, tagged `pristine`."""
    tree = root / "tree"
    with tarfile.open(sdist) as archive:
        archive.extractall(root / "src", filter="data")
    (source,) = (root / "src").iterdir()
    source.rename(tree)
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "pristine"], ["tag", "pristine"]):
        subprocess.run([*GIT, *args], cwd=tree, check=True, capture_output=True)
    return tree


def applied_checkout(series_dir: Path, sdist: Path, root: Path) -> Path:
    """`pristine_checkout` with every patch that `series_dir`'s `series` file lists applied."""
    tree = pristine_checkout(sdist, root)
    patches = [str(series_dir / name) for name in (series_dir / "series").read_text().split()]
    result = subprocess.run([*GIT, "am", "-q", *patches], cwd=tree, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    return tree


def edited_checkout(sdist: Path, root: Path, *edits) -> Path:
    """`pristine_checkout`, then one commit per `edit(tree)`: a checkout upstream moved on from the tag."""
    tree = pristine_checkout(sdist, root)
    for edit in edits:
        edit(tree)
        subprocess.run([*GIT, "commit", "-q", "-a", "-m", "upstream change"], cwd=tree, check=True, capture_output=True)
    return tree
