# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Pristine upstream megatron-core: download the sdist, verify its sha256, unpack it."""

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from megatron_mtp.patched_core import BUILD_DIR, upstream_config

from .errors import ForkError

# Downloaded sdists are cached here (MEGATRON_MTP_DOWNLOADS overrides it, e.g. in tests).
DOWNLOAD_DIR = Path(os.environ.get("MEGATRON_MTP_DOWNLOADS", BUILD_DIR / "downloads"))


def known_sha256(version: str) -> str:
    versions = upstream_config().get("versions", {})
    if version not in versions:
        known = ", ".join(sorted(versions)) or "none"
        raise ForkError(
            f"unknown megatron-core version {version!r}: patches/upstream.toml knows {known}. "
            f"Add [versions.\"{version}\"] with its sdist_sha256, or pass --sha256."
        )
    return versions[version]["sdist_sha256"]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sdist_name(version: str) -> str:
    return f"megatron_core-{version}.tar.gz"


def download(version: str) -> Path:
    """Fetch the sdist with pip (the registry client configured on this machine).

    Only the source is fetched, to be patched and verified, so the release's declared
    Requires-Python does not apply here (megatron-core 0.17+ declares >= 3.12).
    """
    target = DOWNLOAD_DIR / sdist_name(version)
    if target.is_file():
        return target
    DOWNLOAD_DIR.mkdir(parents=True, exist_ok=True)
    staging = DOWNLOAD_DIR / f".partial-{version}"
    shutil.rmtree(staging, ignore_errors=True)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
         "--ignore-requires-python", "--disable-pip-version-check", "-d", str(staging),
         f"megatron-core=={version}"],
        capture_output=True, text=True,
    )
    downloaded = staging / sdist_name(version)
    if result.returncode != 0 or not downloaded.is_file():
        shutil.rmtree(staging, ignore_errors=True)
        raise ForkError(
            f"could not download the megatron-core {version} sdist (no network, or no such release?): "
            + pip_reason(result.stderr)
        )
    downloaded.rename(target)
    shutil.rmtree(staging, ignore_errors=True)
    return target


def pip_reason(stderr: str) -> str:
    """pip's own explanation: its ERROR lines (the last line alone often drops the reason)."""
    errors = [line.strip() for line in stderr.splitlines() if line.startswith("ERROR:")]
    return " ".join(errors) or (stderr.strip().splitlines() or ["pip gave no output"])[-1]


def verified_sdist(version: str, sha256: str | None = None, sdist: Path | None = None) -> Path:
    expected = sha256 or known_sha256(version)
    path = Path(sdist) if sdist else download(version)
    if not path.is_file():
        raise ForkError(f"sdist not found: {path}")
    actual = sha256_of(path)
    if actual != expected:
        raise ForkError(
            f"sha256 mismatch for {path}: expected {expected}, got {actual}. "
            "The file is not the pinned upstream release; delete it and retry."
        )
    return path


def unpack(sdist: Path, destination: Path) -> None:
    """Unpack the sdist's single top-level directory as `destination`."""
    if destination.exists():
        raise ForkError(f"{destination} already exists")
    staging = destination.parent / f".unpack-{destination.name}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    with tarfile.open(sdist) as archive:
        archive.extractall(staging, filter="data")
    roots = list(staging.iterdir())
    if len(roots) != 1 or not roots[0].is_dir():
        shutil.rmtree(staging)
        raise ForkError(f"{sdist} does not hold a single top-level directory")
    roots[0].rename(destination)
    staging.rmdir()
