"""Which megatron-core build this checkout needs, and a runtime check for it.

The build tag is a digest of the committed patch series, so a checkout whose
series changed (a pull, a new patch) no longer matches the installed build and
says so before any model is built. The same digest names the build that
``tools/fork install`` produces; both use this module.
"""

import hashlib
import importlib.metadata
import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PATCHES_DIR = REPO_ROOT / "patches"
FORK_OWNED_DIR = REPO_ROOT / "megatron" / "core" / "fork"
INSTALL_COMMAND = "tools/fork install"


class PatchedCoreError(RuntimeError):
    pass


def upstream_config() -> dict:
    return tomllib.loads((PATCHES_DIR / "upstream.toml").read_text())


def current_upstream_version() -> str:
    return upstream_config()["current"]


def series_dir(version: str) -> Path:
    return PATCHES_DIR / f"megatron-core-{version}"


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


def fork_owned_digest(directory: Path = FORK_OWNED_DIR) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*.py")):
        digest.update(str(path.relative_to(directory)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def installed_core_version() -> str | None:
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None


def require_patched_core() -> None:
    """Stop with a message naming the fix unless megatron.core is this checkout's patched build."""
    expected = expected_build_version()
    installed = installed_core_version()
    if installed != expected:
        found = "no megatron-core is installed" if installed is None else f"megatron-core {installed} is installed"
        raise PatchedCoreError(
            f"{found}, but this checkout needs the patched build {expected}. "
            f"Run `{INSTALL_COMMAND}` (or `bash tools/bootstrap` on a new machine)."
        )
    import megatron.core.fork

    installed_fork_dir = Path(megatron.core.fork.__file__).resolve().parent
    if installed_fork_dir != FORK_OWNED_DIR.resolve() and fork_owned_digest(installed_fork_dir) != fork_owned_digest():
        raise PatchedCoreError(
            f"megatron.core.fork in {installed_fork_dir} differs from {FORK_OWNED_DIR}. "
            f"Run `{INSTALL_COMMAND}` to install this checkout's fork-owned files."
        )
