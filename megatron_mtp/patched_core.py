# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Which megatron-core builds this checkout carries, where they are, and a runtime check that
the imported megatron.core is one of them (or, where `tools/fork export --for-users` carried
this package into a Megatron-LM checkout, that checkout's patched megatron.core).

Every upstream version with a series in ``patches/`` is carried; ``current`` in
``patches/upstream.toml`` is the one ``tools/fork install`` installs. A build is named
``<upstream>+mtp.<digest of its series>``, so a checkout whose series changed (a pull,
a new patch) no longer matches what is built and says so before any model is built.
Making builds (sdists, `git am`, the series' parts) is tools/fork's (tools/fork_tool), which
names builds with this module.
"""

import hashlib
from pathlib import Path

import tomllib
from packaging.version import Version

REPO_ROOT = Path(__file__).resolve().parents[1]
PATCHES_DIR = REPO_ROOT / "patches"
FORK_OWNED_DIR = REPO_ROOT / "megatron" / "core" / "fork"
BUILD_DIR = REPO_ROOT / ".build"
INSTALL_DIR = BUILD_DIR / "install"
SERIES_PREFIX = "megatron-core-"
# Written by `tools/fork export --for-users` into the megatron_mtp it carries: the series it came
# from. Its presence says this package runs in a Megatron-LM checkout with that series applied.
EXPORT_MARK = "megatron_mtp/exported_series.txt"


class PatchedCoreError(RuntimeError):
    pass


def upstream_config() -> dict:
    return tomllib.loads((PATCHES_DIR / "upstream.toml").read_text())


def current_upstream_version() -> str:
    return upstream_config()["current"]


def series_dir(version: str) -> Path:
    return PATCHES_DIR / f"{SERIES_PREFIX}{version}"


def carried_versions() -> list[str]:
    """Every upstream version with a committed series, newest first."""
    versions = [d.name[len(SERIES_PREFIX):] for d in PATCHES_DIR.glob(f"{SERIES_PREFIX}*")
                if (d / "series").is_file()]
    return sorted(versions, key=Version, reverse=True)


def series_patches(version: str) -> list[Path]:
    """Patch files in the order of the ``series`` file (quilt format: one name per line)."""
    directory = series_dir(version)
    series_file = directory / "series"
    if not series_file.is_file():
        raise PatchedCoreError(f"no patch series for megatron-core {version}: {series_file} is missing")
    names = [
        line.strip()
        for line in series_file.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    return [directory / name for name in names]


def series_digest(version: str) -> str:
    digest = hashlib.sha256()
    for patch in series_patches(version):
        digest.update(patch.name.encode() + b"\0" + patch.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def expected_build_version(version: str | None = None) -> str:
    version = version or current_upstream_version()
    return f"{version}+mtp.{series_digest(version)}"


def build_tree(version: str | None = None) -> Path:
    """Where `tools/fork install` / `tools/fork build` put the patched tree of `version`."""
    return INSTALL_DIR / f"megatron-core-{expected_build_version(version)}"


def fix_command(version: str) -> str:
    """The command that makes the build of `version` that this checkout needs."""
    if version == current_upstream_version():
        return "tools/fork install"
    return f"tools/fork build --version {version}"


def fork_owned_digest(directory: Path = FORK_OWNED_DIR) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*.py")):
        digest.update(str(path.relative_to(directory)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def imported_core_version() -> str | None:
    """The version megatron.core reports where it is imported from (None: not importable)."""
    try:
        from megatron.core import package_info
    except ImportError:
        return None
    return package_info.__version__


def require_patched_core(version: str | None = None) -> None:
    """Stop with a message naming the fix unless the imported megatron.core carries this
    checkout's series: here, the patched build of `version` (default: `current`); in a
    Megatron-LM checkout that the exported series was applied to (`tools/fork export
    --for-users`, which carries this package; it has no patches/), that checkout's own."""
    if not (PATCHES_DIR / "upstream.toml").is_file():
        if not (REPO_ROOT / EXPORT_MARK).is_file():
            raise PatchedCoreError(
                f"{REPO_ROOT} is neither a Megatron-MTP checkout (no patches/) nor a Megatron-LM checkout that "
                "`tools/fork export --for-users` was applied to: run from a Megatron-MTP clone "
                "(`bash tools/bootstrap`)"
            )
        _require_applied_series()
        return
    version = version or current_upstream_version()
    expected = expected_build_version(version)
    found = imported_core_version()
    if found != expected:
        what = "no megatron-core is installed" if found is None else f"megatron-core {found} is imported"
        raise PatchedCoreError(
            f"{what}, but this checkout needs the patched build {expected}. "
            f"Run `{fix_command(version)}` (or `bash tools/bootstrap` on a new machine)."
        )
    _require_fork_files(f"Run `{fix_command(version)}` to build with this checkout's fork-owned files.")


def _require_applied_series() -> None:
    # Found by path, not imported: a megatron.core without the series (its runtime part
    # included) may not even import on this machine.
    import importlib.util

    spec = importlib.util.find_spec("megatron")
    cores = [Path(location) / "core" for location in (spec.submodule_search_locations or [])] if spec else []
    core = next((path for path in cores if (path / "__init__.py").is_file()), None)
    if core is None:
        raise PatchedCoreError("no megatron.core can be imported: run pretrain_gpt_mtp.py from the root of the "
                               "Megatron-LM checkout the series was applied to")
    if not (core / "fork" / "__init__.py").is_file():
        raise PatchedCoreError(
            f"megatron.core in {core} does not carry the Megatron-MTP series "
            f"({(REPO_ROOT / EXPORT_MARK).read_text().strip()}): apply the series that "
            "`tools/fork export --for-users` writes (git am) to this checkout"
        )
    _require_fork_files("Run from this checkout, or install it (pip install -e .) instead of that copy.")
    _require_dataset_helpers(core)


def _require_dataset_helpers(core: Path) -> None:
    """Upstream's first use of a checkout's datasets compiles their C++ helpers with `make`,
    which asks the system's python3-config and python3 for pybind11: another Python's module,
    or a compiler error. The command here builds them for this Python, as the sdist's build does."""
    import importlib.machinery
    import importlib.util
    import os
    import sys

    datasets = core / "datasets"
    if any((datasets / f"helpers_cpp{suffix}").is_file() for suffix in importlib.machinery.EXTENSION_SUFFIXES):
        return
    python = sys.executable
    pybind11 = "" if importlib.util.find_spec("pybind11") else f"{python} -m pip install pybind11 && "
    # setup.py runs `python3 -m pybind11`: this Python's directory first on PATH
    raise PatchedCoreError(
        f"the C++ dataset helpers (megatron/core/datasets/helpers.cpp) are not built for this Python ({python}): "
        f"build them with `cd {core.parent.parent} && {pybind11}PATH={os.path.dirname(python)}:$PATH {python} "
        "setup.py build_ext --inplace`"
    )


def _require_fork_files(fix: str) -> None:
    import megatron.core.fork

    imported_fork_dir = Path(megatron.core.fork.__file__).resolve().parent
    if imported_fork_dir != FORK_OWNED_DIR.resolve() and fork_owned_digest(imported_fork_dir) != fork_owned_digest():
        raise PatchedCoreError(f"megatron.core.fork in {imported_fork_dir} differs from {FORK_OWNED_DIR}. {fix}")
