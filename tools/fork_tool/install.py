# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Build the patched megatron-core from pristine upstream plus the committed series, and
install it (`install`) or leave it ready to import from its tree (`build`).

A build is `megatron-core==<upstream>+mtp.<series digest>` in .build/install/. `install`
puts it into an environment, editable, with megatron/core/fork linked to this checkout (so
edits to fork-owned files take effect at once), or as a plain copy (`--copy`). `build`
compiles its C++ helpers in place and stops there: the test suite imports such trees for
the carried versions that are not installed (`current` is the installed one).
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from packaging.version import Version

from megatron_mtp.patched_core import (
    FORK_OWNED_DIR,
    INSTALL_DIR,
    build_tree,
    expected_build_version,
    series_patches,
)

from . import upstream
from .errors import ForkError
from .git import init_pristine
from .series import FORK_OWNED_REL, PRISTINE_TAG, apply_series

VERSION_LINE = re.compile(r"^__version__ = .*$", re.M)
LATER_VERSION_CHANGE = re.compile(r"^(\s+)__version__ \+= .*$", re.M)
BUILT_MARK = ".fork-build-complete"


def installed_state(python: str) -> tuple[str | None, str | None]:
    """(version, location of megatron.core.fork) as the target interpreter sees them."""
    probe = (
        "import importlib.metadata as m, importlib.util as u\n"
        "try: v = m.version('megatron-core')\nexcept m.PackageNotFoundError: v = ''\n"
        "s = u.find_spec('megatron.core.fork') if v else None\n"
        "print(v); print(s.submodule_search_locations[0] if s else '')\n"
    )
    result = subprocess.run([python, "-c", probe], capture_output=True, text=True)
    if result.returncode != 0:
        return None, None
    version, location = (result.stdout.splitlines() + ["", ""])[:2]
    return version or None, location or None


def is_installed(python: str, expected: str, copy: bool) -> bool:
    version, location = installed_state(python)
    # pip reports the normalized version: a digest like 055... loses its leading zero.
    if version is None or Version(version) != Version(expected) or location is None:
        return False
    linked = Path(location).resolve() == FORK_OWNED_DIR.resolve()
    return linked != copy


def is_built(version: str) -> bool:
    """The tree of this checkout's build of `version` exists, complete, fork files linked."""
    tree = build_tree(version)
    link = tree / FORK_OWNED_REL
    return (tree / BUILT_MARK).is_file() and link.is_symlink() and link.resolve() == FORK_OWNED_DIR.resolve()


def make_tree(version: str, copy: bool) -> Path:
    """Pristine sdist + `git am` of the series, version stamped, fork-owned files linked or copied."""
    build_version = expected_build_version(version)
    tree = build_tree(version)
    shutil.rmtree(tree, ignore_errors=True)
    INSTALL_DIR.mkdir(parents=True, exist_ok=True)
    upstream.unpack(upstream.verified_sdist(version), tree)
    init_pristine(tree, PRISTINE_TAG)
    report = apply_series(tree, series_patches(version))
    if report and report[-1][1] != "ok":
        raise ForkError(f"patch {report[-1][0]} does not apply to pristine {version}:\n{report[-1][1]}")
    stamp_version(tree / "megatron" / "core" / "package_info.py", build_version)
    target = tree / FORK_OWNED_REL
    if copy:
        shutil.copytree(FORK_OWNED_DIR, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    else:
        target.symlink_to(FORK_OWNED_DIR)
    return tree


def stamp_version(package_info: Path, build_version: str) -> None:
    """The build version as a literal, and nothing that changes it afterwards (0.17+ append
    the git hash of whatever repository surrounds the tree)."""
    text, count = VERSION_LINE.subn(f"__version__ = {build_version!r}  # tools/fork install", package_info.read_text())
    if count != 1:
        raise ForkError(f"cannot stamp the build version: {package_info} has {count} __version__ lines")
    text = LATER_VERSION_CHANGE.sub(r"\1pass  # tools/fork install: the version is the build's", text)
    package_info.write_text(text)


def remove_stale_trees(version: str) -> None:
    """Trees of older builds of `version` (another series digest); other versions' stay."""
    keep = build_tree(version)
    for tree in INSTALL_DIR.glob(f"megatron-core-{version}+mtp.*"):
        if tree != keep:
            shutil.rmtree(tree, ignore_errors=True)


def _build_env(python: str) -> dict:
    # The sdist's setup.py runs `python3 -m pybind11`: the target environment must come first.
    return dict(os.environ, PATH=str(Path(python).parent) + os.pathsep + os.environ.get("PATH", ""))


def _run(args: list, what: str, python: str, cwd: Path | None = None) -> None:
    result = subprocess.run(args, capture_output=True, text=True, env=_build_env(python), cwd=cwd)
    if result.returncode != 0:
        raise ForkError(
            f"{what} failed (the environment needs setuptools<80 and pybind11; "
            "`bash tools/bootstrap` sets it up):\n" + "\n".join(result.stderr.strip().splitlines()[-15:])
        )


def pip_install(python: str, tree: Path, editable: bool) -> None:
    # --ignore-requires-python: megatron-core 0.17+ declares Python >= 3.12, and the series'
    # compatibility patch makes it run on 3.11 (the suite tests exactly that).
    args = [python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
            "--ignore-requires-python", "--disable-pip-version-check"]
    args += ["-e", str(tree), "--config-settings", "editable_mode=compat"] if editable else [str(tree)]
    _run(args, "pip install of the patched megatron-core", python)


def build(version: str, force: bool = False, python: str = sys.executable) -> str:
    """The patched tree of `version` with its C++ helpers compiled in place, not installed."""
    if not force and is_built(version):
        return f"megatron-core {expected_build_version(version)} is already built in {build_tree(version)}"
    tree = make_tree(version, copy=False)
    _run([python, "setup.py", "--quiet", "build_ext", "--inplace"], "building the C++ helpers", python, cwd=tree)
    (tree / BUILT_MARK).touch()
    remove_stale_trees(version)
    return f"built megatron-core {expected_build_version(version)} in {tree}"


def install(version: str, copy: bool = False, force: bool = False, python: str = sys.executable) -> str:
    build_version = expected_build_version(version)
    if not force and is_installed(python, build_version, copy):
        return f"megatron-core {build_version} is already installed; nothing to do"
    # an editable install into another environment (a framework's) takes the build already there
    tree = build_tree(version) if not copy and not force and is_built(version) else make_tree(version, copy)
    pip_install(python, tree, editable=not copy)
    if copy:
        shutil.rmtree(tree)
    else:
        (tree / BUILT_MARK).touch()  # editable: the installed tree is also the build tree
    remove_stale_trees(version)
    if not is_installed(python, build_version, copy):
        raise ForkError(f"installed megatron-core does not report {build_version}; see pip's output above")
    return f"installed megatron-core {build_version} ({'copy' if copy else 'editable, fork files linked'})"
