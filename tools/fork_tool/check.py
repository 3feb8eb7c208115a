# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Apply the series to pristine upstream, or to a user's Megatron-LM checkout, and report per patch."""

import re
import shutil
import tempfile
from pathlib import Path

from megatron_mtp.patched_core import carried_versions, series_patches

from . import upstream
from .errors import ForkError
from .git import init_pristine
from .series import PRISTINE_TAG, apply_series


def check_pristine(version: str, sdist: Path | None = None) -> list[tuple[str, str]]:
    patches = series_patches(version)
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        upstream.unpack(upstream.verified_sdist(version, sdist=sdist), tree)
        init_pristine(tree, PRISTINE_TAG)
        return apply_series(tree, patches)


def checkout_version(core: Path) -> str | None:
    """MAJOR.MINOR.PATCH from megatron/core/package_info.py, as upstream writes it."""
    info = core / "package_info.py"
    if not info.is_file():
        return None
    fields = dict(re.findall(r"^(MAJOR|MINOR|PATCH)\s*=\s*(\d+)", info.read_text(), re.M))
    if len(fields) != 3:
        return None
    return f"{fields['MAJOR']}.{fields['MINOR']}.{fields['PATCH']}"


def check_checkout(version: str, checkout: Path) -> list[tuple[str, str]]:
    """A Megatron-LM checkout has the same megatron/core paths as the sdist; test on a copy of them."""
    core = Path(checkout) / "megatron" / "core"
    if not (core / "__init__.py").is_file():
        raise ForkError(f"{checkout} is not a Megatron-LM checkout: {core}/__init__.py is missing")
    found = checkout_version(core)
    if found is not None and found != version:
        carried = carried_versions()
        hint = f"--version {found}" if found in carried else f"a checkout of tag core_v{version}"
        raise ForkError(
            f"{checkout} is megatron-core {found}, but this series is for {version} "
            f"(carried: {', '.join(carried)}); use {hint}"
        )
    patches = series_patches(version)
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        # The series touches megatron/core and, from 0.17 on, megatron/training.
        for package in ("core", "training"):
            source = Path(checkout) / "megatron" / package
            if source.is_dir():
                shutil.copytree(source, tree / "megatron" / package, symlinks=True,
                                ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
        init_pristine(tree, PRISTINE_TAG)
        return apply_series(tree, patches)


def report_lines(title: str, report: list[tuple[str, str]], total: int) -> tuple[bool, list[str]]:
    lines = [title] + [f"  {name}: {status}" for name, status in report]
    ok = len(report) == total and all(status == "ok" for _, status in report)
    if not ok and len(report) < total:
        lines.append(f"  ({total - len(report)} later patch(es) not tried)")
    return ok, lines
