# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Thin wrapper around the git command line with settings that keep patch output stable."""

import subprocess
from pathlib import Path

from .errors import ForkError

IDENTITY = ["-c", "user.name=Megatron-MTP", "-c", "user.email=megatron-mtp@users.noreply.localhost"]
# format-patch output must not depend on the user's git configuration or on how many
# objects a repository holds (abbreviated hashes grow with it).
STABLE_DIFF = ["-c", "core.abbrev=12", "-c", "diff.algorithm=myers", "-c", "diff.noprefix=false",
               "-c", "diff.mnemonicPrefix=false", "-c", "format.signature=", "-c", "diff.renames=true"]


def git(cwd: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(
        ["git", *IDENTITY, *STABLE_DIFF, *args], cwd=cwd, capture_output=True, text=True
    )
    if check and result.returncode != 0:
        raise ForkError(f"git {' '.join(args)} failed in {cwd}:\n{result.stderr.strip() or result.stdout.strip()}")
    return result


def is_dirty(cwd: Path) -> bool:
    return bool(git(cwd, "status", "--porcelain", "--untracked-files=no").stdout.strip())


def init_pristine(directory: Path, tag: str) -> None:
    """Make `directory` (holding an unpacked upstream tree) a repository with one commit."""
    git(directory, "init", "-q", "-b", "work")
    git(directory, "add", "-A")
    git(directory, "commit", "-q", "-m", f"{tag} (pristine)", "--date", "2000-01-01T00:00:00+00:00")
    git(directory, "tag", tag)
