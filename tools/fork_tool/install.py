"""Build the patched megatron-core from pristine upstream plus the committed series and install it.

The installed distribution is `megatron-core==<upstream>+mtp.<series digest>`. The
development install is editable and links megatron/core/fork to this checkout, so
edits to fork-owned files take effect at once; `--copy` installs a plain copy.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from fork_tool import upstream
from fork_tool.errors import ForkError
from fork_tool.git import init_pristine
from fork_tool.series import BUILD_DIR, FORK_OWNED_REL, PRISTINE_TAG, apply_series
from megatron.training.patched_core import (
    FORK_OWNED_DIR,
    current_upstream_version,
    expected_build_version,
    series_patches,
)

INSTALL_DIR = BUILD_DIR / "install"
VERSION_LINE = re.compile(r"^__version__ = .*$", re.M)


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


def is_current(python: str, expected: str, copy: bool) -> bool:
    version, location = installed_state(python)
    if version != expected or location is None:
        return False
    linked = Path(location).resolve() == FORK_OWNED_DIR.resolve()
    return linked != copy


def build_tree(version: str, build_version: str, copy: bool) -> Path:
    tree = INSTALL_DIR / f"megatron-core-{build_version}"
    shutil.rmtree(tree, ignore_errors=True)
    INSTALL_DIR.mkdir(parents=True, exist_ok=True)
    upstream.unpack(upstream.verified_sdist(version), tree)
    init_pristine(tree, PRISTINE_TAG)
    report = apply_series(tree, series_patches(version))
    if report and report[-1][1] != "ok":
        raise ForkError(f"patch {report[-1][0]} does not apply to pristine {version}:\n{report[-1][1]}")
    package_info = tree / "megatron" / "core" / "package_info.py"
    text, count = VERSION_LINE.subn(f"__version__ = {build_version!r}  # tools/fork install", package_info.read_text())
    if count != 1:
        raise ForkError(f"cannot stamp the build version: {package_info} has {count} __version__ lines")
    package_info.write_text(text)
    target = tree / FORK_OWNED_REL
    if copy:
        shutil.copytree(FORK_OWNED_DIR, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    else:
        target.symlink_to(FORK_OWNED_DIR)
    return tree


def pip_install(python: str, tree: Path, editable: bool) -> None:
    # The sdist's setup.py runs `python3 -m pybind11`: the target environment must come first.
    env = dict(os.environ, PATH=str(Path(python).parent) + os.pathsep + os.environ.get("PATH", ""))
    args = [python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
            "--disable-pip-version-check"]
    args += ["-e", str(tree), "--config-settings", "editable_mode=compat"] if editable else [str(tree)]
    result = subprocess.run(args, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise ForkError(
            "pip could not install the patched megatron-core "
            "(the environment needs setuptools<80 and pybind11; `bash tools/bootstrap` sets it up):\n"
            + "\n".join(result.stderr.strip().splitlines()[-15:])
        )


def install(version: str | None = None, copy: bool = False, force: bool = False,
            python: str = sys.executable) -> str:
    version = version or current_upstream_version()
    build_version = expected_build_version(version)
    if not force and is_current(python, build_version, copy):
        return f"megatron-core {build_version} is already installed; nothing to do"
    tree = build_tree(version, build_version, copy)
    pip_install(python, tree, editable=not copy)
    for stale in INSTALL_DIR.iterdir():
        if stale != tree:
            shutil.rmtree(stale, ignore_errors=True)
    if copy:
        shutil.rmtree(tree)
    if not is_current(python, build_version, copy):
        raise ForkError(f"installed megatron-core does not report {build_version}; see pip's output above")
    return f"installed megatron-core {build_version} ({'copy' if copy else 'editable, fork files linked'})"
